//! Serving with bounds: at most [`MAX_CONNECTIONS`] connections at once and none idle
//! for longer than [`IDLE_TIMEOUT`], so viewers that pile up or hang cannot hold the
//! process's memory or sockets.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;

/// Connections served at once; more wait in the listen backlog.
pub const MAX_CONNECTIONS: usize = 256;
/// A connection that sends nothing for this long is closed (a page polls every second).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves `app` on `listener` under the bounds above until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let bounded = Bounded {
        inner: listener,
        permits: Arc::new(Semaphore::new(MAX_CONNECTIONS)),
    };
    axum::serve(bounded, app)
        .with_graceful_shutdown(shutdown)
        .await
}

struct Bounded {
    inner: TcpListener,
    permits: Arc<Semaphore>,
}

impl axum::serve::Listener for Bounded {
    type Io = Conn;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Conn, std::net::SocketAddr) {
        loop {
            let Ok(permit) = self.permits.clone().acquire_owned().await else {
                // The semaphore is never closed; wait as if it were full.
                std::future::pending::<()>().await;
                continue;
            };
            match self.inner.accept().await {
                Ok((stream, addr)) => {
                    let _ = stream.set_nodelay(true);
                    let conn = Conn {
                        stream,
                        _permit: permit,
                        idle: Box::pin(tokio::time::sleep(IDLE_TIMEOUT)),
                    };
                    return (conn, addr);
                }
                Err(e) => {
                    // Out of file descriptors and the like: back off, as axum does.
                    tracing::debug!(error = %e, "HTTP accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<std::net::SocketAddr> {
        self.inner.local_addr()
    }
}

/// A connection holding one of the listener's permits, closed after [`IDLE_TIMEOUT`]
/// without a byte read.
struct Conn {
    stream: TcpStream,
    _permit: OwnedSemaphorePermit,
    idle: Pin<Box<Sleep>>,
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.stream).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if buf.filled().len() > before {
                    let at = tokio::time::Instant::now() + IDLE_TIMEOUT;
                    self.idle.as_mut().reset(at);
                }
                Poll::Ready(r)
            }
            Poll::Pending => match self.idle.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "HTTP connection idle",
                ))),
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}
