//! Test support: a proxy running on its own thread inside the test process, stopped on drop.

use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;

use tokio::sync::oneshot;

use crate::counters::Counters;
use crate::error::Error;
use crate::proxy::{Proxy, Shared};
use crate::rules::RuleSet;

/// A running fault proxy; dropping it stops it and closes every connection.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl FaultProxy {
    /// Starts a proxy on a free port of 127.0.0.1 in front of `upstream` (`http://host:port`),
    /// with no rules. Works from sync and async tests alike (it has its own runtime).
    pub fn start(upstream: &str) -> Result<Self, Error> {
        Self::start_with(upstream, &RuleSet::default())
    }

    /// Like [`FaultProxy::start`], with `rules` in force from the first request.
    pub fn start_with(upstream: &str, rules: &RuleSet) -> Result<Self, Error> {
        let proxy = Proxy::bind(0, upstream, rules)?;
        let addr = proxy.local_addr();
        let shared = proxy.shared();
        // Two workers: shard-sized bodies stream through while other requests are served.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("fault-proxy")
            .enable_all()
            .build()
            .map_err(|source| Error::Io {
                what: "cannot start the proxy's runtime".into(),
                source,
            })?;
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("fault-proxy".into())
            .spawn(move || {
                let served = runtime.block_on(proxy.run(async {
                    let _ = stopped.await;
                }));
                if let Err(e) = served {
                    tracing::error!("fault proxy stopped: {e}");
                }
                // Dropping the runtime here ends every connection task with it.
            })
            .map_err(|source| Error::Io {
                what: "cannot start the proxy's thread".into(),
                source,
            })?;
        Ok(FaultProxy {
            addr,
            shared,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// `http://127.0.0.1:<port>`: the S3 endpoint to give clients instead of the upstream.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Replaces the rules (their counters start at 0); on error the old rules stay.
    pub fn set_rules(&self, rules: &RuleSet) -> Result<(), Error> {
        self.shared.injector().replace(rules)
    }

    /// Removes every rule: requests are forwarded untouched.
    pub fn clear_rules(&self) {
        self.shared
            .injector()
            .replace(&RuleSet::default())
            .expect("an empty rule set is valid");
    }

    /// The counters now.
    pub fn counters(&self) -> Counters {
        self.shared.injector().counters()
    }

    /// Sets every counter to 0 (rules' match counts too).
    pub fn reset_counters(&self) {
        self.shared.injector().reset_counters();
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
