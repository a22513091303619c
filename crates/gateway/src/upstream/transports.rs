//! What each pool sends its requests with: an HTTP client built for the pool's TLS settings,
//! and the pool's credentials.
//!
//! Built at start and again on every reload, before the reload touches the core: a CA file
//! that cannot be read or an API key variable that is unset refuses the reload (or the start),
//! with the field path, and the previous transports stay in force. Pools whose TLS settings
//! are equal share one client, and a reload that leaves a pool's TLS settings (and its CA
//! file's content) unchanged keeps that client, so open keep-alive and HTTP/2 connections
//! survive it.

use super::auth::{EnvLookup, UpstreamAuth};
use super::tls::{TlsError, TlsKey, TlsSettings};
use super::UpstreamClient;
use slackgate_core::config::PoolConfig;
use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// One pool's client and credentials.
#[derive(Debug)]
pub struct Transport {
    /// The client for the pool's upstreams (plain and TLS).
    pub client: UpstreamClient,
    /// The pool's credentials: call [`UpstreamAuth::apply`] on every request to the pool's
    /// upstreams, side requests (probes, metrics scrapes) included.
    pub auth: UpstreamAuth,
    tls: Option<TlsKey>,
}

type Map = HashMap<String, Arc<Transport>>;

/// The transports of every pool, by pool name.
pub struct Transports {
    by_pool: RwLock<Arc<Map>>,
    /// For a name no config ever had: plain HTTP, no credentials.
    fallback: Arc<Transport>,
    idle_timeout: Duration,
    env: EnvLookup,
}

impl std::fmt::Debug for Transports {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transports")
            .field("pools", &self.snapshot().keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// Transports built for a new config, not yet in force ([`Transports::install`]).
#[derive(Debug)]
pub struct Prepared(Map);

/// The field a TLS error is about, under `pools[i].`.
fn tls_field(e: &TlsError) -> &'static str {
    match e {
        TlsError::Read { .. } | TlsError::TooLarge { .. } | TlsError::NoCertificate { .. } => {
            "tls.ca_file"
        }
        TlsError::NoRoots => "tls.system_roots",
        TlsError::Rustls(_) => "tls",
    }
}

/// Whether any of the pool's upstreams is `https://`.
fn needs_tls(pool: &PoolConfig) -> bool {
    pool.endpoint_list()
        .iter()
        .any(|e| super::parse_base(&e.url).is_ok_and(|b| b.is_https()))
}

/// Why a pool's transport could not be built; the message names the field
/// (`pools[1].auth.api_key_env: ...`).
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The plain HTTP client could not be built.
    #[error("{0}")]
    Client(TlsError),
    /// A pool's `[pools.tls]` is unusable.
    #[error("pools[{pool}].{field}: {source}")]
    Tls {
        /// The pool's index in the config.
        pool: usize,
        /// The field at fault.
        field: &'static str,
        /// What is wrong.
        source: TlsError,
    },
    /// A pool's `[pools.auth]` is unusable.
    #[error("pools[{pool}].{source}")]
    Auth {
        /// The pool's index in the config.
        pool: usize,
        /// What is wrong (its message starts with the field).
        source: super::auth::AuthError,
    },
}

impl Transports {
    /// Build the transports of `pools` (reading CA files and API keys now). `idle_timeout`:
    /// `server.upstream_idle_timeout_ms`; `env` looks up `auth.api_key_env` now and on reloads.
    pub fn build(
        pools: &[PoolConfig],
        idle_timeout: Duration,
        env: EnvLookup,
    ) -> Result<Transports, TransportError> {
        let plain = UpstreamClient::new(idle_timeout).map_err(TransportError::Client)?;
        let t = Transports {
            by_pool: RwLock::new(Arc::new(Map::new())),
            fallback: Arc::new(Transport {
                client: plain,
                auth: UpstreamAuth::none(),
                tls: None,
            }),
            idle_timeout,
            env,
        };
        let first = t.prepare(pools)?;
        t.install(first);
        Ok(t)
    }

