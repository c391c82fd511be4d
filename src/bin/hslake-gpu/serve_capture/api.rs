//! The daemon's HTTP routes: the job API (JSON), `/metrics`, the health probes and the
//! dashboard. Every route but `/healthz`, `/readyz` and the dashboard's static page requires
//! `Authorization: Bearer <token>`; the page holds no data and reads the protected routes.
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use hslake_capture::{CaptureError, CaptureJob};
use hslake_schemas::units::show_size;

use super::state::{JobState, StatusRecord};
use super::{Daemon, Inner, Job};
use crate::capture::JobArgs;

/// Jobs per page of `GET /v1/jobs` unless `limit` says otherwise, and the most it may say.
const PAGE_DEFAULT: usize = 100;
const PAGE_MAX: usize = 1000;

/// An error answer: a status and a message naming what is wrong.
#[derive(Debug)]
pub struct ApiError(StatusCode, String);

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.1)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = json(self.0, serde_json::json!({ "error": self.1 }));
        if self.0 == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
        }
        if self.0 == StatusCode::SERVICE_UNAVAILABLE {
            r.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("5"));
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
async fn datasets(
    State(d): State<Arc<Daemon>>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Answer {
    authorize(&d, &headers)?;
    // The jobs of one page (the query is /v1/jobs's): each dataset is opened to describe it,
    // and a daemon holding thousands of jobs must not open thousands per request.
    let page = Page::parse(query.as_deref())?;
    let urls: std::collections::BTreeSet<String> = {
        let inner = d.lock();
        page.of(&inner)
            .0
            .into_iter()
            .map(|(_, j)| j.spec.output.clone())
            .collect()
    };
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

/// One page of `GET /v1/jobs`: `limit` jobs (default 100, at most 1000) with ids above `after`,
/// only those in one of the comma-separated `state`s if given.
#[derive(Debug, PartialEq)]
struct Page {
    limit: usize,
    after: u64,
    states: Option<Vec<JobState>>,
}

impl Page {
    fn parse(query: Option<&str>) -> Result<Page, ApiError> {
        let bad = |m: String| ApiError(StatusCode::BAD_REQUEST, m);
        let mut page = Page {
            limit: PAGE_DEFAULT,
            after: 0,
            states: None,
        };
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            match key {
                "limit" => {
                    page.limit = value
                        .parse()
                        .ok()
                        .filter(|n| (1..=PAGE_MAX).contains(n))
                        .ok_or_else(|| bad(format!("limit={value:?}: expected 1 to {PAGE_MAX}")))?
                }
                "after" => {
                    page.after = value.parse().map_err(|_| {
                        bad(format!("after={value:?}: expected a job id (a number)"))
                    })?
                }
                "state" => {
                    // A comma may come escaped from a client that encodes the whole value.
                    let states = value.replace("%2C", ",").replace("%2c", ",");
                    let states = states
                        .split(',')
                        .map(|name| {
                            JobState::ALL
                                .into_iter()
                                .find(|s| s.name() == name)
                                .ok_or_else(|| {
                                    bad(format!(
                                        "state={name:?}: expected queued, running, done, failed \
                                         or cancelled (several separated by commas)"
                                    ))
                                })
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    page.states = Some(states);
                }
                _ => {
                    return Err(bad(format!(
                        "unknown query parameter {key:?}; expected limit, after or state"
                    )))
                }
            }
        }
        Ok(page)
    }

    /// This page's jobs, and the `after` of the next page if there is one.
    fn of<'a>(&self, inner: &'a Inner) -> (Vec<(u64, &'a Job)>, Option<u64>) {
        let mut matching = inner
            .jobs
            .range(self.after.saturating_add(1)..)
            .filter(|(_, j)| self.states.as_ref().is_none_or(|s| s.contains(&j.state)))
            .map(|(id, j)| (*id, j));
        let jobs: Vec<_> = matching.by_ref().take(self.limit).collect();
        let next = matching.next().and_then(|_| jobs.last().map(|(id, _)| *id));
        (jobs, next)
    }
}

/// A page of jobs in id order, and `next`: the `after` of the following page (null on the last).
async fn list(
    State(d): State<Arc<Daemon>>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Answer {
    authorize(&d, &headers)?;
    let page = Page::parse(query.as_deref())?;
    let inner = d.lock();
    let (jobs, next) = page.of(&inner);
    let jobs: Vec<_> = jobs.into_iter().map(|(id, j)| j.view(id)).collect();
    Ok(json(
        StatusCode::OK,
        serde_json::json!({ "jobs": jobs, "next": next }),
    ))
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
/// dataset's model and capture points) and against the daemon's admission limits, stores it,
/// and queues it. The check reads the input record by record and keeps none of it; what it
/// may hold is taken from `--max-spool-bytes` while it runs.
async fn submit(State(d): State<Arc<Daemon>>, headers: HeaderMap, body: Bytes) -> Answer {
    authorize(&d, &headers)?;
    let bad = |m: String| ApiError(StatusCode::BAD_REQUEST, m);
    let mut spec: JobArgs =
        serde_json::from_slice(&body).map_err(|e| bad(format!("job JSON: {e}")))?;
    // Stored as the dataset URL every command reads the same string as (the root refused).
    spec.output = hslake_store::location::dataset_url(&spec.output)
        .map_err(|e| bad(format!("output: {e}")))?;
    let job = job_for(&d, &spec)?;
    let unusable = |e: CaptureError| match e {
        CaptureError::InputTooLarge { path, size, .. } => too_large(&d, &path, size),
        e @ CaptureError::SamplesTooLarge { .. } => ApiError(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("{e} (--max-job-bytes)"),
        ),
        e => ApiError(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("capture into {}: {e}", spec.output),
        ),
    };
    // The size first, so that an input too large is refused before any of it is read, and the
    // check below holds no more than its share of the spool.
    let size = hslake_capture::input_size(&spec.input)
        .await
        .map_err(unusable)?;
    if size > d.max_job_bytes {
        return Err(too_large(&d, &spec.input, size));
    }
    let spooled = d
        .spool
        .take(check_memory(&spec.input, size, d.max_job_bytes))
        .map_err(|m| ApiError(StatusCode::SERVICE_UNAVAILABLE, m))?;
    let (model, options) = (d.model.clone(), d.engine_options.clone());
    let span = tracing::info_span!("submission", output = %spec.output);
    let found = tokio::task::spawn_blocking(move || {
        let _entered = span.enter();
        let _spooled = spooled;
        job.validate(&model, &options)
    })
    .await
    .map_err(|e| {
        ApiError(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("checking the job: {e}"),
        )
    })?
    .map_err(unusable)?;
    tracing::info!(
        samples = found.samples,
        tokens = found.tokens,
        memory = show_size(found.memory),
        "job input checked"
    );
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

/// The library's job for `spec` with the daemon's limits, or why not: the CLI's checks of its
/// values (400), then the output under `--allowed-output` (403). The input's size limit goes
/// with the job, so a run refuses an input that has grown past it since it was submitted.
pub(super) fn job_for(d: &Daemon, spec: &JobArgs) -> Result<CaptureJob, ApiError> {
    let mut job = crate::capture::capture_job(spec)
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("{e:#}")))?;
    d.allowed
        .check(&spec.output)
        .map_err(|e| ApiError(StatusCode::FORBIDDEN, format!("{e:#}")))?;
    job.max_input_bytes = Some(d.max_job_bytes);
    Ok(job)
}

/// What checking an input of `size` bytes may hold in memory: a JSONL input is read record by
/// record ([`hslake_capture::check_memory`]); a Parquet file's size says little of its decoded
/// size, so it is taken to cost what the largest input may.
pub(super) fn check_memory(input: &std::path::Path, size: u64, max_job_bytes: u64) -> u64 {
    let size = match hslake_capture::is_parquet(input) {
        true => max_job_bytes,
        false => size,
    };
    hslake_capture::check_memory(size)
}

fn too_large(d: &Daemon, input: &std::path::Path, size: u64) -> ApiError {
    ApiError(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!(
            "input {} holds {size} bytes or more; this daemon takes job inputs of at most {} \
             (--max-job-bytes)",
            input.display(),
            show_size(d.max_job_bytes)
        ),
    )
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_is_read_from_its_query_and_bad_parameters_are_named() {
        assert_eq!(
            Page::parse(None).unwrap(),
            Page {
                limit: PAGE_DEFAULT,
                after: 0,
                states: None
            }
        );
        let p = Page::parse(Some("limit=5&after=17&state=queued%2Crunning")).unwrap();
        assert_eq!((p.limit, p.after), (5, 17));
        assert_eq!(p.states, Some(vec![JobState::Queued, JobState::Running]));
        for (query, message) in [
            ("limit=0", "limit=\"0\": expected 1 to 1000"),
            ("limit=1001", "expected 1 to 1000"),
            ("after=-1", "after=\"-1\": expected a job id"),
            ("state=done,lost", "state=\"lost\""),
            ("order=desc", "unknown query parameter \"order\""),
        ] {
            let e = Page::parse(Some(query)).unwrap_err();
            assert!(
                e.0 == StatusCode::BAD_REQUEST && e.1.contains(message),
                "{query}: {}",
                e.1
            );
        }
    }
}
