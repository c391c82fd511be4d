//! The connections of a gRPC (HTTP/2) server within [`ConnArgs`]' limits, as a stream tonic
//! serves. HTTP/2 has no request-by-request turn to watch, so the deadlines are on bytes read:
//! a new connection must send the HTTP/2 preface and a first frame within `--header-timeout`,
//! and after that a connection that sends nothing for `--idle-timeout` is closed. The server
//! pings every connection at half that interval ([`keepalive_interval`]): a live client's
//! answers keep its connection open however long its queries take, a vanished one's silence
//! closes it.
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, Sleep};
use tonic::transport::server::{Connected, TcpConnectInfo};

use super::{accept_loop, ConnArgs, Gate, Permit};

/// Bytes a client sends before its first request can follow: the HTTP/2 connection preface
/// (24 bytes) and the header of its SETTINGS frame (9).
const OPENING_BYTES: u64 = 24 + 9;

/// How often the server pings a connection: twice per idle timeout, so a live client's answer
/// always comes before the timeout.
pub fn keepalive_interval(args: &ConnArgs) -> Duration {
    args.idle_timeout / 2
}

/// The connections `listener` accepts within `args`' caps, each under its deadlines. Refused
/// ones are closed at once (a gRPC client sees the connection reset and may retry).
pub fn incoming(
    listener: TcpListener,
    args: &ConnArgs,
) -> impl Stream<Item = io::Result<Guarded>> + Send + 'static {
    let gate = Gate::new(args);
    let (header, idle) = (args.header_timeout, args.idle_timeout);
    // Enough to keep accepting while tonic takes connections in; the gate bounds them anyway.
    let (tx, rx) = tokio::sync::mpsc::channel::<Guarded>(64);
    tokio::spawn(accept_loop(
        listener,
        gate,
        |_, _| {},
        move |stream, _, permit| {
            let conn = Guarded {
                stream,
                _permit: permit,
                read: 0,
                header,
                idle,
                deadline: Box::pin(tokio::time::sleep(header)),
            };
            if let Err(e) = tx.try_send(conn) {
                // The server is not taking connections in: drop this one like a refused one.
                tracing::warn!("gRPC server busy, connection dropped: {e}");
            }
        },
    ));
    futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|conn| (Ok(conn), rx))
    })
}

/// A connection under the gate's cap and its read deadlines.
pub struct Guarded {
    stream: TcpStream,
    _permit: Permit,
    /// Bytes read so far (up to [`OPENING_BYTES`]; after that only whether more came).
    read: u64,
    header: Duration,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl Guarded {
    fn timed_out(&self) -> io::Error {
        let what = if self.read < OPENING_BYTES {
            format!(
                "no HTTP/2 preface within --header-timeout {}",
                hslake_schemas::units::show_duration(self.header)
            )
        } else {
            format!(
                "nothing received for --idle-timeout {}",
                hslake_schemas::units::show_duration(self.idle)
            )
        };
        io::Error::new(io::ErrorKind::TimedOut, what)
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let n = (buf.filled().len() - before) as u64;
                if n > 0 {
                    let was_opening = this.read < OPENING_BYTES;
                    this.read = (this.read + n).min(OPENING_BYTES);
                    // The opening's deadline runs from the connect; once it is in, each read
                    // moves the idle deadline.
                    if !was_opening || this.read >= OPENING_BYTES {
                        this.deadline.as_mut().reset(Instant::now() + this.idle);
                    }
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err(this.timed_out())),
                Poll::Pending => Poll::Pending,
            },
            ready => ready,
        }
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

impl Connected for Guarded {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn args() -> ConnArgs {
        ConnArgs {
            max_connections: 8,
            max_connections_per_client: 2,
            header_timeout: Duration::from_millis(200),
            idle_timeout: Duration::from_millis(500),
        }
    }

    /// Reads from `conn` until it errs; returns the error and how long it took.
    async fn read_until_error(mut conn: Guarded) -> (io::Error, Duration) {
        let t = std::time::Instant::now();
        let mut buf = [0u8; 64];
        loop {
            match conn.read(&mut buf).await {
                Err(e) => return (e, t.elapsed()),
                Ok(0) => panic!("closed by the peer"),
                Ok(_) => {}
            }
        }
    }

    #[tokio::test]
    async fn a_silent_or_stalled_connection_errs_at_its_deadline_and_a_third_is_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut conns = Box::pin(incoming(listener, &args()));

        let _silent = TcpStream::connect(addr).await.unwrap();
        let (e, took) = read_until_error(conns.next().await.unwrap().unwrap()).await;
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(e.to_string().contains("--header-timeout 200ms"), "{e}");
        assert!(took >= Duration::from_millis(150), "{took:?}");

        // The opening in time, then silence: the idle deadline, from the last byte.
        let mut opened = TcpStream::connect(addr).await.unwrap();
        opened
            .write_all(&[0u8; OPENING_BYTES as usize])
            .await
            .unwrap();
        let (e, took) = read_until_error(conns.next().await.unwrap().unwrap()).await;
        assert!(e.to_string().contains("--idle-timeout 500ms"), "{e}");
        assert!(took >= Duration::from_millis(400), "{took:?}");

        // Two held from one address: the third is closed without reaching the server.
        let _a = TcpStream::connect(addr).await.unwrap();
        let _b = TcpStream::connect(addr).await.unwrap();
        let _held = (conns.next().await, conns.next().await);
        let mut third = TcpStream::connect(addr).await.unwrap();
        let mut buf = [0u8; 8];
        let n = tokio::time::timeout(Duration::from_secs(2), third.read(&mut buf)).await;
        assert!(matches!(n, Ok(Ok(0)) | Ok(Err(_))), "{n:?}");
    }
}