    /// Build the transports of a new config without putting them in force; an error names
    /// the field (`pools[1].auth.api_key_env: ...`).
    pub fn prepare(&self, pools: &[PoolConfig]) -> Result<Prepared, TransportError> {
        let current = self.snapshot();
        let mut clients: Vec<(TlsKey, UpstreamClient)> = current
            .values()
            .filter_map(|t| t.tls.clone().map(|k| (k, t.client.clone())))
            .collect();
        let mut next = Map::new();
        for (i, pool) in pools.iter().enumerate() {
            let tls = TlsSettings::build(&pool.tls, needs_tls(pool)).map_err(|e| {
                TransportError::Tls {
                    pool: i,
                    field: tls_field(&e),
                    source: e,
                }
            })?;
            let auth = UpstreamAuth::from_config(&pool.auth, &self.env)
                .map_err(|e| TransportError::Auth { pool: i, source: e })?;
            let client = match clients.iter().find(|(k, _)| *k == tls.key) {
                Some((_, c)) => c.clone(),
                None => {
                    let c = UpstreamClient::with_tls(self.idle_timeout, tls.config.clone());
                    clients.push((tls.key.clone(), c.clone()));
                    c
                }
            };
            next.insert(
                pool.name.clone(),
                Arc::new(Transport {
                    client,
                    auth,
                    tls: Some(tls.key),
                }),
            );
        }
        Ok(Prepared(next))
    }

    /// Put prepared transports in force. Pools the new config no longer has keep theirs:
    /// requests of a retired pool may still be running or queued.
    pub fn install(&self, next: Prepared) {
        let mut map = next.0;
        for (name, t) in self.snapshot().iter() {
            map.entry(name.clone()).or_insert_with(|| Arc::clone(t));
        }
        *self.by_pool.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(map);
    }

    /// The transport of the pool named `pool` (a plain client without credentials for a
    /// name no config had).
    pub fn for_pool(&self, pool: &str) -> Arc<Transport> {
        self.snapshot()
            .get(pool)
            .cloned()
            .unwrap_or_else(|| Arc::clone(&self.fallback))
    }

    fn snapshot(&self) -> Arc<Map> {
        Arc::clone(&self.by_pool.read().unwrap_or_else(|p| p.into_inner()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn pool(name: &str, url: &str) -> PoolConfig {
        PoolConfig {
            name: name.into(),
            upstream: Some(url.into()),
            ..PoolConfig::default()
        }
    }

    fn env(pairs: &[(&str, &str)]) -> EnvLookup {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Arc::new(move |k| m.get(k).cloned())
    }

    #[test]
    fn errors_name_the_pool_and_field() {
        let mut a = pool("a", "http://127.0.0.1:1");
        let mut b = pool("b", "https://127.0.0.1:2");
        b.auth.api_key_env = Some("SLACKGATE_TEST_UNSET_KEY".into());
        let e = Transports::build(&[a.clone(), b.clone()], Duration::ZERO, env(&[])).err();
        let msg = e.map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.starts_with("pools[1].auth.api_key_env"), "{msg}");

        b.auth.api_key_env = None;
        b.tls.ca_file = Some("/nonexistent/slackgate/ca.pem".into());
        let e = Transports::build(&[a.clone(), b.clone()], Duration::ZERO, env(&[])).err();
        let msg = e.map(|e| e.to_string()).unwrap_or_default();
        assert!(
            msg.starts_with("pools[1].tls.ca_file: cannot read"),
            "{msg}"
        );

        // An https pool that trusts nothing; the same settings on a plain pool are fine.
        b.tls.ca_file = None;
        b.tls.system_roots = false;
        let e = Transports::build(&[b.clone()], Duration::ZERO, env(&[])).err();
        assert!(e.is_some_and(|m| m.to_string().starts_with("pools[0].tls.system_roots")));
        a.tls.system_roots = false;
        assert!(Transports::build(&[a], Duration::ZERO, env(&[])).is_ok());
    }

    #[test]
    fn a_reload_keeps_unchanged_clients_and_retired_pools() -> Result<(), TransportError> {
        let mut a = pool("a", "http://127.0.0.1:1");
        a.auth.api_key_env = Some("K".into());
        let b = pool("b", "http://127.0.0.1:2");
        let t = Transports::build(&[a.clone(), b], Duration::ZERO, env(&[("K", "one")]))?;
        assert!(t.for_pool("a").auth.has_key());
        assert!(!t.for_pool("b").auth.has_key());
        assert!(!t.for_pool("nobody").auth.has_key());
        let before = t.for_pool("a");
        // Reload without pool b and with a's credentials gone.
        a.auth.api_key_env = None;
        let next = t.prepare(&[a])?;
        t.install(next);
        let after = t.for_pool("a");
        assert!(!after.auth.has_key());
        assert_eq!(before.tls, after.tls, "same TLS settings: same client");
        // The retired pool keeps its transport.
        assert!(t.snapshot().contains_key("b"));
        Ok(())
    }
}
