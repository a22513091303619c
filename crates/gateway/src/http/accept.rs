//! The one accept loop and connection server of the gate's listeners: the proxy listener
//! (`server.rs`) and the admin listener (`ops/admin/`) accept and serve connections through
//! these, each with its own connection tracker (caps, header and idle timeouts) and routes.

use crate::http::connlimit::{guard_body, ConnGuard, ConnTracker, ResponseGuard, Tracked};
use crate::wire::response::ResBody;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// How long the loop backs off after a failed accept (out of file descriptors and the like).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(20);

/// Accept connections until `stop` changes. A connection over one of `tracker`'s caps is
/// closed at once (dropping the stream; the tracker counts it); every other one runs
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
                let Ok(guard) = tracker.admit(peer.ip()) else {
                    continue;
                };
                conns.spawn(serve(stream, peer, guard));
            }
        }
    }
}

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
