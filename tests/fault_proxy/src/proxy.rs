//! The proxy itself: accepts client connections on 127.0.0.1, forwards each request to the
//! upstream S3 endpoint with bodies streamed both ways, and applies the fault the rules chose.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode, Uri};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpStream;
use tracing::{debug, info, warn};

use crate::body::{full, passed, truncated, ProxyBody};
use crate::conn::{ConnCtl, FaultIo};
use crate::control;
use crate::error::Error;
use crate::injector::{Injection, Injector};
use crate::rules::{s3_error_code, DelayPoint, Fault, RequestInfo, RuleSet};

/// Requests under this path go to the control endpoint, never upstream. S3 bucket names
/// cannot contain `_`, so no path-style S3 request can start with it.
pub const CONTROL_PREFIX: &str = "/__fault_proxy/";

/// State every connection shares: the rules and counters, and where to forward.
pub(crate) struct Shared {
    injector: Mutex<Injector>,
    /// `http://host:port` of the S3 endpoint.
    upstream: String,
}

impl Shared {
    /// The rules and counters; a panic elsewhere while holding the lock leaves them usable.
    pub(crate) fn injector(&self) -> MutexGuard<'_, Injector> {
        self.injector.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A proxy bound to its port, not yet serving.
pub struct Proxy {
    listener: std::net::TcpListener,
    shared: Arc<Shared>,
}

impl Proxy {
    /// Listens on `127.0.0.1:port` (0: any free port) in front of `upstream`
    /// (`http://host:port`), with `rules` in force.
    pub fn bind(port: u16, upstream: &str, rules: &RuleSet) -> Result<Self, Error> {
        let upstream = upstream_base(upstream)?;
        let injector = Injector::new(rules)?;
        let listener =
            std::net::TcpListener::bind(("127.0.0.1", port)).map_err(|source| Error::Io {
                what: format!("cannot listen on 127.0.0.1:{port}"),
                source,
            })?;
        listener.set_nonblocking(true).map_err(|source| Error::Io {
            what: "cannot make the listening socket non-blocking".into(),
            source,
        })?;
        Ok(Proxy {
            listener,
            shared: Arc::new(Shared {
                injector: Mutex::new(injector),
                upstream,
            }),
        })
    }

    /// The address it listens on (the chosen port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound TCP listener has a local address")
    }

    pub(crate) fn shared(&self) -> Arc<Shared> {
        self.shared.clone()
    }

    /// Serves until `shutdown` resolves; call inside a tokio runtime.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
        let listener =
            tokio::net::TcpListener::from_std(self.listener).map_err(|source| Error::Io {
                what: "cannot register the listening socket with tokio".into(),
                source,
            })?;
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(20))
            .build_http::<Incoming>();
        let fwd = Arc::new(Forwarder {
            shared: self.shared,
            client,
        });
        info!(upstream = %fwd.shared.upstream, addr = %listener.local_addr().map_err(|source| Error::Io { what: "listening socket".into(), source })?, "fault proxy listening");
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => return Ok(()),
                accepted = listener.accept() => match accepted {
                    Ok((tcp, _)) => {
                        let _ = tcp.set_nodelay(true);
                        tokio::spawn(serve_connection(tcp, fwd.clone()));
                    }
                    Err(e) => {
                        // Out of file descriptors and the like: wait instead of spinning.
                        warn!("fault proxy: accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
            }
        }
    }
}

/// `http://host:port` from the upstream URL, or why it cannot be forwarded to.
fn upstream_base(url: &str) -> Result<String, Error> {
    let bad = |what: &str| Error::Upstream {
        url: url.to_string(),
        what: what.to_string(),
    };
    let uri: Uri = url.parse().map_err(|_| bad("not a URL"))?;
    if uri.scheme_str() != Some("http") {
        return Err(bad("only plain http is forwarded"));
    }
    let authority = uri.authority().ok_or_else(|| bad("no host"))?;
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err(bad("has a path; give the endpoint only"));
    }
    Ok(format!("http://{authority}"))
}

