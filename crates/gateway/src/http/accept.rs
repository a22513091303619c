//! The one accept loop and connection server of the gate's listeners: the proxy listener
//! (`server.rs`) and the admin listener (`ops/admin/`) accept and serve connections through
//! these, each with its own connection tracker (caps, header and idle timeouts) and routes.

use crate::http::connlimit::{
    guard_body, CloseReason, ConnGuard, ConnTracker, ResponseGuard, Tracked,
};
use crate::wire::headers::REFUSED_HEADER;
use crate::wire::response::ResBody;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// How long the loop backs off after a failed accept (out of file descriptors and the like).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(20);

/// Refused connections told why at once (at most this many at a time; beyond, closed
/// without a word): each costs a task for at most [`REFUSAL_LINGER`].
const REFUSALS_MAX: usize = 64;
/// How long a refused connection is kept to tell it why and read what it sent meanwhile.
const REFUSAL_LINGER: Duration = Duration::from_secs(1);

/// Accept connections until `stop` changes. A connection over one of `tracker`'s caps is
/// refused at once (the tracker counts it): told 503 with [`REFUSED_HEADER`] naming the cap
/// (see [`refuse`]), then closed; every other one runs
/// `serve(stream, peer, guard)` as a task in `conns`, which the loop reaps as they end. The
/// caller drains or aborts what is still in `conns` once this returns.
pub async fn accept_until_stopped<F, Fut>(
    listener: &TcpListener,
    tracker: &Arc<ConnTracker>,
    stop: &mut watch::Receiver<bool>,
    conns: &mut JoinSet<()>,
    mut serve: F,
) where
    F: FnMut(TcpStream, SocketAddr, ConnGuard) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let refusing = Arc::new(AtomicUsize::new(0));
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            // Reap finished connection tasks so the set does not grow with every connection.
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            accepted = listener.accept() => {
                let Ok((stream, peer)) = accepted else {
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                };
                let guard = match tracker.admit(peer.ip()) {
                    Ok(guard) => guard,
                    Err(reason) => {
                        refuse(stream, reason, &refusing);
                        continue;
                    }
                };
                conns.spawn(serve(stream, peer, guard));
            }
        }
    }
}

/// Tell a connection refused at a cap why, before any request is read: a 503 with
/// [`REFUSED_HEADER`] and `connection: close`. A follower forwarding to its leader tells this
/// "refused before any work" apart from a leader that broke an exchange (it then asks again,
/// or follows the class's fail mode, instead of answering 502); any client gets a status
/// rather than a reset. What the client sent meanwhile is read and discarded (for at most
/// [`REFUSAL_LINGER`]) so that closing does not reset the connection before the answer is
/// read. At most [`REFUSALS_MAX`] at once: beyond, the connection is just closed.
fn refuse(stream: TcpStream, reason: CloseReason, refusing: &Arc<AtomicUsize>) {
    if refusing.fetch_add(1, Ordering::Relaxed) >= REFUSALS_MAX {
        refusing.fetch_sub(1, Ordering::Relaxed);
        return;
    }
    let refusing = Arc::clone(refusing);
    tokio::spawn(async move {
        let answer = format!(
            "HTTP/1.1 503 Service Unavailable\r\n{REFUSED_HEADER}: {}\r\nretry-after: 1\r\n\
             connection: close\r\ncontent-length: 0\r\n\r\n",
            reason.as_str()
        );
        let mut stream = stream;
        let linger = async {
            // The request's head first: an HTTP client that is answered before it has sent
            // its request reads the answer as a broken exchange (hyper: "unexpected message"),
            // which a follower must not take for a leader that started work.
            // A client that sends nothing soon (a slowloris) is answered anyway.
            let _ = tokio::time::timeout(REFUSAL_HEAD_WAIT, read_head(&mut stream)).await;
            stream.write_all(answer.as_bytes()).await?;
            stream.shutdown().await?;
            let mut sink = [0u8; 4096];
            while stream.read(&mut sink).await? > 0 {}
            Ok::<(), std::io::Error>(())
        };
        let _ = tokio::time::timeout(REFUSAL_LINGER, linger).await;
        refusing.fetch_sub(1, Ordering::Relaxed);
    });
}

/// Read (and discard) a refused connection's first request head: up to its blank line, the
/// end of the stream, or [`REFUSAL_HEAD_MAX`] bytes.
async fn read_head(stream: &mut TcpStream) -> std::io::Result<()> {
    let mut buf = [0u8; 4096];
    let mut seen = 0usize;
    let mut tail = [0u8; 4];
    while seen < REFUSAL_HEAD_MAX {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        for &b in &buf[..n] {
            tail = [tail[1], tail[2], tail[3], b];
            if &tail == b"\r\n\r\n" {
                return Ok(());
            }
        }
        seen += n;
    }
    Ok(())
}

/// How long a refused connection's request head is waited for before it is answered anyway.
const REFUSAL_HEAD_WAIT: Duration = Duration::from_millis(100);

/// How much of a refused connection's request head is read before it is answered anyway.
const REFUSAL_HEAD_MAX: usize = 16 * 1024;

/// How a connection ends besides its client closing it or a limit of its tracker.
pub struct Ending {
    /// Told to stop: finish the response in progress, then close (the proxy's shutdown).
    pub stop: Option<watch::Receiver<bool>>,
    /// Closed after this long, whatever it does (the admin listener's cap).
    pub lifetime: Option<Duration>,
}

/// Serve one accepted connection with HTTP/1 and `route`. The tracker's limits (header and
/// idle timeouts, which shrink under overload) apply through `guard`, and each request counts
/// as busy from the moment its headers are in until its response body is dropped; hyper's own
/// fixed header timeout is off.
pub async fn serve_connection<I, R, Fut>(io: I, guard: ConnGuard, ending: Ending, route: R)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    R: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<ResBody>> + Send + 'static,
{
    let state = Arc::clone(guard.state());
    let io = TokioIo::new(Tracked::new(io, Arc::clone(&state)));
    let svc_state = Arc::clone(&state);
    let route = Arc::new(route);
    let svc = service_fn(move |req| {
        let route = Arc::clone(&route);
        let busy = ResponseGuard::new(Arc::clone(&svc_state));
        async move {
            let resp = route(req).await;
            Ok::<_, std::convert::Infallible>(resp.map(|b| guard_body(b, busy)))
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(None)
        .serve_connection(io, svc);
    tokio::pin!(conn);
    let lifetime = async {
        match ending.lifetime {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    let Some(mut stop) = ending.stop else {
        tokio::select! {
            _ = conn.as_mut() => {}
            _ = state.closed() => {}
            _ = lifetime => {}
        }
        drop(guard);
        return;
    };
    // A connection accepted just as the stop signal went out may never see the change.
    if *stop.borrow_and_update() {
        conn.as_mut().graceful_shutdown();
        let _ = conn.await;
        return;
    }
    tokio::select! {
        _ = conn.as_mut() => {}
        // Closed by a limit: dropping the connection closes the socket.
        _ = state.closed() => {}
        _ = lifetime => {}
        _ = stop.changed() => {
            conn.as_mut().graceful_shutdown();
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = state.closed() => {}
            }
        }
    }
    drop(guard);
}
