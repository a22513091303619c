//! TLS client settings of a pool (`[pools.tls]`): which root certificates an `https://`
//! upstream's certificate must chain to, and the ALPN offer.
//!
//! The roots are the system's (`system_roots`, read once per process: the store does not change
//! under a running gate and reading it costs milliseconds) plus the PEM certificates of
//! `ca_file`, read at start and at every reload so that a rotated private CA is picked up by a
//! reload. Every failure to read them is an error at load, with the field path, rather than a
//! handshake failure on the first request.

use rustls::RootCertStore;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;
use slackgate_core::config::TlsConfig;
use std::sync::{Arc, OnceLock};

/// Largest CA file read: a bundle of every public root is about 250 KiB.
pub const MAX_CA_FILE_BYTES: u64 = 4 * 1024 * 1024;

/// The ALPN protocols offered, in order of preference: HTTP/2 where the server speaks it
/// (hosted APIs multiplex many requests on one connection), HTTP/1.1 otherwise.
const ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

/// Why a pool's TLS settings cannot be used. The messages name files, never their contents.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// `ca_file` could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// `ca_file` is larger than [`MAX_CA_FILE_BYTES`].
    #[error("{path} is larger than {MAX_CA_FILE_BYTES} bytes: not a CA file")]
    TooLarge {
        /// The file.
        path: String,
    },
    /// `ca_file` holds no PEM `CERTIFICATE` block, or a malformed one.
    #[error("{path} holds no usable PEM certificate: {why}")]
    NoCertificate {
        /// The file.
        path: String,
        /// What was wrong.
        why: String,
    },
    /// A pool with an `https://` upstream would trust nothing.
    #[error("no root certificate to trust: system_roots is off (or the system has none) and no ca_file is set")]
    NoRoots,
    /// rustls refused the settings.
    #[error("TLS settings refused: {0}")]
    Rustls(#[from] rustls::Error),
}

/// What a pool's TLS client was built from; two pools (or a pool before and after a reload)
/// with equal keys can share one client and its open connections.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TlsKey {
    system_roots: bool,
    /// The CA file's bytes as read (not its path: a rotated file under the same name must give
    /// a new client).
    ca_pem: Option<Vec<u8>>,
}

/// A pool's TLS client configuration, ready for the connector.
#[derive(Clone, Debug)]
pub(crate) struct TlsSettings {
    pub(crate) key: TlsKey,
    pub(crate) config: Arc<rustls::ClientConfig>,
}

/// The system's root certificates, loaded once. Certificates the platform store holds but
/// rustls cannot parse are skipped, as every rustls client does.
fn system_roots() -> &'static [CertificateDer<'static>] {
    static ROOTS: OnceLock<Vec<CertificateDer<'static>>> = OnceLock::new();
    ROOTS.get_or_init(|| rustls_native_certs::load_native_certs().certs)
}