/// Forwards requests upstream over a pool of keep-alive connections.
struct Forwarder {
    shared: Arc<Shared>,
    client: Client<HttpConnector, Incoming>,
}

/// One client connection: hyper serves it until the client leaves or a fault ends it.
async fn serve_connection(tcp: TcpStream, fwd: Arc<Forwarder>) {
    let ctl = Arc::new(ConnCtl::default());
    let io = TokioIo::new(FaultIo::new(tcp, ctl.clone()));
    let svc = {
        let ctl = ctl.clone();
        service_fn(move |req| handle(req, fwd.clone(), ctl.clone()))
    };
    let conn = http1::Builder::new()
        .keep_alive(true)
        .serve_connection(io, svc);
    tokio::select! {
        res = conn => if let Err(e) = res {
            debug!("fault proxy: client connection ended: {e}");
        },
        () = ctl.killed() => debug!("fault proxy: client connection cut by a fault"),
    }
}

/// Answers one request: control, forwarded as is, or with the fault the rules chose.
async fn handle(
    req: Request<Incoming>,
    fwd: Arc<Forwarder>,
    ctl: Arc<ConnCtl>,
) -> Result<Response<ProxyBody>, Infallible> {
    if req.uri().path().starts_with(CONTROL_PREFIX) {
        return Ok(control::respond(req, &fwd.shared).await);
    }
    let target = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    let injection = fwd.shared.injector().decide(&RequestInfo {
        method: req.method(),
        target: &target,
        headers: req.headers(),
    });
    let Some(Injection { rule, fault }) = injection else {
        return Ok(fwd.forward(req).await);
    };
    info!(rule, class = %fault.class(), method = %req.method(), target, "fault injected");
    Ok(match fault {
        Fault::Status { code, s3_code } => {
            // Read the body first so the client hears the status rather than a broken pipe.
            let _ = req.into_body().collect().await;
            s3_error(code, s3_code.as_deref(), &target)
        }
        Fault::ResetBefore => {
            ctl.reset();
            return std::future::pending().await;
        }
        Fault::ResetAfter => {
            // Wait for the whole answer, so the request has surely been applied upstream.
            match fwd.forward_raw(req).await {
                Ok(resp) => drop(resp.into_body().collect().await),
                Err(e) => warn!("fault proxy: reset_after: {e}"),
            }
            ctl.reset();
            return std::future::pending().await;
        }
        Fault::Delay { ms, when } => {
            let wait = tokio::time::sleep(Duration::from_millis(ms));
            match when {
                DelayPoint::Before => {
                    wait.await;
                    fwd.forward(req).await
                }
                DelayPoint::After => {
                    let resp = fwd.forward(req).await;
                    wait.await;
                    resp
                }
            }
        }
        Fault::Truncate { bytes } => match fwd.forward_raw(req).await {
            Ok(resp) => {
                let (parts, body) = resp.into_parts();
                let limit = bytes.unwrap_or_else(|| content_length(&parts.headers) / 2);
                Response::from_parts(parts, truncated(body, limit, ctl))
            }
            Err(e) => bad_gateway(e),
        },
        // The injector resolves `random` to the fault it drew; nothing to apply.
        Fault::Random { .. } => fwd.forward(req).await,
    })
}

impl Forwarder {
    /// The upstream response with its body streamed through, or 502 naming the upstream.
    async fn forward(&self, req: Request<Incoming>) -> Response<ProxyBody> {
        match self.forward_raw(req).await {
            Ok(resp) => resp.map(passed),
            Err(e) => bad_gateway(e),
        }
    }

    /// Sends the request upstream, its body streamed; the error says why there is no answer.
    async fn forward_raw(&self, req: Request<Incoming>) -> Result<Response<Incoming>, String> {
        let (mut parts, body) = req.into_parts();
        let target = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        parts.uri = format!("{}{target}", self.shared.upstream)
            .parse()
            .map_err(|e| format!("cannot address {target} upstream: {e}"))?;
        parts.version = http::Version::HTTP_11;
        strip_hop_by_hop(&mut parts.headers);
        // hyper already answered `Expect: 100-continue` towards the client.
        parts.headers.remove(header::EXPECT);
        let mut resp = self
            .client
            .request(Request::from_parts(parts, body))
            .await
            .map_err(|e| {
                let cause = std::error::Error::source(&e).map(|c| format!(": {c}"));
                format!(
                    "upstream {}: {e}{}",
                    self.shared.upstream,
                    cause.unwrap_or_default()
                )
            })?;
        strip_hop_by_hop(resp.headers_mut());
        Ok(resp)
    }
}

