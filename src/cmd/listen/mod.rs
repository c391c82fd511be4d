//! Accepting a server's connections within limits: a cap on connections open at once and one
//! per client address, each connection over either refused at once, and the deadlines every
//! connection must keep. A client that opens connections and never finishes a request holds
//! at most its share of them, and only for seconds, so it cannot starve others or exhaust the
//! process's file descriptors. `hslake serve-capture` serves HTTP through [`http`],
//! `hslake serve-sql` gRPC through [`grpc`].
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use hslake_schemas::units::DurationRange;
use tokio::net::{TcpListener, TcpStream};

#[cfg(feature = "sql")]
pub mod grpc;
#[cfg(feature = "capture")]
pub mod http;

/// `--header-timeout`: a millisecond up to an hour.
const HEADER_TIMEOUT: DurationRange = DurationRange::seconds(
    "--header-timeout",
    Duration::from_millis(1),
    Duration::from_secs(3600),
);
/// `--idle-timeout`: a millisecond up to a day.
const IDLE_TIMEOUT: DurationRange = DurationRange::seconds(
    "--idle-timeout",
    Duration::from_millis(1),
    Duration::from_secs(86_400),
);
/// Descriptors kept free of connections for the process's own files, sockets to object
/// stores and the listener itself.
const RESERVED_FDS: u64 = 256;

/// How many connections a server holds, from whom, and for how long.
#[derive(clap::Args, Debug, Clone)]
pub struct ConnArgs {
    /// Connections open at once; one more is refused at once. Together with 256 descriptors
    /// kept for files, it must fit the process's open-file limit (ulimit -n).
    #[arg(long, default_value_t = 512)]
    pub max_connections: usize,
    /// Connections open at once from one client address (for IPv6, one /64); one more is
    /// refused at once.
    #[arg(long, default_value_t = 64)]
    pub max_connections_per_client: usize,
    /// Time a new connection has to send its first request's headers (for gRPC, the HTTP/2
    /// preface and first frame), e.g. 5s.
    #[arg(long, default_value = "5s", value_parser = HEADER_TIMEOUT.parser())]
    pub header_timeout: Duration,
    /// A connection with no request in flight is closed after this long (for gRPC: one that
    /// sends nothing, not even the answer to the server's keep-alive pings), e.g. 60s.
    #[arg(long, default_value = "60s", value_parser = IDLE_TIMEOUT.parser())]
    pub idle_timeout: Duration,
}

impl ConnArgs {
    /// Refuses caps of zero and a `--max-connections` the open-file limit cannot hold, after
    /// raising that limit's soft value to its hard one.
    pub fn check(&self) -> Result<()> {
        if self.max_connections == 0 || self.max_connections_per_client == 0 {
            bail!(
                "--max-connections {} and --max-connections-per-client {}: expected at least 1 each",
                self.max_connections,
                self.max_connections_per_client
            );
        }
        let files = raise_open_file_limit();
        if let Some(files) = files.filter(|&f| self.max_connections as u64 + RESERVED_FDS > f) {
            bail!(
                "--max-connections {}: the process may open only {files} files (RLIMIT_NOFILE) and \
                 keeps {RESERVED_FDS} for its own; lower it or raise the limit (ulimit -n)",
                self.max_connections
            );
        }
        Ok(())
    }
}

/// Raises the soft open-file limit to the hard one (as Go's runtime does: descriptors are
/// what a connection cap is about); returns the soft limit now in force, if known.
fn raise_open_file_limit() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return None;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim = raised;
            }
        }
    }
    // rlim_t is u64 on Linux but not on every platform libc serves.
    #[allow(clippy::unnecessary_cast)]
    Some(lim.rlim_cur as u64)
}

/// Connections the kernel queues for `accept`: a flood fills tokio's default of 1024 between two
/// turns of the accept loop, and a legitimate client whose handshake is dropped then waits a
/// second for its retry. The kernel caps it at `net.core.somaxconn`.
const LISTEN_BACKLOG: u32 = 4096;

/// A listener on `addr` with a deep accept queue.
pub fn bind(addr: SocketAddr) -> Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
    }
    .and_then(|s| {
        s.set_reuseaddr(true)?;
        s.bind(addr)?;
        Ok(s)
    })
    .with_context(|| format!("binding {addr}"))?;
    socket
        .listen(LISTEN_BACKLOG)
        .with_context(|| format!("listening on {addr}"))
}

/// Why a connection was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// `--max-connections` are open.
    Full(usize),
    /// `--max-connections-per-client` are open from this client.
    Client(IpAddr, usize),
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Full(n) => write!(
                f,
                "the server holds its --max-connections {n} connections; retry shortly"
            ),
            Refusal::Client(ip, n) => write!(
                f,
                "{ip} holds --max-connections-per-client {n} connections already; close some"
            ),
        }
    }
}

/// Counts open connections, in all and per client, against the caps.
pub struct Gate {
    max: usize,
    per_client: usize,
    open: Mutex<Open>,
    refused: AtomicU64,
    last_report: Mutex<Instant>,
}