/// Read and parse `path` as a PEM bundle of certificates: at least one, all well-formed.
fn read_ca_file(path: &str) -> Result<Vec<u8>, TlsError> {
    let read = |source| TlsError::Read {
        path: path.to_string(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(read)?;
    if meta.len() > MAX_CA_FILE_BYTES {
        return Err(TlsError::TooLarge { path: path.into() });
    }
    std::fs::read(path).map_err(read)
}

/// The certificates of a PEM bundle (other PEM blocks, such as a key, are ignored).
fn parse_ca_pem(path: &str, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bad = |why: String| TlsError::NoCertificate {
        path: path.to_string(),
        why,
    };
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(format!("malformed PEM ({e})")))?;
    if certs.is_empty() {
        return Err(bad("no -----BEGIN CERTIFICATE----- block".into()));
    }
    Ok(certs)
}

impl TlsSettings {
    /// Build the settings of `cfg`. `needed`: the pool has an `https://` upstream, so trusting
    /// no root at all is an error rather than a pool whose every request would fail.
    pub(crate) fn build(cfg: &TlsConfig, needed: bool) -> Result<TlsSettings, TlsError> {
        let ca_pem = match &cfg.ca_file {
            Some(path) => Some(read_ca_file(path)?),
            None => None,
        };
        let key = TlsKey {
            system_roots: cfg.system_roots,
            ca_pem,
        };
        TlsSettings::from_key(key, cfg.ca_file.as_deref().unwrap_or(""), needed)
    }

    fn from_key(key: TlsKey, ca_path: &str, needed: bool) -> Result<TlsSettings, TlsError> {
        let mut roots = RootCertStore::empty();
        if key.system_roots {
            roots.add_parsable_certificates(system_roots().iter().cloned());
        }
        if let Some(pem) = &key.ca_pem {
            for (i, cert) in parse_ca_pem(ca_path, pem)?.into_iter().enumerate() {
                roots.add(cert).map_err(|e| TlsError::NoCertificate {
                    path: ca_path.to_string(),
                    why: format!("certificate {} is not usable: {e}", i + 1),
                })?;
            }
        }
        if needed && roots.is_empty() {
            return Err(TlsError::NoRoots);
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = ALPN.iter().map(|p| p.to_vec()).collect();
        Ok(TlsSettings {
            key,
            config: Arc::new(config),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(pem: &[u8]) -> TlsKey {
        TlsKey {
            system_roots: false,
            ca_pem: Some(pem.to_vec()),
        }
    }

    fn refused(pem: &[u8]) -> String {
        match TlsSettings::from_key(key(pem), "ca.pem", true) {
            Ok(_) => "accepted".into(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn hostile_ca_files_are_refused_with_the_file_named() {
        let cases: [&[u8]; 7] = [
            b"",
            b"garbage \xff\xfe not pem at all",
            b"-----BEGIN CERTIFICATE-----\nnot base64 !!!\n-----END CERTIFICATE-----\n",
            // Truncated: a BEGIN without its END.
            b"-----BEGIN CERTIFICATE-----\nMIIB\n",
            // Valid base64, but not a certificate.
            b"-----BEGIN CERTIFICATE-----\naGVsbG8gd29ybGQ=\n-----END CERTIFICATE-----\n",
            // Only a key: nothing to trust.
            b"-----BEGIN PRIVATE KEY-----\naGVsbG8=\n-----END PRIVATE KEY-----\n",
            "-----BEGIN CERTIFICATE-----\n\u{00e9}\u{1F600}\n-----END CERTIFICATE-----\n"
                .as_bytes(),
        ];
        for pem in cases {
            let msg = refused(pem);
            assert!(msg.contains("ca.pem"), "{pem:?}: {msg}");
        }
    }

    #[test]
    fn an_oversized_or_missing_ca_file_is_refused_before_parsing() {
        let dir = std::env::temp_dir().join(format!("slackgate-tls-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let big = dir.join("big.pem");
        let file = std::fs::File::create(&big).map_err(|e| e.to_string());
        assert!(file
            .and_then(|f| f.set_len(MAX_CA_FILE_BYTES + 1).map_err(|e| e.to_string()))
            .is_ok());
        let cfg = |p: &std::path::Path| TlsConfig {
            ca_file: Some(p.display().to_string()),
            system_roots: false,
        };
        let big_err = TlsSettings::build(&cfg(&big), true).err();
        assert!(
            matches!(big_err, Some(TlsError::TooLarge { .. })),
            "{big_err:?}"
        );
        let missing = TlsSettings::build(&cfg(&dir.join("absent.pem")), true).err();
        assert!(
            matches!(missing, Some(TlsError::Read { .. })),
            "{missing:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn trusting_nothing_is_an_error_only_where_tls_is_needed() {
        let none = TlsKey {
            system_roots: false,
            ca_pem: None,
        };
        assert!(matches!(
            TlsSettings::from_key(none.clone(), "", true),
            Err(TlsError::NoRoots)
        ));
        assert!(TlsSettings::from_key(none, "", false).is_ok());
    }

    #[test]
    fn alpn_offers_h2_then_http1() {
        let none = TlsKey {
            system_roots: false,
            ca_pem: None,
        };
        let s = TlsSettings::from_key(none, "", false).map(|s| s.config.alpn_protocols.clone());
        assert_eq!(s.ok(), Some(vec![b"h2".to_vec(), b"http/1.1".to_vec()]));
    }
}
