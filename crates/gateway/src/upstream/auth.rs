//! Upstream credentials of a pool (`[pools.auth]`): a provider API key read from the
//! environment or a file, and whether the client's own `Authorization` goes through instead.
//!
//! The key is read when the config is loaded or reloaded, so a missing variable or an empty
//! file is refused then, with the field path, and not discovered as a 401 on live traffic.
//! It lives only in a `HeaderValue` marked sensitive (HTTP/2 never indexes it in HPACK, its
//! `Debug` prints `Sensitive`), and no error message, log line or `Debug` output of this
//! module carries it.

use http::header::AUTHORIZATION;
use http::{HeaderMap, HeaderName, HeaderValue};
use slackgate_core::config::AuthConfig;
use std::io::Read;
use std::sync::Arc;

/// How the gate looks up an environment variable: the process environment in the binary, a
/// map in tests (which must not change the environment of a test process).
pub type EnvLookup = Arc<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// The process environment.
pub fn process_env() -> EnvLookup {
    Arc::new(|name| std::env::var(name).ok())
}

/// Largest key file read: API keys are tens to hundreds of bytes.
pub const MAX_KEY_FILE_BYTES: u64 = 64 * 1024;

/// Why a pool's credentials cannot be loaded. The field it names is relative to the pool
/// (`auth.api_key_env`); the caller prefixes `pools[i].`.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The variable is unset, empty or not Unicode.
    #[error("auth.api_key_env: the environment variable {0} is unset or empty")]
    EnvUnset(String),
    /// The key file cannot be read.
    #[error("auth.api_key_file: cannot read {path}: {source}")]
    FileRead {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The key file is empty (after trimming whitespace) or too large.
    #[error("auth.api_key_file: {path} {why}")]
    FileContent {
        /// The file.
        path: String,
        /// What is wrong (never the content).
        why: &'static str,
    },
    /// The key holds bytes an HTTP header cannot carry (a control character, a line break
    /// inside it). The key itself is not quoted.
    #[error("{field}: the key holds characters an HTTP header cannot carry")]
    NotAHeaderValue {
        /// `auth.api_key_env` or `auth.api_key_file`.
        field: &'static str,
    },
    /// `auth.header` is not a header name (the config's validation normally catches it).
    #[error("auth.header: not an HTTP header name")]
    BadHeader,
}

/// A pool's upstream credentials, ready to put on requests.
#[derive(Clone, Default)]
pub struct UpstreamAuth {
    /// The header and its value (`Bearer KEY` for `authorization`), marked sensitive.
    key: Option<(HeaderName, HeaderValue)>,
    /// The client's `Authorization` wins over the pool key.
    pass_client_authorization: bool,
}

impl std::fmt::Debug for UpstreamAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamAuth")
            .field("header", &self.key.as_ref().map(|(h, _)| h.as_str()))
            .field("key", &self.key.as_ref().map(|_| "<redacted>"))
            .field("pass_client_authorization", &self.pass_client_authorization)
            .finish()
    }
}