#[derive(Default)]
struct Open {
    total: usize,
    by_client: HashMap<IpAddr, usize>,
}

/// One admitted connection's place under the caps, given back when dropped.
pub struct Permit {
    gate: Arc<Gate>,
    client: IpAddr,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut open = self.gate.lock();
        open.total -= 1;
        if let Some(n) = open.by_client.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                open.by_client.remove(&self.client);
            }
        }
    }
}

impl Gate {
    /// A gate with `args`' caps.
    pub fn new(args: &ConnArgs) -> Arc<Self> {
        Arc::new(Gate {
            max: args.max_connections,
            per_client: args.max_connections_per_client,
            open: Mutex::new(Open::default()),
            refused: AtomicU64::new(0),
            last_report: Mutex::new(Instant::now()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Open> {
        // Plain counters: a panic elsewhere leaves them usable.
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A permit for a connection from `peer`, or why there is none.
    pub fn admit(self: &Arc<Self>, peer: SocketAddr) -> Result<Permit, Refusal> {
        let client = client_of(peer.ip());
        let mut open = self.lock();
        if open.total >= self.max {
            return Err(Refusal::Full(self.max));
        }
        let mine = open.by_client.entry(client).or_insert(0);
        if *mine >= self.per_client {
            return Err(Refusal::Client(client, self.per_client));
        }
        *mine += 1;
        open.total += 1;
        Ok(Permit {
            gate: self.clone(),
            client,
        })
    }

    /// Connections open now.
    #[cfg(test)]
    pub fn open(&self) -> usize {
        self.lock().total
    }

    /// Counts a refusal; logs the count at most every 10 s, so a flood does not flood the log.
    fn note_refused(&self, why: &Refusal) {
        let n = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        let mut last = self.last_report.lock().unwrap_or_else(|p| p.into_inner());
        if n == 1 || last.elapsed() >= Duration::from_secs(10) {
            *last = Instant::now();
            tracing::warn!(refused_so_far = n, "refusing connections: {why}");
        }
    }
}

/// The address a per-client cap counts under: the IPv4 address (also when mapped into IPv6),
/// or an IPv6 address's /64, which one host usually holds whole.
fn client_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
        },
    }
}

/// Accepts connections until the process ends: each admitted one goes to `serve` with its
/// permit; each refused one to `refuse` (which may write a last word) and is then closed.
pub async fn accept_loop(
    listener: TcpListener,
    gate: Arc<Gate>,
    refuse: impl Fn(&TcpStream, &Refusal),
    mut serve: impl FnMut(TcpStream, SocketAddr, Permit),
) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors despite the cap (other files), and the like: wait rather
                // than spin.
                tracing::warn!("accepting a connection: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        match gate.admit(peer) {
            Ok(permit) => serve(stream, peer, permit),
            Err(why) => {
                gate.note_refused(&why);
                refuse(&stream, &why);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(max: usize, per_client: usize) -> ConnArgs {
        ConnArgs {
            max_connections: max,
            max_connections_per_client: per_client,
            header_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
        }
    }

    fn peer(ip: &str) -> SocketAddr {
        SocketAddr::new(ip.parse().unwrap(), 4000)
    }

    #[test]
    fn caps_connections_per_client_and_in_all_and_frees_them_on_drop() {
        let gate = Gate::new(&args(3, 2));
        let a1 = gate.admit(peer("10.0.0.1")).unwrap();
        let _a2 = gate.admit(peer("10.0.0.1")).unwrap();
        let refused = gate.admit(peer("10.0.0.1")).err().unwrap();
        assert_eq!(refused, Refusal::Client("10.0.0.1".parse().unwrap(), 2));
        assert!(refused
            .to_string()
            .contains("--max-connections-per-client 2"));
        let _b = gate.admit(peer("10.0.0.2")).unwrap();
        assert_eq!(gate.admit(peer("10.0.0.3")).err(), Some(Refusal::Full(3)));
        assert_eq!(gate.open(), 3);
        drop(a1);
        assert_eq!(gate.open(), 2);
        let _c = gate.admit(peer("10.0.0.3")).unwrap();
    }

    #[test]
    fn an_ipv6_client_is_counted_by_its_64_and_a_mapped_ipv4_as_ipv4() {
        let gate = Gate::new(&args(10, 1));
        let _a = gate.admit(peer("2001:db8::1")).unwrap();
        assert!(gate.admit(peer("2001:db8::ffff:2")).is_err());
        let _b = gate.admit(peer("2001:db8:0:1::1")).unwrap();
        let _c = gate.admit(peer("127.0.0.1")).unwrap();
        assert!(gate.admit(peer("::ffff:127.0.0.1")).is_err());
    }

    #[test]
    fn refuses_caps_of_zero_and_more_connections_than_files() {
        assert!(args(0, 1)
            .check()
            .unwrap_err()
            .to_string()
            .contains("at least 1"));
        let e = args(usize::MAX / 2, 1).check().unwrap_err().to_string();
        assert!(e.contains("RLIMIT_NOFILE"), "{e}");
        args(16, 4).check().unwrap();
    }
}
