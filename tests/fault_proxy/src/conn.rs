//! Ending a client connection the way a fault asks: a reset (RST, nothing more arrives) or a
//! close once everything already handed to the socket has been sent (FIN after a cut body).

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::Notify;

/// Shared between a connection's task, its IO and the request handler that applies faults.
#[derive(Default)]
pub(crate) struct ConnCtl {
    /// Wakes the connection task, which then drops the connection.
    kill: Notify,
    /// Drop the socket with SO_LINGER 0, so the peer gets a reset.
    reset: AtomicBool,
    /// Close as soon as hyper has flushed what it wrote.
    close_after_flush: AtomicBool,
}

impl ConnCtl {
    /// Resets the connection now; the pending response is never sent.
    pub(crate) fn reset(&self) {
        self.reset.store(true, Ordering::SeqCst);
        self.kill.notify_one();
    }

    /// Closes the connection after the bytes written so far reach the socket.
    pub(crate) fn close_after_flush(&self) {
        self.close_after_flush.store(true, Ordering::SeqCst);
    }

    /// Resolves when a fault asked for the connection to end.
    pub(crate) async fn killed(&self) {
        self.kill.notified().await
    }
}

/// The client socket as hyper sees it, plus the two ways a fault can end it.
pub(crate) struct FaultIo {
    inner: TcpStream,
    ctl: std::sync::Arc<ConnCtl>,
}

impl FaultIo {
    pub(crate) fn new(inner: TcpStream, ctl: std::sync::Arc<ConnCtl>) -> Self {
        FaultIo { inner, ctl }
    }
}

impl AsyncRead for FaultIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for FaultIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    /// hyper calls this only once its write buffer is empty, so a cut body is complete on the
    /// wire when the flag is seen here.
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(Pin::new(&mut self.inner).poll_flush(cx))?;
        if self.ctl.close_after_flush.load(Ordering::SeqCst) {
            ready!(Pin::new(&mut self.inner).poll_shutdown(cx))?;
            self.ctl.kill.notify_one();
        }
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl Drop for FaultIo {
    fn drop(&mut self) {
        if self.ctl.reset.load(Ordering::SeqCst) {
            // Linger 0 turns the close that follows into a reset: unsent data is discarded and
            // the peer's next read fails, as when a load balancer drops a connection.
            if let Err(e) = socket2::SockRef::from(&self.inner).set_linger(Some(Duration::ZERO)) {
                tracing::warn!("fault proxy: cannot set SO_LINGER for a reset: {e}");
            }
        }
    }
}
