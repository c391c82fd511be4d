//! A worker of distributed queries: the session each task of a query runs in.
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use async_trait::async_trait;
use datafusion::error::DataFusionError;
use datafusion::execution::memory_pool::MemoryPool;
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::execution::SessionState;
use datafusion_distributed::{DistributedExt, Worker, WorkerQueryContext, WorkerSessionBuilder};
use http::header::AUTHORIZATION;
use tonic::service::interceptor::InterceptedService;
use tonic::service::{Interceptor, Routes};

use super::codec::HslakeCodec;
use super::roots::{AllowedRoots, DatasetStores};
use super::{bearer, QUERY_HEADER};
use crate::budget::QueryBudget;
use crate::flight::check_bearer;
use crate::limits::{Cancel, QueryLimits};
use crate::session::hslake_context;

/// Builds the session of each task a coordinator sends: hslake's session setup (the same as
/// every session's) under this worker's limits. The tasks of one query on this worker share a
/// memory pool of `--query-memory` (the coordinator names the query in a header); each task
/// gets a runtime of its own with that pool and a registry that opens only the datasets under
/// the worker's allowed roots, and in them reads only shards ([`super::roots`]).
#[derive(Clone)]
pub struct WorkerSessions {
    token: Arc<str>,
    limits: QueryLimits,
    roots: Arc<AllowedRoots>,
    /// The pool of each query that has a task running here.
    pools: Arc<Mutex<HashMap<String, Weak<dyn MemoryPool>>>>,
}

impl std::fmt::Debug for WorkerSessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerSessions")
            .field("limits", &self.limits)
            .field("roots", &self.roots)
            .finish_non_exhaustive()
    }
}

impl WorkerSessions {
    /// Sessions for coordinators presenting `token`, each task under `limits`, reading the
    /// shards of datasets under `roots` only.
    pub fn new(token: &str, limits: QueryLimits, roots: AllowedRoots) -> Self {
        WorkerSessions {
            token: token.into(),
            limits,
            roots: Arc::new(roots),
            pools: Arc::default(),
        }
    }

    /// The memory pool of `query`'s tasks here: the one its running tasks hold, or a new one.
    /// A task of a coordinator that names no query gets a pool of its own.
    fn pool_of(&self, query: Option<&str>) -> Arc<dyn MemoryPool> {
        let Some(query) = query else {
            return self.limits.memory_pool();
        };
        let mut pools = self.pools.lock().unwrap_or_else(PoisonError::into_inner);
        pools.retain(|_, p| p.strong_count() > 0);
        if let Some(pool) = pools.get(query).and_then(Weak::upgrade) {
            return pool;
        }
        let pool = self.limits.memory_pool();
        pools.insert(query.to_string(), Arc::downgrade(&pool));
        pool
    }

    /// The worker's gRPC service, to serve with tonic: every request must carry the token,
    /// whether it sends a task's plan or asks for a task's results, from the coordinator or
    /// from another worker.
    pub fn into_routes(self) -> Routes {
        let check = TokenCheck(self.token.clone());
        let worker = Worker::from_session_builder(self).into_worker_server();
        Routes::new(InterceptedService::new(worker, check))
    }
}

/// Refuses a request without the worker's bearer token, before the service sees it.
#[derive(Clone)]
struct TokenCheck(Arc<str>);

impl Interceptor for TokenCheck {
    fn call(&mut self, request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let presented = request
            .metadata()
            .get(AUTHORIZATION.as_str())
            .map(|v| v.as_bytes());
        match check_bearer(presented, &self.0) {
            Ok(()) => Ok(request),
            Err(reason) => {
                tracing::warn!("refused a request: {reason}");
                Err(tonic::Status::unauthenticated(format!(
                    "this worker refused the request: {reason}"
                )))
            }
        }
    }
}

