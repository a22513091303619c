//! The live page's sessions: a browser cannot send a bearer header when it opens a URL, so
//! the admin token comes once in the query string (`/live?token=...`) and is exchanged for a
//! random session id in an HttpOnly, SameSite=Strict cookie scoped to `/live`. The id
//! authorizes GET `/live`, its assets and its stream, nothing else: the admin API reads the
//! `Authorization` header only, never a cookie.

use ring::rand::{SecureRandom, SystemRandom};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

/// The cookie's name.
pub const COOKIE: &str = "slackgate_live";
/// Sessions alive at once at most; one more is refused (503 `live_sessions_full`) until
/// some expire.
pub const MAX_SESSIONS: usize = 1024;
/// Random bytes in a session id (written as twice as many hex digits).
const ID_BYTES: usize = 32;

/// Why no session was opened.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SessionError {
    /// [`MAX_SESSIONS`] are alive.
    #[error("{MAX_SESSIONS} live-page sessions are open: try again when some have expired")]
    Full,
    /// The system's random generator failed.
    #[error("no random bytes for a session id")]
    NoRandom,
}

/// The open sessions: id to expiry, on tokio's clock (as the gate's own: a test on the
/// paused clock sees a session expire without waiting).
#[derive(Debug)]
pub struct Sessions {
    ttl: Duration,
    open: Mutex<HashMap<String, Instant>>,
    rng: SystemRandom,
}

impl Sessions {
    /// Sessions lasting `ttl`.
    pub fn new(ttl: Duration) -> Sessions {
        Sessions {
            ttl,
            open: Mutex::new(HashMap::new()),
            rng: SystemRandom::new(),
        }
    }

    /// How long a session lasts.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Open a session at `now`: its id. Expired sessions are forgotten first.
    pub fn open(&self, now: Instant) -> Result<String, SessionError> {
        let mut bytes = [0u8; ID_BYTES];
        self.rng
            .fill(&mut bytes)
            .map_err(|_| SessionError::NoRandom)?;
        let id: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let mut open = self.open.lock().map_err(|_| SessionError::Full)?;
        open.retain(|_, expiry| *expiry > now);
        if open.len() >= MAX_SESSIONS {
            return Err(SessionError::Full);
        }
        open.insert(id.clone(), now + self.ttl);
        Ok(id)
    }

    /// Whether `id` names a session alive at `now`.
    pub fn valid(&self, id: &str, now: Instant) -> bool {
        if id.len() != ID_BYTES * 2 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return false;
        }
        self.open
            .lock()
            .map(|open| open.get(id).is_some_and(|expiry| *expiry > now))
            .unwrap_or(false)
    }
}

/// The session id in a request's `Cookie` headers, if one names [`COOKIE`].
pub fn cookie_id(headers: &http::HeaderMap) -> Option<&str> {
    headers
        .get_all(http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value.trim())
}

/// The `Set-Cookie` value for session `id`, lasting `ttl`.
pub fn set_cookie(id: &str, ttl: Duration) -> String {
    format!(
        "{COOKIE}={id}; Path=/live; Max-Age={}; HttpOnly; SameSite=Strict",
        ttl.as_secs()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_is_valid_until_it_expires_and_never_after() {
        let s = Sessions::new(Duration::from_secs(60));
        let t0 = Instant::now();
        let id = s.open(t0).unwrap_or_default();
        assert_eq!(id.len(), 64);
        assert!(s.valid(&id, t0 + Duration::from_secs(59)));
        assert!(!s.valid(&id, t0 + Duration::from_secs(60)), "expired");
        assert!(!s.valid("", t0));
        assert!(!s.valid(&"0".repeat(64), t0), "never opened");
        assert!(!s.valid(&format!("{id}00"), t0), "too long");
        let other = s.open(t0).unwrap_or_default();
        assert_ne!(id, other, "ids are random");
    }

    #[test]
    fn sessions_are_bounded_and_expired_ones_make_room() {
        let s = Sessions::new(Duration::from_secs(60));
        let t0 = Instant::now();
        for _ in 0..MAX_SESSIONS {
            assert!(s.open(t0).is_ok());
        }
        assert_eq!(s.open(t0), Err(SessionError::Full));
        assert!(s.open(t0 + Duration::from_secs(61)).is_ok());
    }

    #[test]
    fn the_cookie_is_found_among_others_and_scoped_to_the_page() {
        let mut h = http::HeaderMap::new();
        h.append(
            http::header::COOKIE,
            http::HeaderValue::from_static("a=1; slackgate_live=abc ; b=2"),
        );
        assert_eq!(cookie_id(&h), Some("abc"));
        assert_eq!(cookie_id(&http::HeaderMap::new()), None);
        let c = set_cookie("abc", Duration::from_secs(900));
        for part in ["Path=/live", "HttpOnly", "SameSite=Strict", "Max-Age=900"] {
            assert!(c.contains(part), "{c}");
        }
    }
}
