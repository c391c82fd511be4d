//! Distributed SQL: a coordinator plans a query over hslake tables and tensor functions into
//! stages that workers (`hslake serve-sql --worker`) run over gRPC, with
//! [datafusion-distributed](https://github.com/datafusion-contrib/datafusion-distributed).
//!
//! The coordinator is a [`crate::QuerySession`] made by [`crate::QuerySession::distributed`]:
//! its planner splits each scan's shard files over a stage's tasks (one task per
//! `cores × 16 MiB` of shards by default, [`Workers::with_partition_bytes`]) and sends each task
//! its part of the plan. Plans travel as DataFusion's protobuf plans; our scan, `ShardScanExec`,
//! travels through [`codec::HslakeCodec`] as the dataset's URL, and our functions travel by name:
//! a worker's session ([`worker::WorkerSessions`]) has the same functions from the same setup
//! as every other session. A worker opens each dataset's store itself from its URL, so workers
//! must reach the datasets at the URLs the coordinator names (a local folder all of them read,
//! or S3). Every request to a worker carries the coordinator's bearer token; a worker runs no
//! plan without it, and reads only the shard files of datasets under its allowed roots
//! ([`roots`]), whatever a plan names.
mod channels;
pub mod codec;
pub mod roots;
pub mod worker;

use datafusion::error::DataFusionError;
use std::sync::atomic::{AtomicU64, Ordering};

use datafusion::execution::{SessionState, SessionStateBuilder};
use datafusion_distributed::{DistributedExt, SessionStateBuilderExt, WorkerResolver};
use http::{header::AUTHORIZATION, HeaderMap, HeaderValue};
use url::Url;

pub use roots::AllowedRoots;
pub use worker::WorkerSessions;

use crate::{QueryError, Result};

/// The workers a coordinator sends its queries' stages to, and the token they require.
#[derive(Clone)]
pub struct Workers {
    urls: Vec<Url>,
    token: String,
    partition_bytes: Option<usize>,
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the token.
        f.debug_struct("Workers")
            .field("urls", &self.urls)
            .field("partition_bytes", &self.partition_bytes)
            .finish_non_exhaustive()
    }
}

impl Workers {
    /// Workers at `list` (`http://host:port`, comma-separated), called with `token`.
    pub fn parse(list: &str, token: &str) -> Result<Self> {
        let mut urls = Vec::new();
        for item in list.split(',').map(str::trim) {
            urls.push(worker_url(item)?);
        }
        if token.is_empty() {
            return Err(QueryError::Worker {
                url: list.to_string(),
                reason: "empty token; expected the token the workers were started with".into(),
            });
        }
        Ok(Workers {
            urls,
            token: token.to_string(),
            partition_bytes: None,
        })
    }

    /// Shard bytes per scan partition (default 16 MiB): a scan stage gets one task per
    /// `target partitions × bytes`, so a smaller value spreads a small dataset over more workers.
    pub fn with_partition_bytes(mut self, bytes: usize) -> Self {
        self.partition_bytes = Some(bytes.max(1));
        self
    }

    /// The workers' URLs.
    pub fn urls(&self) -> &[Url] {
        &self.urls
    }

    /// The headers of every request to the workers: the token, and the query's name if given.
    fn headers(&self, query: Option<&str>) -> Result<HeaderMap> {
        let bearer = bearer(&self.token).map_err(|_| QueryError::Worker {
            url: self.urls[0].to_string(),
            reason: "the token is not a valid header value (expected printable ASCII)".into(),
        })?;
        let mut headers = HeaderMap::new();
        headers.insert(AUTHORIZATION, bearer);
        if let Some(q) = query.and_then(|q| HeaderValue::from_str(q).ok()) {
            headers.insert(QUERY_HEADER, q);
        }
        Ok(headers)
    }