/// Headers that describe one connection, not the message (RFC 9110 7.6.1), including those
/// the `Connection` header names.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in [
        header::CONNECTION,
        header::PROXY_AUTHENTICATE,
        header::PROXY_AUTHORIZATION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ] {
        headers.remove(name);
    }
    headers.remove("keep-alive");
    headers.remove("proxy-connection");
}

fn content_length(headers: &HeaderMap) -> u64 {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// An S3 error response as S3 sends it: the status and an XML `<Error>` body.
fn s3_error(code: u16, s3_code: Option<&str>, target: &str) -> Response<ProxyBody> {
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    let s3_code = s3_error_code(code, s3_code).unwrap_or_else(|| "ServiceUnavailable".into());
    let message = match s3_code.as_str() {
        "SlowDown" => "Please reduce your request rate.",
        "InternalError" => "We encountered an internal error. Please try again.",
        _ => "Injected by the hslake fault proxy.",
    };
    let resource = target.split('?').next().unwrap_or(target);
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{}</Code><Message>{message}</Message>\
         <Resource>{}</Resource><RequestId>hslake-fault-proxy</RequestId></Error>",
        xml_escape(&s3_code),
        xml_escape(resource)
    );
    let mut resp = Response::new(full(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/xml"),
    );
    resp
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// 502 with a text body saying why the upstream gave no answer.
fn bad_gateway(why: String) -> Response<ProxyBody> {
    warn!("fault proxy: {why}");
    let mut resp = Response::new(full(why));
    *resp.status_mut() = StatusCode::BAD_GATEWAY;
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_must_be_a_plain_http_endpoint() {
        assert_eq!(
            upstream_base("http://127.0.0.1:5000").unwrap(),
            "http://127.0.0.1:5000"
        );
        assert_eq!(
            upstream_base("http://127.0.0.1:5000/").unwrap(),
            "http://127.0.0.1:5000"
        );
        for (url, want) in [
            ("https://s3.amazonaws.com", "only plain http"),
            ("http://127.0.0.1:5000/bucket", "has a path"),
            ("127.0.0.1:5000", "only plain http"),
            ("not a url", "not a URL"),
        ] {
            let e = upstream_base(url).unwrap_err().to_string();
            assert!(e.contains(want) && e.contains(url), "{url}: {e}");
        }
    }

    #[test]
    fn strips_hop_by_hop_headers_and_those_connection_names() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-private"),
        );
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("x-private", HeaderValue::from_static("1"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("12"));
        h.insert("if-none-match", HeaderValue::from_static("*"));
        strip_hop_by_hop(&mut h);
        let mut left: Vec<_> = h.keys().map(|k| k.as_str()).collect();
        left.sort();
        assert_eq!(left, ["content-length", "if-none-match"]);
    }

    #[test]
    fn s3_error_body_names_the_code_and_the_escaped_resource() {
        let resp = s3_error(503, None, "/b/a&b?x-id=PutObject");
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        let body = futures_body(resp);
        assert!(body.contains("<Code>SlowDown</Code>"), "{body}");
        assert!(body.contains("<Resource>/b/a&amp;b</Resource>"), "{body}");
        let body = futures_body(s3_error(404, Some("NoSuchKey"), "/b/k"));
        assert!(body.contains("<Code>NoSuchKey</Code>"), "{body}");
    }

    fn futures_body(resp: Response<ProxyBody>) -> String {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let bytes = rt.block_on(resp.into_body().collect()).unwrap().to_bytes();
        String::from_utf8(bytes.to_vec()).unwrap()
    }
}
