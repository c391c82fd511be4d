//! The daemon's HTTP routes: the job API (JSON), `/metrics`, the health probes and the
//! dashboard. Every route but `/healthz`, `/readyz` and the dashboard's static page requires
//! `Authorization: Bearer <token>`; the page holds no data and reads the protected routes.
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;

use super::state::{JobState, StatusRecord};
use super::{Daemon, Job};
use crate::cmd::capture::JobArgs;

/// An error answer: a status and a message naming what is wrong.
pub struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = json(self.0, serde_json::json!({ "error": self.1 }));
        if self.0 == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
        }
        r
    }
}

type Answer = Result<Response, ApiError>;

fn json(status: StatusCode, v: serde_json::Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

/// The daemon's routes.
pub fn router(d: Arc<Daemon>) -> Router {
    Router::new()
        .route("/", get(dashboard))
        .route("/v1/datasets", get(datasets))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/jobs", get(list).post(submit))
        .route("/v1/jobs/{id}", get(show).delete(cancel))
        .with_state(d)
}

/// Serves `router` on every connection `listener` accepts, until the process ends.
pub async fn serve(listener: tokio::net::TcpListener, d: Arc<Daemon>) {
    let app = router(d);
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of file descriptors and the like: wait instead of spinning.
                tracing::warn!("accepting a connection: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let service = TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let conn = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            if let Err(e) = conn.serve_connection(TokioIo::new(stream), service).await {
                tracing::debug!(%peer, "connection ended: {e}");
            }
        });
    }
}

/// Refuses a request without the daemon's bearer token.
fn authorize(d: &Daemon, headers: &HeaderMap) -> Result<(), ApiError> {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        Some(t) if constant_time_eq(t.trim().as_bytes(), d.token.as_bytes()) => Ok(()),
        Some(_) => Err(ApiError(
            StatusCode::UNAUTHORIZED,
            "wrong bearer token".into(),
        )),
        None => Err(ApiError(
            StatusCode::UNAUTHORIZED,
            "missing Authorization: Bearer <token> (the daemon's --token-file)".into(),
        )),
    }
}

/// Compares without stopping at the first difference, so timing does not reveal the token.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The dashboard: one static page whose script reads /v1/jobs, /v1/datasets and /metrics.
async fn dashboard() -> Response {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        include_str!("dashboard.html"),
    )
        .into_response()
}

/// Every dataset a job writes, with the `hslake info` summary of its newest version.
async fn datasets(State(d): State<Arc<Daemon>>, headers: HeaderMap) -> Answer {
    authorize(&d, &headers)?;
    let urls: std::collections::BTreeSet<String> = d
        .lock()
        .jobs
        .values()
        .map(|j| j.spec.output.clone())
        .collect();
    let mut out = vec![];
    for url in urls {
        let described = async {
            let ds = hslake_store::Dataset::open(&url).await?;
            let m = ds.manifest(None).await?;
            Ok::<_, hslake_store::StoreError>(serde_json::json!({
                "url": url,
                "version": m.version,
                "samples": m.num_samples(),
                "tokens": m.num_tokens(),
                "bytes": m.bytes(),
                "raw_bytes": m.raw_bytes(),
                "compression_ratio": if m.bytes() > 0 { m.raw_bytes() as f64 / m.bytes() as f64 } else { 0.0 },
                "points": m.schema.points.iter().map(|p| p.column()).collect::<Vec<_>>(),
                "model": m.schema.model,
            }))
        }
        .await;
        // A dataset not created yet (its job is queued) or unreadable is listed with why.
        out.push(
            described.unwrap_or_else(|e| serde_json::json!({ "url": url, "error": e.to_string() })),
        );
    }
    Ok(json(StatusCode::OK, serde_json::json!({ "datasets": out })))
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(d): State<Arc<Daemon>>) -> Response {
    if d.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "loading the model\n").into_response()
    }
}

async fn metrics(State(d): State<Arc<Daemon>>, headers: HeaderMap) -> Answer {
    authorize(&d, &headers)?;
    Ok((
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        d.metrics.render(),
    )
        .into_response())
}

