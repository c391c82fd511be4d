//! Serving an axum router over HTTP/1.1 within [`ConnArgs`]' limits. Each connection is
//! watched: its first request's headers must be in within `--header-timeout` of connecting,
//! a request's body within `--body-timeout` of its headers (and no larger than
//! [`MAX_BODY_BYTES`]), and a connection with no request in flight closes after
//! `--idle-timeout`. HTTP/2 is not offered: the daemon's clients (the CLI, browsers over
//! plain HTTP) speak HTTP/1.1, and each protocol served is one more to bound.
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, Request, Response, StatusCode};
use axum::Router;
use hslake_schemas::units::{show_duration, show_size, DurationRange};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::{Body as _, Incoming};
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};

use super::{accept_loop, ConnArgs, Gate, Permit, Refusal};

/// Largest request body taken: the job API's bodies are small JSON documents.
pub const MAX_BODY_BYTES: usize = 1 << 20;

/// `--body-timeout`: a millisecond up to an hour.
const BODY_TIMEOUT: DurationRange = DurationRange::seconds(
    "--body-timeout",
    Duration::from_millis(1),
    Duration::from_secs(3600),
);

/// An HTTP server's connection limits: [`ConnArgs`] and the body deadline.
#[derive(clap::Args, Debug, Clone)]
pub struct HttpArgs {
    /// Connection caps and deadlines.
    #[command(flatten)]
    pub conn: ConnArgs,
    /// Time a client has to send a request's body once its headers are in, e.g. 10s.
    #[arg(long, default_value = "10s", value_parser = BODY_TIMEOUT.parser())]
    pub body_timeout: Duration,
}

/// Serves `app` on every connection `listener` accepts within `args`' limits, until the process
/// ends.
pub async fn serve(listener: TcpListener, app: Router, args: HttpArgs) {
    let gate = Gate::new(&args.conn);
    let args = Arc::new(args);
    accept_loop(listener, gate, refuse, move |stream, peer, permit| {
        tokio::spawn(connection(stream, peer, permit, app.clone(), args.clone()));
    })
    .await
}

/// The last word to a refused connection: a 503 written if the socket takes it at once.
fn refuse(stream: &TcpStream, why: &Refusal) {
    let body = serde_json::json!({ "error": why.to_string() }).to_string();
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    // Never waits: a client that does not read gets nothing. What it sent already is read
    // first, since closing a socket with unread bytes resets it and the answer may be lost.
    let mut sink = [0u8; 8192];
    for _ in 0..8 {
        if !matches!(stream.try_read(&mut sink), Ok(n) if n > 0) {
            break;
        }
    }
    let _ = stream.try_write(answer.as_bytes());
}

/// What a connection is doing, for its watchdog.
struct Activity {
    start: Instant,
    in_flight: AtomicUsize,
    requests: AtomicU64,
    /// Milliseconds after `start` that the last request ended.
    last_end_ms: AtomicU64,
}

/// A request in flight; its end is noted when dropped (also when the connection drops it).
struct Busy<'a>(&'a Activity);

impl Activity {
    fn begin(&self) -> Busy<'_> {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        self.requests.fetch_add(1, Ordering::SeqCst);
        Busy(self)
    }

    /// When the connection must be closed if nothing changes, and why; None while a request
    /// is in flight.
    fn deadline(&self, conn: &ConnArgs) -> Option<(Instant, &'static str)> {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            return None;
        }
        if self.requests.load(Ordering::SeqCst) == 0 {
            return Some((
                self.start + conn.header_timeout,
                "no complete request headers within --header-timeout",
            ));
        }
        let ended = self.start + Duration::from_millis(self.last_end_ms.load(Ordering::SeqCst));
        Some((
            ended + conn.idle_timeout,
            "idle for --idle-timeout between requests",
        ))
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        let ms = self.0.start.elapsed().as_millis() as u64;
        self.0.last_end_ms.store(ms, Ordering::SeqCst);
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Resolves once the connection has outstayed its deadline, with the reason.
async fn overstayed(activity: &Activity, conn: &ConnArgs) -> &'static str {
    loop {
        match activity.deadline(conn) {
            // A request in flight is bounded by its handler; look again later.
            None => tokio::time::sleep(conn.idle_timeout.min(conn.header_timeout)).await,
            Some((at, why)) if Instant::now() >= at => return why,
            Some((at, _)) => tokio::time::sleep_until(at.into()).await,
        }
    }
}

