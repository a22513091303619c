//! Accept loop, routing and the gateway's lifecycle.
//!
//! The entry point takes an already-bound listener (mini-redis style) so tests bind
//! `127.0.0.1:0` and never fight over ports. One tokio task per connection; one timer task
//! ticks the core so queued jobs whose slack died are dropped promptly.

use crate::config::Config;
use crate::proxy;
use crate::response::{self, ResBody};
use crate::state::Shared;
use crate::telemetry::DecisionLog;
use http::{Method, Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Route one request.
pub async fn route(shared: Arc<Shared>, req: Request<Incoming>) -> Response<ResBody> {
    let path = req.uri().path();
    match (req.method(), path) {
        (&Method::POST, "/v1/chat/completions" | "/v1/completions" | "/v1/embeddings") => {
            proxy::admitted(shared, req).await
        }
        (&Method::GET, "/healthz") => response::text("text/plain", "ok\n".into()),
        (&Method::GET, "/metrics") => {
            let snap = shared.snapshot();
            let body = shared.metrics.render(&snap, shared.log.counters());
            response::text("text/plain; version=0.0.4", body)
        }
        (&Method::GET, "/stats") => response::json(&crate::stats::stats(&shared)),
        (_, p) if p.starts_with("/v1/") => proxy::passthrough(shared, req).await,
        (_, p) => {
            let p = p.to_string();
            response::not_found(&p)
        }
    }
}

/// A running gateway (for tests and embedding): its address and a way to stop it.
pub struct Gateway {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Gateway {
    /// Start serving on `listener` with `cfg` (validated here) and `log`.
    pub fn spawn(listener: TcpListener, cfg: &Config, log: DecisionLog) -> Result<Gateway, String> {
        cfg.validate().map_err(|e| e.to_string())?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let shared = Arc::new(Shared::new(cfg, log)?);
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(serve(listener, Arc::clone(&shared), stopped));
        Ok(Gateway {
            addr,
            shared,
            stop,
            task,
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Shared state (flags, snapshots) for tests and the admin API.
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Stop accepting, then flush the decision log.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
        self.shared.log.flush().await;
    }
}

/// Serve until `shutdown` resolves, then flush the decision log.
pub async fn run(
    listener: TcpListener,
    cfg: &Config,
    log: DecisionLog,
    shutdown: impl Future<Output = ()>,
) -> Result<(), String> {
    let gw = Gateway::spawn(listener, cfg, log)?;
    shutdown.await;
    gw.shutdown().await;
    Ok(())
}

async fn serve(listener: TcpListener, shared: Arc<Shared>, mut stopped: watch::Receiver<bool>) {
    let ticker = tokio::spawn(tick_loop(Arc::clone(&shared), stopped.clone()));
    loop {
        tokio::select! {
            _ = stopped.changed() => break,
            accepted = listener.accept() => {
                let (stream, _) = match accepted {
                    Ok(a) => a,
                    // Out of file descriptors and the like: back off briefly, keep serving.
                    Err(_) => {
                        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let shared = Arc::clone(&shared);
                let mut conn_stop = stopped.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let shared = Arc::clone(&shared);
                        async move { Ok::<_, std::convert::Infallible>(route(shared, req).await) }
                    });
                    let conn = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc);
                    tokio::pin!(conn);
                    tokio::select! {
                        _ = conn.as_mut() => {}
                        _ = conn_stop.changed() => {
                            conn.as_mut().graceful_shutdown();
                            let _ = conn.await;
                        }
                    }
                });
            }
        }
    }
    ticker.abort();
}

async fn tick_loop(shared: Arc<Shared>, mut stopped: watch::Receiver<bool>) {
    let period = std::time::Duration::from_millis(shared.server.tick_ms.max(1));
    let mut interval = tokio::time::interval(period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stopped.changed() => return,
            _ = interval.tick() => shared.tick(),
        }
    }
}