async fn list(State(d): State<Arc<Daemon>>, headers: HeaderMap) -> Answer {
    authorize(&d, &headers)?;
    let inner = d.lock();
    let jobs: Vec<_> = inner.jobs.iter().map(|(id, j)| j.view(*id)).collect();
    Ok(json(StatusCode::OK, serde_json::json!({ "jobs": jobs })))
}

async fn show(State(d): State<Arc<Daemon>>, headers: HeaderMap, Path(id): Path<String>) -> Answer {
    authorize(&d, &headers)?;
    let id = parse_id(&id)?;
    let inner = d.lock();
    let job = inner.jobs.get(&id).ok_or_else(|| no_job(id))?;
    Ok(json(StatusCode::OK, job.view(id)))
}

fn parse_id(id: &str) -> Result<u64, ApiError> {
    id.parse().map_err(|_| {
        ApiError(
            StatusCode::BAD_REQUEST,
            format!("job id {id:?}: expected a number"),
        )
    })
}

fn no_job(id: u64) -> ApiError {
    ApiError(StatusCode::NOT_FOUND, format!("no job {id}"))
}

/// Checks a job as `hslake capture` would before it starts (options, every input record, the
/// dataset's model and capture points), stores it, and queues it.
async fn submit(State(d): State<Arc<Daemon>>, headers: HeaderMap, body: Bytes) -> Answer {
    authorize(&d, &headers)?;
    let bad = |m: String| ApiError(StatusCode::BAD_REQUEST, m);
    let mut spec: JobArgs =
        serde_json::from_slice(&body).map_err(|e| bad(format!("job JSON: {e}")))?;
    // Stored as the dataset URL every command reads the same string as (the root refused).
    spec.output = hslake_store::location::dataset_url(&spec.output)
        .map_err(|e| bad(format!("output: {e}")))?;
    let job = spec.job().map_err(|e| bad(format!("{e:#}")))?;
    let (model, options) = (d.model.clone(), d.engine_options.clone());
    let span = tracing::info_span!("submission", output = %spec.output);
    tokio::task::spawn_blocking(move || {
        let _entered = span.enter();
        job.prepare(&model, &options).map(|_| ())
    })
    .await
    .map_err(|e| {
        ApiError(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("checking the job: {e}"),
        )
    })?
    .map_err(|e| {
        ApiError(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("capture into {}: {e}", spec.output),
        )
    })?;
    let _one_at_a_time = d.submit.lock().await;
    let next = d.lock().jobs.keys().next_back().map_or(1, |id| id + 1);
    let id = d.state.create(next, &spec).await.map_err(|e| {
        ApiError(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("cannot store the job: {e:#}"),
        )
    })?;
    let view = {
        let mut inner = d.lock();
        let job = inner.jobs.entry(id).or_insert(Job::new(spec));
        let view = job.view(id);
        d.update_metrics(&inner);
        view
    };
    tracing::info!(job = id, "job queued");
    d.wake.notify_one();
    Ok(json(StatusCode::CREATED, view))
}

/// Cancels a job: a queued one never runs; a running one commits what it captured and stops.
async fn cancel(
    State(d): State<Arc<Daemon>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Answer {
    authorize(&d, &headers)?;
    let id = parse_id(&id)?;
    let was_queued = {
        let mut inner = d.lock();
        let job = inner.jobs.get_mut(&id).ok_or_else(|| no_job(id))?;
        match job.state {
            JobState::Queued => {
                // Taken off the queue now, so the worker cannot start it while this records.
                job.state = JobState::Cancelled;
                true
            }
            JobState::Running => {
                job.cancel_requested = true;
                job.cancel.cancel();
                false
            }
            s => {
                return Err(ApiError(
                    StatusCode::CONFLICT,
                    format!("job {id} is {} already", s.name()),
                ))
            }
        }
    };
    if was_queued {
        d.record(id, StatusRecord::now(JobState::Cancelled))
            .await
            .map_err(|e| {
                ApiError(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("cannot record the cancellation: {e:#}"),
                )
            })?;
    }
    tracing::info!(job = id, "cancel requested");
    let inner = d.lock();
    let job = inner.jobs.get(&id).ok_or_else(|| no_job(id))?;
    Ok(json(StatusCode::ACCEPTED, job.view(id)))
}
