//! Upstream connections that remember what went over them.
//!
//! When a request fails before its response, hyper says *how* the connection failed but not
//! whether that connection had served a request before, nor whether any byte of a response
//! had arrived. Both decide whether sending the request again is safe (see
//! [`super::retry`]), so every upstream socket is wrapped in [`Tracked`], which counts the
//! request/response exchanges it carried and the bytes read in the current one. The counts
//! travel with hyper-util's connection info ([`Connected::extra`]), which the client attaches
//! to its errors, so the proxy can read them from a failed request.
//!
//! HTTP/1.1 without pipelining (all hyper's client does) makes the counting simple: a
//! connection alternates between writing a request and reading its response, so the first
//! write after a read starts the next exchange.
//!
//! For `https://` upstreams the TLS handshake is done here, before the stream is wrapped, and
//! [`Tracked`] counts the *plaintext* side: the handshake's own writes and reads would
//! otherwise look like exchanges, and a brand-new TLS connection would pass for a reused one.
//! ALPN offers h2 and http/1.1; when the server picks h2 the connection info says so and
//! hyper-util speaks HTTP/2 on it (where the counts mean nothing: see [`super::UpstreamClient`]).

use super::cause::ConnectFailure;
use hyper_util::client::legacy::connect::dns::Name;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

/// What one upstream connection has carried so far, shared between the socket wrapper and
/// the connection info hyper-util copies into its errors.
#[derive(Debug, Default)]
pub(crate) struct Activity {
    /// Exchanges begun: requests the client started to write on this connection.
    exchanges: AtomicU64,
    /// Bytes read since the current exchange began (its response so far).
    response_bytes: AtomicU64,
}

impl Activity {
    /// Exchanges begun on the connection, the current one included.
    pub(crate) fn exchanges(&self) -> u64 {
        self.exchanges.load(Ordering::Relaxed)
    }

    /// Bytes of a response read since the current exchange began.
    pub(crate) fn response_bytes(&self) -> u64 {
        self.response_bytes.load(Ordering::Relaxed)
    }
}

/// The handle hyper-util keeps in a connection's info (its "extra").
#[derive(Clone, Debug)]
pub(crate) struct ActivityTag(pub(crate) Arc<Activity>);

/// The activity of the connection an error happened on, if it went through [`Connector`].
pub(crate) fn activity_of(connected: &Connected) -> Option<Arc<Activity>> {
    let mut ext = http::Extensions::new();
    connected.get_extras(&mut ext);
    ext.get::<ActivityTag>().map(|t| t.0.clone())
}

/// The byte stream under [`Tracked`]: plain TCP, or TLS over TCP.
#[derive(Debug)]
pub(crate) enum Stream {
    /// `http://`.
    Plain(TcpStream),
    /// `https://`, handshake done (boxed: the TLS state is large).
    Tls(Box<TlsStream<TcpStream>>),
}