    /// `state`, the state of one query, naming the query to the workers, so that its tasks on
    /// one worker share one memory pool there.
    pub(crate) fn name_query(&self, state: &mut SessionState) -> Result<()> {
        state.set_distributed_passthrough_headers(self.headers(Some(&query_name()))?)?;
        Ok(())
    }

    /// `builder` with the distributed planner over these workers, our codec, and the token on
    /// every request.
    pub(crate) fn coordinator(&self, builder: SessionStateBuilder) -> Result<SessionStateBuilder> {
        let mut builder = builder
            .with_distributed_worker_resolver(self.clone())
            .with_distributed_channel_resolver(channels::Channels::default())
            .with_distributed_user_codec(codec::HslakeCodec)
            .with_distributed_passthrough_headers(self.headers(None)?)?
            .with_distributed_planner();
        if let Some(bytes) = self.partition_bytes {
            builder = builder.with_distributed_file_scan_config_bytes_per_partition(bytes)?;
        }
        Ok(builder)
    }
}

impl crate::QuerySession {
    /// An empty session whose queries run on `workers`: the session plans them and collects
    /// their results.
    pub fn distributed(workers: &Workers) -> Result<Self> {
        let mut session =
            Self::over(workers.coordinator(SessionStateBuilder::new().with_default_features())?)?;
        session.workers = Some(workers.clone());
        Ok(session)
    }
}

/// The `authorization` value that presents `token`, to a worker or from one to another.
fn bearer(token: &str) -> std::result::Result<HeaderValue, http::header::InvalidHeaderValue> {
    HeaderValue::from_str(&format!("Bearer {token}"))
}

/// The header that names a query in every request to its workers.
pub(crate) const QUERY_HEADER: &str = "x-hslake-query";

/// A name for one query, unique across coordinators: random per process, then counted.
fn query_name() -> String {
    use std::hash::{BuildHasher, Hasher};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(NEXT.fetch_add(1, Ordering::Relaxed));
    format!("{:016x}-{}", h.finish(), std::process::id())
}

impl WorkerResolver for Workers {
    fn get_urls(&self) -> std::result::Result<Vec<Url>, DataFusionError> {
        Ok(self.urls.clone())
    }
}

/// One worker's URL, checked: `http://` or `https://`, a host and a port.
fn worker_url(item: &str) -> Result<Url> {
    let bad = |reason: &str| QueryError::Worker {
        url: item.to_string(),
        reason: format!("{reason}; expected http://HOST:PORT"),
    };
    let url = Url::parse(item).map_err(|e| bad(&e.to_string()))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(bad(&format!("scheme {:?}", url.scheme())));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(bad("no host"));
    }
    if url.port_or_known_default().is_none() {
        return Err(bad("no port"));
    }
    if url.path() != "/" || url.query().is_some() {
        return Err(bad("a path or query after the port"));
    }
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_worker_urls_that_are_not_http_host_port() {
        for (list, what) in [
            ("localhost:5000", "scheme \"localhost\""),
            ("grpc://127.0.0.1:5000", "scheme \"grpc\""),
            ("http://127.0.0.1:5000/x", "a path"),
            ("http://127.0.0.1:5000,", "relative URL without a base"),
        ] {
            let err = Workers::parse(list, "t").unwrap_err().to_string();
            assert!(err.starts_with("worker "), "{list}: {err}");
            assert!(err.contains(what), "{list}: {err}");
            assert!(err.contains("expected http://HOST:PORT"), "{list}: {err}");
        }
    }

    #[test]
    fn accepts_a_list_of_workers_and_never_shows_the_token() {
        let w = Workers::parse("http://127.0.0.1:1, http://localhost:2", "secret").unwrap();
        assert_eq!(w.urls().len(), 2);
        assert!(!format!("{w:?}").contains("secret"));
        let err = Workers::parse("http://127.0.0.1:1", "").unwrap_err();
        assert!(err.to_string().contains("empty token"), "{err}");
    }
}
