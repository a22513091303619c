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

use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
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
/// connections.
#[derive(Clone)]
pub(crate) struct Connector {
    http: HttpConnector,
    tls: TlsConnector,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector").finish_non_exhaustive()
    }
}

impl Connector {
    /// Wrap a configured TCP connector (it must accept `https://` URIs: `enforce_http(false)`)
    /// and the TLS client settings used for `https://` destinations.
    pub(crate) fn new(http: HttpConnector, tls: Arc<rustls::ClientConfig>) -> Connector {
        Connector {
            http,
            tls: TlsConnector::from(tls),
        }
    }
}

/// The name the server's certificate must carry: the URL's host (an IP literal is checked
/// against the certificate's IP addresses). Also sent as SNI for a DNS name.
fn server_name(dst: &http::Uri) -> Result<rustls_pki_types::ServerName<'static>, ConnectError> {
    let host = dst.host().ok_or("upstream URL has no host")?;
    // `Uri::host` keeps the brackets of an IPv6 literal.
    let host = host.trim_start_matches('[').trim_end_matches(']');
    rustls_pki_types::ServerName::try_from(host.to_string())
        .map_err(|e| format!("{host:?} is not a valid TLS server name: {e}").into())
}

/// A server that accepts the TCP connection but never finishes the handshake would otherwise
/// hold the request until its deadline; as with the TCP connect timeout, a few seconds is
/// far beyond any live server's handshake.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

type ConnectError = Box<dyn std::error::Error + Send + Sync>;

impl tower_service::Service<http::Uri> for Connector {
    type Response = TokioIo<Tracked>;
    type Error = ConnectError;
    type Future = Pin<Box<dyn Future<Output = Result<TokioIo<Tracked>, ConnectError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ConnectError>> {
        tower_service::Service::<http::Uri>::poll_ready(&mut self.http, cx).map_err(Into::into)
    }

    fn call(&mut self, dst: http::Uri) -> Self::Future {
        let https = dst.scheme() == Some(&http::uri::Scheme::HTTPS);
        let name = if https { Some(server_name(&dst)) } else { None };
        let connecting = tower_service::Service::<http::Uri>::call(&mut self.http, dst);
        let tls = self.tls.clone();
        Box::pin(async move {
            let tcp = connecting.await?.into_inner();
            let stream = match name {
                None => Stream::Plain(tcp),
                Some(name) => {
                    let handshake = tls.connect(name?, tcp);
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await {
                        Ok(done) => Stream::Tls(Box::new(done?)),
                        Err(_) => return Err("TLS handshake with the upstream timed out".into()),
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