#[async_trait]
impl WorkerSessionBuilder for WorkerSessions {
    async fn build_session_state(
        &self,
        ctx: WorkerQueryContext,
    ) -> Result<SessionState, DataFusionError> {
        // The token was checked with the request ([`TokenCheck`]); this task's requests to
        // other workers, for the results of the tasks it reads from, carry it on.
        let bearer = bearer(&self.token).map_err(|e| DataFusionError::External(Box::new(e)))?;
        let query = ctx.headers.get(QUERY_HEADER).and_then(|v| v.to_str().ok());
        let pool = self.pool_of(query);
        let runtime = RuntimeEnvBuilder::new()
            .with_memory_pool(pool.clone())
            .with_object_store_registry(Arc::new(DatasetStores::new(self.roots.clone())))
            .build_arc()?;
        let builder = ctx
            .builder
            .with_runtime_env(runtime)
            .with_distributed_user_codec(HslakeCodec)
            .with_distributed_passthrough_headers(
                [(AUTHORIZATION, bearer)].into_iter().collect(),
            )?;
        let budget = QueryBudget::new(&self.limits, Some(pool), Cancel::default());
        let ctx =
            hslake_context(builder, budget).map_err(|e| DataFusionError::External(Box::new(e)))?;
        Ok(ctx.state())
    }
}

/// The roots of test workers: the folder test datasets are made in (`tempfile`'s).
#[cfg(test)]
pub(crate) fn test_roots() -> AllowedRoots {
    AllowedRoots::parse(&std::env::temp_dir().display().to_string()).unwrap()
}

/// Workers in this process for tests: each a tonic server of [`WorkerSessions`] on its own
/// loopback port, as `hslake serve-sql --worker` serves it, reading datasets under
/// [`test_roots`]. They stop with the test's runtime.
#[cfg(test)]
pub(crate) async fn spawn_test_workers(
    n: usize,
    token: &str,
    limits: QueryLimits,
) -> Vec<url::Url> {
    serve_test_workers(n, &WorkerSessions::new(token, limits, test_roots())).await
}

