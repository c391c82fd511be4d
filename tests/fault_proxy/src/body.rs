//! Response bodies the proxy sends: passed through, cut short, or a small fixed text.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::{Body, Frame, Incoming};

use crate::conn::ConnCtl;

/// The body type of every response the proxy sends.
pub(crate) type ProxyBody = BoxBody<Bytes, hyper::Error>;

/// A fixed body.
pub(crate) fn full(data: impl Into<Bytes>) -> ProxyBody {
    Full::new(data.into())
        .map_err(|never| match never {})
        .boxed()
}

/// The upstream body as it comes.
pub(crate) fn passed(body: Incoming) -> ProxyBody {
    body.boxed()
}

/// The first `limit` bytes of `body`, then the connection closes (the headers still announce
/// the full length, so the client sees a short body).
pub(crate) fn truncated(body: Incoming, limit: u64, ctl: Arc<ConnCtl>) -> ProxyBody {
    Truncated {
        inner: body,
        left: limit,
        ctl,
    }
    .boxed()
}

struct Truncated {
    inner: Incoming,
    left: u64,
    ctl: Arc<ConnCtl>,
}

impl Body for Truncated {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        loop {
            if self.left == 0 {
                // Never woken: the connection ends once hyper flushed what came before.
                self.ctl.close_after_flush();
                return Poll::Pending;
            }
            match ready!(Pin::new(&mut self.inner).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else {
                        continue; // trailers: not part of the body
                    };
                    let take = data
                        .len()
                        .min(usize::try_from(self.left).unwrap_or(usize::MAX));
                    self.left -= take as u64;
                    return Poll::Ready(Some(Ok(Frame::data(data.slice(..take)))));
                }
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
                None => self.left = 0,
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        false
    }
}
