//! A small TCP proxy of our own, for the fault harness: it sits between one replica and Redis
//! on 127.0.0.1 and can, at runtime, pass bytes through, delay them, reset every connection
//! open at that moment, or blackhole (accept and read, never forward, never answer). No
//! packaged fault proxy is available here, and these four are all the harness needs: a slow
//! Redis, a Redis that drops its clients, and a Redis that has silently gone away (the case
//! only a client-side timeout notices).
//!
//! It runs on the test's tokio runtime; its tasks end when the [`Proxy`] is dropped.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does with the bytes it reads, set with [`Proxy::set`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Forward at once, both ways.
    Pass,
    /// Forward each read after this long, both ways (a round trip costs twice this).
    Delay(Duration),
    /// Accept and read, forward nothing, answer nothing: a peer that vanished without closing.
    Blackhole,
}

/// State shared by the accept loop and the connections.
struct Shared {
    mode: Mutex<Mode>,
    /// Bumped by [`Proxy::reset_connections`]: every connection open then ends with a reset.
    resets: watch::Sender<u64>,
}

impl Shared {
    fn mode(&self) -> Mode {
        self.mode.lock().map_or(Mode::Pass, |m| *m)
    }
}

/// A running proxy: listens on its own `127.0.0.1` port, forwards to `upstream`.
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Bind `127.0.0.1:0` and forward what arrives there to `upstream`, in [`Mode::Pass`].
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (resets, _) = watch::channel(0u64);
        let shared = Arc::new(Shared {
            mode: Mutex::new(Mode::Pass),
            resets,
        });
        let accept = tokio::spawn(accept_loop(listener, upstream, shared.clone()));
        Ok(Proxy {
            addr,
            shared,
            accept,
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// From now on, treat every read (on open connections and new ones) as `mode` says.
    pub fn set(&self, mode: Mode) {
        if let Ok(mut m) = self.shared.mode.lock() {
            *m = mode;
        }
    }

    /// The mode in force.
    pub fn mode(&self) -> Mode {
        self.shared.mode()
    }

    /// End every connection open now with a TCP reset, both sides; new connections are taken
    /// as the mode says.
    pub fn reset_connections(&self) {
        self.shared.resets.send_modify(|n| *n += 1);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.reset_connections();
    }
}

async fn accept_loop(listener: TcpListener, upstream: SocketAddr, shared: Arc<Shared>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            // Out of descriptors, say: try again shortly rather than spin.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let mut reset = shared.resets.subscribe();
            reset.mark_unchanged();
            tokio::select! {
                () = connection(client, upstream, &shared) => {}
                _ = reset.changed() => {}
            }
        });
    }
}

/// One client connection: blackholed from the start if the mode says so, else paired with a
/// fresh upstream connection and pumped both ways until either side closes. Dropped (with a
/// reset) when the proxy resets its connections.
async fn connection(client: TcpStream, upstream: SocketAddr, shared: &Shared) {
    // Both sockets close with RST, not FIN, when this future is dropped: a reset is what
    // `reset_connections` promises, and a blackholed peer must not say goodbye either.
    let _ = client.set_zero_linger();
    let (mut client_rx, mut client_tx) = client.into_split();
    if shared.mode() == Mode::Blackhole {
        swallow(&mut client_rx).await;
        return;
    }
    let connect = tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(upstream));
    let Ok(Ok(server)) = connect.await else {
        return;
    };
    let _ = server.set_zero_linger();
    let (mut server_rx, mut server_tx) = server.into_split();
    tokio::select! {
        () = pump(&mut client_rx, &mut server_tx, shared) => {}
        () = pump(&mut server_rx, &mut client_tx, shared) => {}
    }
}

/// Read until EOF or an error, keeping nothing.
async fn swallow<R: AsyncReadExt + Unpin>(from: &mut R) {
    let mut buf = vec![0u8; 16 * 1024];
    while matches!(from.read(&mut buf).await, Ok(n) if n > 0) {}
}

/// Copy `from` to `to`, each read as the mode in force when it arrived says.
async fn pump<R, W>(from: &mut R, to: &mut W, shared: &Shared)
where
    R: AsyncReadExt + Unpin,
    W: AsyncWriteExt + Unpin,
{
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        match shared.mode() {
            Mode::Pass => {}
            Mode::Delay(d) => tokio::time::sleep(d).await,
            Mode::Blackhole => continue,
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
