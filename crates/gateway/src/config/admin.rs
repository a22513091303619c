//! `[admin]`: the admin API's listener, token and connection caps, and their checks.

use super::err;
use serde::Deserialize;
use slackgate_core::ConfigError;
use std::net::SocketAddr;
use std::path::PathBuf;

/// Default address of the admin API: loopback only.
pub const DEFAULT_ADMIN_LISTEN: ([u8; 4], u16) = ([127, 0, 0, 1], 9090);

/// The admin API (`[admin]`): flags, drains, reload, queue and estimator views, on a listener
/// of its own, behind a bearer token.
#[derive(Clone, Debug, PartialEq)]
pub struct AdminConfig {
    /// Where the admin API listens; `None` (no `[admin]` section): no admin listener.
    pub listen: Option<SocketAddr>,
    /// File holding the bearer token (whitespace trimmed); read at start and at each reload.
    /// Without it the token comes from `SLACKGATE_ADMIN_TOKEN`; without either, every admin
    /// call is refused (401).
    pub token_file: Option<PathBuf>,
    /// Allow a non-loopback `listen` address (the admin API can roll back or drain the gate).
    pub allow_remote: bool,
    /// With `allow_remote`, accept a plain-HTTP listener beyond loopback anyway (the gate
    /// has no TLS of its own: a bearer token over plain HTTP on a network is readable by
    /// anyone on the path). Only behind a TLS-terminating proxy or on a trusted network.
    pub insecure_remote: bool,
    /// Open admin connections at most, all addresses together.
    pub max_connections: usize,
    /// Open admin connections at most from one client address.
    pub max_connections_per_addr: usize,
    /// The live page (`/live`): streams open at once at most; one more is refused (503
    /// `live_subscribers_full`).
    pub live_max_subscribers: usize,
    /// The live page: how long the cookie its token is exchanged for lasts, seconds.
    pub live_session_s: u64,
    /// The live page: one frame of the gate's state every this many milliseconds.
    pub live_frame_ms: u64,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: None,
            token_file: None,
            allow_remote: false,
            insecure_remote: false,
            max_connections: DEFAULT_ADMIN_MAX_CONNECTIONS,
            max_connections_per_addr: DEFAULT_ADMIN_MAX_CONNECTIONS_PER_ADDR,
            live_max_subscribers: DEFAULT_LIVE_MAX_SUBSCRIBERS,
            live_session_s: DEFAULT_LIVE_SESSION_S,
            live_frame_ms: DEFAULT_LIVE_FRAME_MS,
        }
    }
}

/// Default of `admin.live_max_subscribers`.
pub const DEFAULT_LIVE_MAX_SUBSCRIBERS: usize = 32;
/// Default of `admin.live_session_s`: a quarter of an hour.
pub const DEFAULT_LIVE_SESSION_S: u64 = 900;
/// Default of `admin.live_frame_ms`: one frame a second.
pub const DEFAULT_LIVE_FRAME_MS: u64 = 1000;

/// Default of `admin.max_connections`.
pub const DEFAULT_ADMIN_MAX_CONNECTIONS: usize = 64;
/// Default of `admin.max_connections_per_addr`.
pub const DEFAULT_ADMIN_MAX_CONNECTIONS_PER_ADDR: usize = 16;

/// `[admin]` as the file spells it: a section present turns the admin API on.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub(super) struct AdminFile {
    listen: Option<SocketAddr>,
    token_file: Option<PathBuf>,
    allow_remote: bool,
    insecure_remote: bool,
    max_connections: Option<usize>,
    max_connections_per_addr: Option<usize>,
    live_max_subscribers: Option<usize>,
    live_session_s: Option<u64>,
    live_frame_ms: Option<u64>,
}

impl AdminConfig {
    /// The admin API as `[admin]` sets it: no section, no listener; a section, a listener on
    /// loopback unless it says otherwise.
    pub(super) fn from_section(section: Option<AdminFile>) -> AdminConfig {
        let Some(a) = section else {
            return AdminConfig::default();
        };
        AdminConfig {
            listen: Some(
                a.listen
                    .unwrap_or_else(|| SocketAddr::from(DEFAULT_ADMIN_LISTEN)),
            ),
            token_file: a.token_file,
            allow_remote: a.allow_remote,
            insecure_remote: a.insecure_remote,
            max_connections: a.max_connections.unwrap_or(DEFAULT_ADMIN_MAX_CONNECTIONS),
            max_connections_per_addr: a
                .max_connections_per_addr
                .unwrap_or(DEFAULT_ADMIN_MAX_CONNECTIONS_PER_ADDR),
            live_max_subscribers: a
                .live_max_subscribers
                .unwrap_or(DEFAULT_LIVE_MAX_SUBSCRIBERS),
            live_session_s: a.live_session_s.unwrap_or(DEFAULT_LIVE_SESSION_S),
            live_frame_ms: a.live_frame_ms.unwrap_or(DEFAULT_LIVE_FRAME_MS),
        }
    }

    /// A listener's connection caps, and its address: loopback, or beyond it only when
    /// `allow_remote` (and `insecure_remote`, as the listener speaks plain HTTP) say so.
    pub(super) fn check(&self) -> Result<(), ConfigError> {
        let Some(a) = self.listen else {
            return Ok(());
        };
        if self.max_connections == 0 {
            return Err(err("admin.max_connections", "must be at least 1"));
        }
        if self.max_connections_per_addr == 0 {
            return Err(err("admin.max_connections_per_addr", "must be at least 1"));
        }
        if self.live_max_subscribers == 0 {
            return Err(err("admin.live_max_subscribers", "must be at least 1"));
        }
        if !(60..=86_400).contains(&self.live_session_s) {
            return Err(err(
                "admin.live_session_s",
                "must be between 60 and 86400 (a day)",
            ));
        }
        if !(100..=10_000).contains(&self.live_frame_ms) {
            return Err(err("admin.live_frame_ms", "must be between 100 and 10000"));
        }
        if !a.ip().is_loopback() && self.allow_remote && !self.insecure_remote {
            return Err(err(
                "admin.listen",
                &format!(
                    "{a} is not a loopback address and the admin listener speaks plain HTTP: \
                     its bearer token would cross the network in the clear. Put it behind a \
                     TLS-terminating proxy on loopback, or set admin.insecure_remote = true \
                     to accept the risk"
                ),
            ));
        }
        if !a.ip().is_loopback() && !self.allow_remote {
            return Err(err(
                "admin.listen",
                &format!(
                    "{a} is not a loopback address; the admin API can roll back and drain \
                     the gate, so set admin.allow_remote = true to expose it beyond this host"
                ),
            ));
        }
        Ok(())
    }
}
