//! A small HTTPS upstream for tests: a certificate authority and a server certificate made in
//! the test (rcgen), rustls on 127.0.0.1:0, HTTP/2 or HTTP/1.1 by ALPN, and a record of what
//! each request looked like on arrival (protocol version, headers). It answers every POST with
//! a fixed chat completion, or with the status and headers a test sets (a provider's 429).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode, Version};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, SanType};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::net::TcpListener;

/// A certificate authority made for one test, and a server certificate for 127.0.0.1 and
/// `localhost` signed by it.
pub struct TestCa {
    /// The CA certificate, PEM.
    pub ca_pem: String,
    leaf: CertificateDer<'static>,
    leaf_key: Vec<u8>,
}

/// Which certificate the server presents as its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Leaf {
    /// A server certificate for 127.0.0.1 and `localhost`, signed by the CA: the good one.
    Signed,
    /// The CA certificate itself (it also names 127.0.0.1 and `localhost`): a CA served as
    /// the server's own certificate, which a verifier must refuse.
    CaItself,
    /// A server certificate signed by the CA for another host only (`other.example`).
    WrongName,
}

impl TestCa {
    pub fn new(name: &str) -> TestCa {
        TestCa::with_leaf(name, Leaf::Signed)
    }

    /// A CA whose server presents `leaf`.
    pub fn with_leaf(name: &str, leaf: Leaf) -> TestCa {
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        ca_params
            .subject_alt_names
            .push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, format!("slackgate test CA {name}"));
        let ca = ca_params.self_signed(&ca_key).unwrap();
        if leaf == Leaf::CaItself {
            return TestCa {
                ca_pem: ca.pem(),
                leaf: ca.der().clone(),
                leaf_key: ca_key.serialize_der(),
            };
        }
        let hosts = match leaf {
            Leaf::WrongName => vec!["other.example".to_string()],
            _ => vec!["localhost".to_string()],
        };
        let leaf_key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(hosts).unwrap();
        if leaf == Leaf::Signed {
            params
                .subject_alt_names
                .push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
        }
        let cert = params.signed_by(&leaf_key, &ca, &ca_key).unwrap();
        TestCa {
            ca_pem: ca.pem(),
            leaf: cert.der().clone(),
            leaf_key: leaf_key.serialize_der(),
        }
    }

    /// Write the CA certificate to a fresh file and return its path.
    pub fn write_ca(&self, name: &str) -> PathBuf {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let path = std::env::temp_dir().join(format!(
            "slackgate-ca-{name}-{}-{nanos}.pem",
            std::process::id()
        ));
        std::fs::write(&path, &self.ca_pem).unwrap();
        path
    }

    fn server_config(&self, h2: bool) -> Arc<rustls::ServerConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.leaf_key.clone()));
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![self.leaf.clone()], key)
            .unwrap();
        cfg.alpn_protocols = if h2 {
            vec![b"h2".to_vec(), b"http/1.1".to_vec()]
        } else {
            vec![b"http/1.1".to_vec()]
        };
        Arc::new(cfg)
    }
}

/// One request as the upstream received it.
#[derive(Clone, Debug)]
pub struct Seen {
    pub version: Version,
    pub path: String,
    pub headers: HeaderMap,
    /// Its number on its connection (1: the connection's first).
    pub on_connection: u64,
    /// Which connection (1: the first accepted).
    pub connection: u64,
}

/// What the upstream answers.
#[derive(Clone, Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: Vec<(String, String)>,
    /// Drop the connection without a response for the request with this number on its
    /// connection (the stale keep-alive race, or a server dying on a fresh connection).
    pub drop_nth_on_connection: Option<u64>,
}

impl Default for Reply {
    fn default() -> Self {
        Reply {
            status: StatusCode::OK,
            headers: Vec::new(),
            drop_nth_on_connection: None,
        }
    }
}

/// A running HTTPS upstream.
pub struct TlsUpstream {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    pub reply: Arc<Mutex<Reply>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TlsUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Debug)]
struct Dropped;

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "dropped on purpose")
    }
}

impl std::error::Error for Dropped {}

const COMPLETION: &str = r#"{"id":"c1","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}"#;

impl TlsUpstream {
    /// Serve with `ca`'s server certificate; `h2`: offer HTTP/2 by ALPN beside HTTP/1.1.
    pub async fn start(ca: &TestCa, h2: bool) -> TlsUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(ca.server_config(h2));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let reply = Arc::new(Mutex::new(Reply::default()));
        let (seen2, reply2) = (seen.clone(), reply.clone());
        let conns = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let acceptor = acceptor.clone();
                let (seen, reply) = (seen2.clone(), reply2.clone());
                let connection = conns.fetch_add(1, Ordering::Relaxed) + 1;
                tokio::spawn(async move {
                    // A handshake the client abandons (a wrong CA) is no error of the test's.
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let count = Arc::new(AtomicU64::new(0));
                    let svc = service_fn(move |req: Request<Incoming>| {
                        let (seen, reply, count) = (seen.clone(), reply.clone(), count.clone());
                        async move {
                            let n = count.fetch_add(1, Ordering::Relaxed) + 1;
                            let (parts, body) = req.into_parts();
                            let _ = body.collect().await;
                            seen.lock().unwrap().push(Seen {
                                version: parts.version,
                                path: parts.uri.path().to_string(),
                                headers: parts.headers.clone(),
                                on_connection: n,
                                connection,
                            });
                            let r = reply.lock().unwrap().clone();
                            if r.drop_nth_on_connection == Some(n) {
                                return Err(Dropped);
                            }
                            let mut b = Response::builder()
                                .status(r.status)
                                .header("content-type", "application/json");
                            for (k, v) in &r.headers {
                                b = b.header(k.as_str(), v.as_str());
                            }
                            Ok(b.body(Full::new(Bytes::from_static(COMPLETION.as_bytes())))
                                .unwrap())
                        }
                    });
                    let _ = auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(tls), svc)
                        .await;
                });
            }
        });
        TlsUpstream {
            addr,
            seen,
            reply,
            task,
        }
    }

    /// `https://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}