impl Stream {
    fn connected(&self) -> Connected {
        match self {
            Stream::Plain(tcp) => tcp.connected(),
            Stream::Tls(tls) => {
                let (tcp, session) = tls.get_ref();
                let c = tcp.connected();
                if session.alpn_protocol() == Some(b"h2") {
                    c.negotiated_h2()
                } else {
                    c
                }
            }
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// A connection to an upstream (plain or TLS) that counts its exchanges.
#[derive(Debug)]
pub(crate) struct Tracked {
    stream: Stream,
    activity: Arc<Activity>,
    /// The last thing done was a read (or nothing yet): the next write begins an exchange.
    between_exchanges: bool,
}

impl Tracked {
    fn new(stream: Stream) -> Tracked {
        Tracked {
            stream,
            activity: Arc::new(Activity::default()),
            between_exchanges: true,
        }
    }

    /// Called before every write attempt: counted on the attempt, not on its success, so a
    /// request whose very first write fails (the server already reset the connection) still
    /// counts as an exchange of its own.
    fn begin_write(&mut self) {
        if self.between_exchanges {
            self.between_exchanges = false;
            self.activity.response_bytes.store(0, Ordering::Relaxed);
            self.activity.exchanges.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Connection for Tracked {
    fn connected(&self) -> Connected {
        self.stream
            .connected()
            .extra(ActivityTag(self.activity.clone()))
    }
}

impl AsyncRead for Tracked {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.stream).poll_read(cx, buf);
        let n = buf.filled().len().saturating_sub(before);
        if n > 0 {
            this.between_exchanges = true;
            this.activity
                .response_bytes
                .fetch_add(n as u64, Ordering::Relaxed);
        }
        r
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.begin_write();
        Pin::new(&mut this.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.begin_write();
        Pin::new(&mut this.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// hyper-util's TCP connector plus a TLS handshake for `https://`, handing out [`Tracked`]
/// connections. Its errors are [`ConnectFailure`]s, which name what failed (see
/// [`super::cause`]).
#[derive(Clone)]
pub(crate) struct Connector {
    connect_timeout: Duration,
    tls: TlsConnector,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector").finish_non_exhaustive()
    }
}

impl Connector {
    /// A connector whose TCP connects give up after `connect_timeout` and whose `https://`
    /// connections use the TLS client settings `tls`.
    pub(crate) fn new(connect_timeout: Duration, tls: Arc<rustls::ClientConfig>) -> Connector {
        Connector {
            connect_timeout,
            tls: TlsConnector::from(tls),
        }
    }

    /// hyper-util's TCP connector for one connection, resolving names through `lookup` so the
    /// addresses tried are known when they all fail. (hyper-util's own error keeps them to
    /// itself.) Building one costs an allocation, nothing next to a TCP handshake.
    fn tcp(&self, lookup: Lookup) -> HttpConnector<Lookup> {
        let mut http = HttpConnector::new_with_resolver(lookup);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(self.connect_timeout));
        // `https://` URIs reach the TCP connector too; the handshake follows it here.
        http.enforce_http(false);
        http
    }
}

/// Resolves an upstream's host name (as hyper-util's default resolver does: `getaddrinfo` on
/// a blocking thread), keeping the addresses for the error message and naming the host when
/// the lookup fails.
#[derive(Clone, Debug, Default)]
struct Lookup {
    resolved: Arc<Mutex<Vec<SocketAddr>>>,
}

impl Lookup {
    fn addresses(&self) -> Vec<SocketAddr> {
        self.resolved
            .lock()
            .map(|a| a.clone())
            .unwrap_or_else(|p| p.into_inner().clone())
    }
}

impl tower_service::Service<Name> for Lookup {
    type Response = std::vec::IntoIter<SocketAddr>;
    type Error = ConnectFailure;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, ConnectFailure>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), ConnectFailure>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, name: Name) -> Self::Future {
        let resolved = Arc::clone(&self.resolved);
        Box::pin(async move {
            let host = name.as_str().to_string();
            let failed = |why: String| ConnectFailure::Dns {
                host: host.clone(),
                why,
            };
            // Port 0: hyper-util puts the URL's port on every address.
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0))
                .await
                .map_err(|e| failed(e.to_string()))?
                .collect();
            if addrs.is_empty() {
                return Err(failed("no address".into()));
            }
            *resolved.lock().unwrap_or_else(|p| p.into_inner()) = addrs.clone();
            Ok(addrs.into_iter())
        })
    }
}

/// The name the server's certificate must carry: the URL's host (an IP literal is checked
/// against the certificate's IP addresses). Also sent as SNI for a DNS name.
fn server_name(dst: &http::Uri) -> Result<rustls_pki_types::ServerName<'static>, ConnectFailure> {
    let host = dst
        .host()
        .ok_or_else(|| ConnectFailure::Url("upstream URL has no host".into()))?;
    // `Uri::host` keeps the brackets of an IPv6 literal.
    let host = host.trim_start_matches('[').trim_end_matches(']');
    rustls_pki_types::ServerName::try_from(host.to_string())
        .map_err(|e| ConnectFailure::Url(format!("{host:?} is not a valid TLS server name: {e}")))
}

/// `host:port` of `dst`, the port defaulted by scheme.
fn host_port(dst: &http::Uri) -> String {
    let https = dst.scheme() == Some(&http::uri::Scheme::HTTPS);
    let port = dst.port_u16().unwrap_or(if https { 443 } else { 80 });
    format!("{}:{port}", dst.host().unwrap_or(""))
}

/// What a failed TCP connect was about, from hyper-util's error: the failed lookup (our
/// resolver's own error, passed through), a timeout, or the socket's error, with `target` and
/// the addresses the name resolved to.
fn tcp_failure(
    err: &(dyn std::error::Error + 'static),
    target: &str,
    resolved: &[SocketAddr],
    bound: Duration,
) -> ConnectFailure {
    let mut next = err.source();
    let mut io_error = None;
    while let Some(e) = next {
        if let Some(f) = e.downcast_ref::<ConnectFailure>() {
            return f.clone();
        }
        if io_error.is_none() {
            io_error = e.downcast_ref::<io::Error>();
        }
        next = e.source();
    }
    let target = match resolved {
        [] => target.to_string(),
        addrs => {
            let shown: Vec<String> = addrs.iter().take(4).map(|a| a.ip().to_string()).collect();
            let more = if addrs.len() > 4 { ", ..." } else { "" };
            format!("{target} ({}{more})", shown.join(", "))
        }
    };
    match io_error {
        Some(io) if io.kind() == io::ErrorKind::TimedOut => ConnectFailure::Timeout {
            target,
            bound_ms: u64::try_from(bound.as_millis()).unwrap_or(u64::MAX),
        },
        Some(io) => ConnectFailure::Tcp {
            target,
            why: io.to_string(),
        },
        None => ConnectFailure::Tcp {
            target,
            why: super::cause::chain(err),
        },
    }
}

/// A server that accepts the TCP connection but never finishes the handshake would otherwise
/// hold the request until its deadline; as with the TCP connect timeout, a few seconds is
/// far beyond any live server's handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl tower_service::Service<http::Uri> for Connector {
    type Response = TokioIo<Tracked>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<TokioIo<Tracked>, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // Each call builds its own TCP connector, whose resolver is always ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, dst: http::Uri) -> Self::Future {
        let https = dst.scheme() == Some(&http::uri::Scheme::HTTPS);
        let name = if https { Some(server_name(&dst)) } else { None };
        let target = host_port(&dst);
        let lookup = Lookup::default();
        let mut tcp = self.tcp(lookup.clone());
        let connecting = tower_service::Service::<http::Uri>::call(&mut tcp, dst);
        let (tls, bound) = (self.tls.clone(), self.connect_timeout);
        Box::pin(async move {
            let tcp = match connecting.await {
                Ok(io) => io.into_inner(),
                Err(e) => {
                    return Err(tcp_failure(&e, &target, &lookup.addresses(), bound).into());
                }
            };
            let stream = match name {
                None => Stream::Plain(tcp),
                Some(name) => {
                    let handshake = tls.connect(name?, tcp);
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await {
                        Ok(Ok(done)) => Stream::Tls(Box::new(done)),
                        Ok(Err(e)) => {
                            return Err(ConnectFailure::Tls {
                                server: target,
                                why: super::cause::handshake_failure(&e),
                            }
                            .into())
                        }
                        Err(_) => {
                            return Err(ConnectFailure::TlsTimeout {
                                server: target,
                                bound_ms: HANDSHAKE_TIMEOUT.as_millis() as u64,
                            }
                            .into())
                        }
                    }
                }
            };
            Ok(TokioIo::new(Tracked::new(stream)))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls_pki_types::ServerName;

    fn name(uri: &str) -> Option<ServerName<'static>> {
        uri.parse::<http::Uri>()
            .ok()
            .and_then(|u| server_name(&u).ok())
    }

    #[test]
    fn the_server_name_is_the_urls_host() {
        // A DNS name: checked against the certificate and sent as SNI.
        assert!(matches!(
            name("https://api.example.com/v1"),
            Some(ServerName::DnsName(d)) if d.as_ref() == "api.example.com"
        ));
        // IP literals are checked against the certificate's IP addresses (no SNI).
        assert!(matches!(
            name("https://127.0.0.1:8443"),
            Some(ServerName::IpAddress(_))
        ));
        assert!(matches!(
            name("https://[::1]:8443"),
            Some(ServerName::IpAddress(_))
        ));
    }
}