/// Read a key file: at most [`MAX_KEY_FILE_BYTES`], surrounding whitespace trimmed.
fn read_key_file(path: &str) -> Result<String, AuthError> {
    let read = |source| AuthError::FileRead {
        path: path.to_string(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read)?;
    let mut bytes = Vec::new();
    // One byte past the limit tells a too-large file from one exactly at it.
    file.take(MAX_KEY_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read)?;
    let content = |why| AuthError::FileContent {
        path: path.to_string(),
        why,
    };
    if bytes.len() as u64 > MAX_KEY_FILE_BYTES {
        return Err(content("is larger than 64 KiB: not a key file"));
    }
    let text = String::from_utf8(bytes).map_err(|_| content("is not UTF-8 text"))?;
    let key = text.trim();
    if key.is_empty() {
        return Err(content("is empty"));
    }
    Ok(key.to_string())
}

impl UpstreamAuth {
    /// No pool key: the client's `Authorization` (if any) goes upstream unchanged.
    pub fn none() -> UpstreamAuth {
        UpstreamAuth::default()
    }

    /// Load a pool's credentials, reading the key from `env` or its file now.
    pub fn from_config(cfg: &AuthConfig, env: &EnvLookup) -> Result<UpstreamAuth, AuthError> {
        let (raw, field) = if let Some(var) = &cfg.api_key_env {
            let v = env(var)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
                .ok_or_else(|| AuthError::EnvUnset(var.clone()))?;
            (v, "auth.api_key_env")
        } else if let Some(path) = &cfg.api_key_file {
            (read_key_file(path)?, "auth.api_key_file")
        } else {
            return Ok(UpstreamAuth {
                key: None,
                pass_client_authorization: cfg.pass_client_authorization,
            });
        };
        let header = match cfg.header.as_deref() {
            None => AUTHORIZATION,
            Some(h) => {
                HeaderName::from_bytes(h.trim().as_bytes()).map_err(|_| AuthError::BadHeader)?
            }
        };
        let text = if header == AUTHORIZATION {
            format!("Bearer {raw}")
        } else {
            raw
        };
        let mut value =
            HeaderValue::from_str(&text).map_err(|_| AuthError::NotAHeaderValue { field })?;
        value.set_sensitive(true);
        Ok(UpstreamAuth {
            key: Some((header, value)),
            pass_client_authorization: cfg.pass_client_authorization,
        })
    }

    /// Whether a pool key is configured.
    pub fn has_key(&self) -> bool {
        self.key.is_some()
    }

    /// Put the credentials on an upstream request whose `headers` are otherwise ready, given
    /// the client's own `Authorization` (taken out of `headers` or not: it is removed here and
    /// set again only when it is to go upstream). Side requests (probes, metrics scrapes) pass
    /// `None`.
    ///
    /// Without a pool key the client's header goes through. With one, the pool key is sent
    /// and the client's header dropped (it is the client's credential for the gate, or for
    /// nothing), unless `pass_client_authorization` is set and the client sent one: then the
    /// client's header goes and the pool key does not.
    pub fn apply(&self, headers: &mut HeaderMap, client_authorization: Option<&HeaderValue>) {
        headers.remove(AUTHORIZATION);
        let client = client_authorization.cloned();
        match (&self.key, client) {
            (None, Some(c)) => {
                headers.insert(AUTHORIZATION, c);
            }
            (None, None) => {}
            (Some(_), Some(c)) if self.pass_client_authorization => {
                headers.insert(AUTHORIZATION, c);
            }
            (Some((name, value)), _) => {
                headers.insert(name.clone(), value.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "sk-test-0123456789abcdef";

    fn env_with(pairs: &[(&str, &str)]) -> EnvLookup {
        let map: std::collections::HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Arc::new(move |k| map.get(k).cloned())
    }

    fn cfg(env: Option<&str>, header: Option<&str>, pass: bool) -> AuthConfig {
        AuthConfig {
            api_key_env: env.map(str::to_string),
            api_key_file: None,
            header: header.map(str::to_string),
            pass_client_authorization: pass,
        }
    }

    fn applied(auth: &UpstreamAuth, client: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("x-other", HeaderValue::from_static("kept"));
        let c = client.map(HeaderValue::from_str).and_then(Result::ok);
        if let Some(c) = &c {
            h.insert(AUTHORIZATION, c.clone());
        }
        auth.apply(&mut h, c.as_ref());
        h
    }

    fn get<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
        h.get(name).and_then(|v| v.to_str().ok())
    }

    #[test]
    fn the_pool_key_replaces_the_clients_unless_passing_is_on() -> Result<(), AuthError> {
        let env = env_with(&[("K", KEY)]);
        let auth = UpstreamAuth::from_config(&cfg(Some("K"), None, false), &env)?;
        let bearer = format!("Bearer {KEY}");
        let h = applied(&auth, Some("Bearer client"));
        assert_eq!(get(&h, "authorization"), Some(bearer.as_str()));
        assert_eq!(get(&h, "x-other"), Some("kept"));
        assert!(h
            .get("authorization")
            .is_some_and(HeaderValue::is_sensitive));
        assert_eq!(
            get(&applied(&auth, None), "authorization"),
            Some(bearer.as_str())
        );

        let pass = UpstreamAuth::from_config(&cfg(Some("K"), None, true), &env)?;
        let h = applied(&pass, Some("Bearer client"));
        assert_eq!(get(&h, "authorization"), Some("Bearer client"));
        // Nothing from the client: the pool key still goes.
        assert_eq!(
            get(&applied(&pass, None), "authorization"),
            Some(bearer.as_str())
        );

        // No key: the client's header goes through, or nothing.
        let none = UpstreamAuth::none();
        assert_eq!(
            get(&applied(&none, Some("Bearer c")), "authorization"),
            Some("Bearer c")
        );
        assert_eq!(get(&applied(&none, None), "authorization"), None);
        Ok(())
    }

    #[test]
    fn another_header_carries_the_bare_key() -> Result<(), AuthError> {
        let env = env_with(&[("K", KEY)]);
        let auth = UpstreamAuth::from_config(&cfg(Some("K"), Some("api-key"), false), &env)?;
        let h = applied(&auth, Some("Bearer client"));
        assert_eq!(get(&h, "api-key"), Some(KEY));
        assert_eq!(get(&h, "authorization"), None);
        Ok(())
    }

    #[test]
    fn the_key_never_shows_in_debug_or_errors() -> Result<(), AuthError> {
        let env = env_with(&[("K", KEY), ("BAD", "sk-line\nbreak-secret")]);
        let auth = UpstreamAuth::from_config(&cfg(Some("K"), None, false), &env)?;
        let dbg = format!("{auth:?}");
        assert!(!dbg.contains(KEY) && dbg.contains("redacted"), "{dbg}");
        let h = applied(&auth, None);
        assert!(!format!("{h:?}").contains(KEY));
        let err = UpstreamAuth::from_config(&cfg(Some("BAD"), None, false), &env).err();
        let msg = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(
            msg.contains("auth.api_key_env") && !msg.contains("secret"),
            "{msg}"
        );
        Ok(())
    }

    #[test]
    fn a_missing_or_empty_key_is_refused_with_its_field() {
        let env = env_with(&[("EMPTY", "  \n")]);
        for var in ["UNSET", "EMPTY"] {
            let e = UpstreamAuth::from_config(&cfg(Some(var), None, false), &env).err();
            let msg = e.map(|e| e.to_string()).unwrap_or_default();
            assert!(
                msg.starts_with("auth.api_key_env") && msg.contains(var),
                "{msg}"
            );
        }
    }

    #[test]
    fn hostile_key_files_are_refused_without_quoting_them() {
        let dir = std::env::temp_dir().join(format!("slackgate-auth-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let write = |name: &str, bytes: &[u8]| {
            let p = dir.join(name);
            let _ = std::fs::write(&p, bytes);
            p.display().to_string()
        };
        let huge = vec![b'k'; MAX_KEY_FILE_BYTES as usize + 1];
        let cases = [
            (write("empty", b""), "is empty"),
            (write("blank", b" \n\t\n"), "is empty"),
            (write("binary", b"\xff\xfe\x00secret"), "not UTF-8"),
            (write("ctl", b"sk-\x01secret"), "cannot carry"),
            (write("huge", &huge), "larger than"),
            (dir.join("absent").display().to_string(), "cannot read"),
        ];
        for (path, want) in cases {
            let c = AuthConfig {
                api_key_file: Some(path.clone()),
                ..AuthConfig::default()
            };
            let e = UpstreamAuth::from_config(&c, &process_env()).err();
            let msg = e.map(|e| e.to_string()).unwrap_or_default();
            assert!(msg.contains(want), "{path}: {msg}");
            assert!(msg.starts_with("auth.api_key_file"), "{msg}");
            assert!(!msg.contains("secret") && !msg.contains("kkkk"), "{msg}");
        }
        // A key file with a trailing newline, as `echo KEY > file` writes it.
        let ok = AuthConfig {
            api_key_file: Some(write("ok", format!("  {KEY}\n").as_bytes())),
            ..AuthConfig::default()
        };
        let auth = UpstreamAuth::from_config(&ok, &process_env());
        let h = auth.map(|a| applied(&a, None)).unwrap_or_default();
        assert_eq!(
            get(&h, "authorization"),
            Some(format!("Bearer {KEY}").as_str())
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