/// [`spawn_test_workers`] with clones of `sessions`, which share its pools.
#[cfg(test)]
async fn serve_test_workers(n: usize, sessions: &WorkerSessions) -> Vec<url::Url> {
    let mut urls = Vec::new();
    for _ in 0..n {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        urls.push(
            format!("http://{}", listener.local_addr().unwrap())
                .parse()
                .unwrap(),
        );
        let routes = sessions.clone().into_routes();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_routes(routes)
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
        urls.iter()
            .map(|u| u.as_str())
            .collect::<Vec<_>>()
            .join(",")
    }

    async fn coordinator(workers: &Workers, url: &str) -> QuerySession {
        let mut s = QuerySession::distributed(workers).unwrap();
        let ds = hslake_store::Dataset::open(url).await.unwrap();
        s.add_dataset(None, &ds, None).await.unwrap();
        s
    }

    /// A coordinator presenting `token` to the workers at `urls`, over a small bf16 dataset in
    /// two shards (split over tasks), which lives as long as the folder.
    async fn over_test_data(urls: &[url::Url], token: &str) -> (tempfile::TempDir, QuerySession) {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("file://{}", dir.path().display());
        testdata::write(&url, DType::Bf16, 10, 2).await;
        let workers = Workers::parse(&list(urls), token)
            .unwrap()
            .with_partition_bytes(1024);
        let session = coordinator(&workers, &url).await;
        (dir, session)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn refuses_a_coordinator_without_the_workers_token() {
        let urls = spawn_test_workers(2, "right", QueryLimits::default()).await;
        let (_dir, session) = over_test_data(&urls, "wrong").await;
        let err = session
            .query("SELECT count(*), sum(seq_len) FROM samples")
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("invalid bearer token"), "{err}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn refuses_a_dataset_outside_its_allowed_roots_by_name() {
        let allowed = tempfile::tempdir().unwrap();
        let roots = AllowedRoots::parse(allowed.path().to_str().unwrap()).unwrap();
        let sessions = WorkerSessions::new("t", QueryLimits::default(), roots);
        let urls = serve_test_workers(2, &sessions).await;
        // The coordinator's dataset lies in another folder.
        let (dir, session) = over_test_data(&urls, "t").await;
        let err = session
            .query("SELECT count(*), sum(seq_len) FROM samples")
            .await
            .unwrap_err()
            .to_string();
        let want = format!(
            "dataset file://{} is outside this worker's --allowed-root (file://{})",
            dir.path().display(),
            allowed.path().display()
        );
        assert!(err.contains(&want), "{err}");
    }

    #[test]
    fn tasks_of_one_query_share_its_pool_while_one_runs() {
        let limits = QueryLimits {
            memory_per_query: Some(1 << 20),
            ..QueryLimits::default()
        };
        let sessions = WorkerSessions::new("t", limits, test_roots());
        let a = sessions.pool_of(Some("q1"));
        let same = sessions.pool_of(Some("q1"));
        let other = sessions.pool_of(Some("q2"));
        assert!(Arc::ptr_eq(&a, &same));
        assert!(!Arc::ptr_eq(&a, &other));
        let unnamed = sessions.pool_of(None);
        assert!(!Arc::ptr_eq(&unnamed, &sessions.pool_of(None)));
        drop((a, same));
        // Once its tasks are done, the name is forgotten.
        let _ = sessions.pool_of(Some("q3"));
        assert!(!sessions.pools.lock().unwrap().contains_key("q1"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_query_names_itself_to_its_workers() {
        let sessions = WorkerSessions::new("t", QueryLimits::default(), test_roots());
        let urls = serve_test_workers(2, &sessions).await;
        let (_dir, session) = over_test_data(&urls, "t").await;
        session
            .query("SELECT count(*), sum(seq_len) FROM samples")
            .await
            .unwrap();
        // Every task of the query, on either worker, asked for the pool of one name (the names
        // stay until the next task comes).
        let names: Vec<String> = sessions.pools.lock().unwrap().keys().cloned().collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    /// Not only the plans: a request for a task's results without the token is refused too.
    #[tokio::test]
    async fn refuses_every_request_without_the_token() {
        let urls = spawn_test_workers(1, "right", QueryLimits::default()).await;
        let channel = tonic::transport::Endpoint::from_shared(urls[0].to_string())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut grpc = tonic::client::Grpc::new(channel);
        for (token, refused) in [(None, true), (Some("wrong"), true), (Some("right"), false)] {
            grpc.ready().await.unwrap();
            let mut request = tonic::Request::new(());
            if let Some(t) = token {
                let value = format!("Bearer {t}").parse().unwrap();
                request.metadata_mut().insert("authorization", value);
            }
            let path = http::uri::PathAndQuery::from_static("/worker.WorkerService/ExecuteTask");
            let codec = tonic_prost::ProstCodec::<(), ()>::default();
            let code = match grpc.server_streaming(request, path, codec).await {
                Ok(mut results) => match results.get_mut().message().await {
                    Ok(_) => tonic::Code::Ok,
                    Err(status) => status.code(),
                },
                Err(status) => status.code(),
            };
            assert_eq!(
                code == tonic::Code::Unauthenticated,
                refused,
                "{token:?}: {code:?}"
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unreachable_worker_is_a_named_error_not_a_hang() {
        // A port nothing listens on: bound, then closed.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = tempfile::tempdir().unwrap();
        let url = format!("file://{}", dir.path().display());
        testdata::write(&url, DType::Bf16, 10, 2).await;
        // Two, so that the planner splits the scan (one task would run on the coordinator).
        let workers = Workers::parse(
            &format!("http://127.0.0.1:{port},http://127.0.0.1:{port}"),
            "t",
        )
        .unwrap()
        .with_partition_bytes(1024);
        let session = coordinator(&workers, &url).await;
        let err = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            session.query("SELECT count(*), sum(seq_len) FROM samples"),
        )
        .await
        .expect("the query fails instead of hanging")
        .unwrap_err()
        .to_string();
        assert!(err.contains(&format!("127.0.0.1:{port}")), "{err}");
    }
}