/// Serves one connection until it closes or outstays a deadline.
async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    _permit: Permit,
    app: Router,
    args: Arc<HttpArgs>,
) {
    let activity = Arc::new(Activity {
        start: Instant::now(),
        in_flight: AtomicUsize::new(0),
        requests: AtomicU64::new(0),
        last_end_ms: AtomicU64::new(0),
    });
    let seen = activity.clone();
    let body_timeout = args.body_timeout;
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let (app, activity) = (app.clone(), seen.clone());
        async move {
            let _busy = activity.begin();
            Ok::<_, Infallible>(answer(req, app, body_timeout).await)
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .serve_connection(TokioIo::new(stream), service);
    tokio::select! {
        r = conn => {
            if let Err(e) = r {
                tracing::debug!(%peer, "connection ended: {e}");
            }
        }
        why = overstayed(&activity, &args.conn) => {
            tracing::debug!(%peer, "connection closed: {why}");
        }
    }
}

/// The router's answer to `req`, once its body is in within the deadline and the size limit.
async fn answer(req: Request<Incoming>, app: Router, body_timeout: Duration) -> Response<Body> {
    let (parts, body) = req.into_parts();
    let too_large = || {
        error(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the request body is over {}; job bodies are small JSON documents",
                show_size(MAX_BODY_BYTES as u64)
            ),
        )
    };
    // A declared length over the limit is refused before any of the body is waited for.
    if body.size_hint().lower() > MAX_BODY_BYTES as u64 {
        return too_large();
    }
    let collected =
        tokio::time::timeout(body_timeout, Limited::new(body, MAX_BODY_BYTES).collect());
    let bytes = match collected.await {
        Ok(Ok(c)) => c.to_bytes(),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => return too_large(),
        Ok(Err(e)) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("reading the request body: {e}"),
            )
        }
        Err(_) => {
            return error(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "the request body did not arrive within --body-timeout {}",
                    show_duration(body_timeout)
                ),
            )
        }
    };
    let req = Request::from_parts(parts, Body::from(bytes));
    match hyper::service::Service::call(&TowerToHyperService::new(app), req).await {
        Ok(r) => r,
        Err(e) => match e {},
    }
}

fn error(status: StatusCode, message: String) -> Response<Body> {
    let mut r = Response::new(Body::from(
        serde_json::json!({ "error": message }).to_string(),
    ));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    // The body may still be arriving: do not read the rest of it to reuse the connection.
    r.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::{get, post};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn args(max: usize, per_client: usize) -> HttpArgs {
        HttpArgs {
            conn: ConnArgs {
                max_connections: max,
                max_connections_per_client: per_client,
                header_timeout: Duration::from_millis(300),
                idle_timeout: Duration::from_millis(600),
            },
            body_timeout: Duration::from_millis(300),
        }
    }

    async fn server(args: HttpArgs) -> SocketAddr {
        let app = Router::new()
            .route("/", get(|| async { "hello" }))
            .route("/echo", post(|b: axum::body::Bytes| async move { b }));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve(listener, app, args));
        addr
    }

    /// Sends `request` and reads until the server closes (or 5 s pass).
    async fn exchange(addr: SocketAddr, request: &[u8]) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(request).await.unwrap();
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
        String::from_utf8_lossy(&out).into_owned()
    }

    /// Whether the server closes `s` within `within`.
    async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
        let mut buf = [0u8; 1024];
        loop {
            match tokio::time::timeout(within, s.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) => continue,
                Err(_) => return false,
            }
        }
    }

    #[tokio::test]
    async fn half_sent_headers_and_bodies_are_cut_off_at_their_deadlines() {
        let addr = server(args(16, 16)).await;
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let mut partial = TcpStream::connect(addr).await.unwrap();
        partial
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        assert!(closed_within(&mut silent, Duration::from_secs(3)).await);
        assert!(closed_within(&mut partial, Duration::from_secs(3)).await);

        let slow_body = exchange(
            addr,
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc",
        )
        .await;
        assert!(
            slow_body.starts_with("HTTP/1.1 408") && slow_body.contains("--body-timeout 300ms"),
            "{slow_body}"
        );
        let big = format!(
            "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
            MAX_BODY_BYTES + 1
        );
        let too_big = exchange(addr, big.as_bytes()).await;
        assert!(too_big.starts_with("HTTP/1.1 413"), "{too_big}");
    }

    #[tokio::test]
    async fn a_kept_alive_connection_closes_after_the_idle_timeout() {
        let addr = server(args(16, 16)).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 1024];
        let n = s.read(&mut buf).await.unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).ends_with("hello"));
        // Past the header timeout but within the idle one, the connection still serves.
        tokio::time::sleep(Duration::from_millis(400)).await;
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let n = s.read(&mut buf).await.unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).ends_with("hello"));
        let t = Instant::now();
        assert!(closed_within(&mut s, Duration::from_secs(3)).await);
        assert!(
            t.elapsed() >= Duration::from_millis(400),
            "{:?}",
            t.elapsed()
        );
    }

    #[tokio::test]
    async fn connections_over_a_cap_are_refused_at_once_with_a_503() {
        let addr = server(args(2, 1)).await;
        let _held = TcpStream::connect(addr).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        // The refusal is written at once, before any request.
        let refused = exchange(addr, b"").await;
        assert!(
            refused.starts_with("HTTP/1.1 503")
                && refused.contains("--max-connections-per-client 1"),
            "{refused}"
        );
    }
}
