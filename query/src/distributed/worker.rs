//! A worker of distributed queries: the session each task of a query runs in.
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::error::DataFusionError;
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::execution::SessionState;
use datafusion_distributed::{DistributedExt, Worker, WorkerQueryContext, WorkerSessionBuilder};
use http::header::AUTHORIZATION;

use super::codec::HslakeCodec;
use crate::budget::QueryBudget;
use crate::flight::check_bearer;
use crate::limits::{Cancel, QueryLimits};
use crate::session::hslake_context;
use crate::QueryError;

/// Builds the session of each task a coordinator sends: the coordinator's token checked first,
/// then hslake's session setup (the same as every session's) under this worker's limits. Each
/// task gets a runtime of its own: a memory pool of `--query-memory`, and the stores of the
/// datasets it scans, which its plan's scans register ([`super::codec`]).
#[derive(Clone)]
pub struct WorkerSessions {
    token: Arc<str>,
    limits: QueryLimits,
}

impl std::fmt::Debug for WorkerSessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerSessions")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl WorkerSessions {
    /// Sessions for coordinators presenting `token`, each task under `limits`.
    pub fn new(token: &str, limits: QueryLimits) -> Self {
        WorkerSessions {
            token: token.into(),
            limits,
        }
    }

    /// The worker's gRPC service, to serve with tonic.
    pub fn into_worker(self) -> Worker {
        Worker::from_session_builder(self)
    }
}

#[async_trait]
impl WorkerSessionBuilder for WorkerSessions {
    async fn build_session_state(
        &self,
        ctx: WorkerQueryContext,
    ) -> Result<SessionState, DataFusionError> {
        let presented = ctx.headers.get(AUTHORIZATION).map(|v| v.as_bytes());
        if let Err(reason) = check_bearer(presented, &self.token) {
            tracing::warn!("refused a task: {reason}");
            return Err(DataFusionError::External(Box::new(QueryError::Worker {
                url: "this worker".into(),
                reason: format!("refused the task: {reason}"),
            })));
        }
        let pool = self.limits.memory_pool();
        let runtime = RuntimeEnvBuilder::new()
            .with_memory_pool(pool.clone())
            .build_arc()?;
        let builder = ctx
            .builder
            .with_runtime_env(runtime)
            .with_distributed_user_codec(HslakeCodec);
        let budget = QueryBudget::new(&self.limits, Some(pool), Cancel::default());
        let ctx = hslake_context(builder, budget)
            .map_err(|e| DataFusionError::External(Box::new(e)))?;
        Ok(ctx.state())
    }
}

/// Workers in this process for tests: each a tonic server of [`WorkerSessions`] on its own
/// loopback port, as `hslake serve-sql --worker` serves it. They stop with the test's runtime.
#[cfg(test)]
pub(crate) async fn spawn_test_workers(
    n: usize,
    token: &str,
    limits: QueryLimits,
) -> Vec<url::Url> {
    let mut urls = Vec::new();
    for _ in 0..n {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        urls.push(format!("http://{}", listener.local_addr().unwrap()).parse().unwrap());
        let worker = WorkerSessions::new(token, limits).into_worker();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(worker.into_worker_server())
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
        );
    }
    urls
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::Workers;
    use crate::{testdata, QuerySession};
    use hslake_schemas::DType;

    fn list(urls: &[url::Url]) -> String {
        urls.iter().map(|u| u.as_str()).collect::<Vec<_>>().join(",")
    }

    async fn coordinator(workers: &Workers, url: &str) -> QuerySession {
        let mut s = QuerySession::distributed(workers).unwrap();
        let ds = hslake_store::Dataset::open(url).await.unwrap();
        s.add_dataset(None, &ds, None).await.unwrap();
        s
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn refuses_a_coordinator_without_the_workers_token() {
        let urls = spawn_test_workers(1, "right", QueryLimits::default()).await;
        testdata::write("memory://wrong-token", DType::Bf16, 8, 2).await;
        let workers = Workers::parse(&list(&urls), "wrong")
            .unwrap()
            .with_partition_bytes(1024);
        let session = coordinator(&workers, "memory://wrong-token").await;
        let err = session
            .query("SELECT sum(tensor_norm(layer_2)) FROM samples")
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("invalid bearer token"), "{err}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unreachable_worker_is_a_named_error_not_a_hang() {
        // A port nothing listens on: bound, then closed.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        testdata::write("memory://dead-worker", DType::Bf16, 8, 2).await;
        let workers = Workers::parse(&format!("http://127.0.0.1:{port}"), "t")
            .unwrap()
            .with_partition_bytes(1024);
        let session = coordinator(&workers, "memory://dead-worker").await;
        let err = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            session.query("SELECT sum(tensor_norm(layer_2)) FROM samples"),
        )
        .await
        .expect("the query fails instead of hanging")
        .unwrap_err()
        .to_string();
        assert!(err.contains(&format!("127.0.0.1:{port}")), "{err}");
    }
}
