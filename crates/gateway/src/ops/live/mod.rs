//! The live page (`/live` on the admin listener): what the gate knows, drawn once a second,
//! for the person on call. One HTML page, its script and stylesheet and the uPlot chart
//! library, all compiled into the binary: no build step, no network.
//!
//! | method | path | what |
//! |---|---|---|
//! | GET | `/live?token=T` | exchange the admin token for a session cookie: 303 to `/live` |
//! | GET | `/live` | the page (session cookie or bearer token) |
//! | GET | `/live/stream` | server-sent events: one `frame` (the `/stats` document, numbered) per `admin.live_frame_ms` |
//! | GET | `/live/app.js`, `/live/app.css`, `/live/uplot.js`, `/live/uplot.css` | the page's assets |
//!
//! The cookie (`slackgate_live`, HttpOnly, SameSite=Strict, `Path=/live`, lasting
//! `admin.live_session_s`) authorizes these GETs only; the admin API never reads cookies.
//! The token is taken from the query string on `/live` alone, and the redirect drops it
//! from the address bar; on the stream it is refused (400 `token_in_query`), so it never
//! sits in a URL a page keeps open. Streams are bounded (`admin.live_max_subscribers`; one
//! more: 503 `live_subscribers_full`).

pub mod assets;
pub mod sampler;
pub mod session;
pub mod stream;

use crate::config::AdminConfig;
use crate::engine::state::Shared;
use crate::observe::codes::LineReason;
use crate::wire::response::{self, ResBody};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use session::Sessions;
use std::sync::Arc;
use std::time::Duration;
use stream::Subscribers;
use tokio::time::Instant;

/// Longest query string the page reads (a token is far shorter).
const MAX_QUERY: usize = 4096;
/// How long one stream lasts before the browser reconnects (the admin listener closes every
/// connection after a minute).
const STREAM_LIFETIME: Duration = Duration::from_secs(50);

/// The page's state on one gate: its sessions and its subscribers.
#[derive(Debug)]
pub struct Live {
    sessions: Sessions,
    subscribers: Arc<Subscribers>,
}

impl Live {
    /// The page as `[admin]` configures it.
    pub fn new(cfg: &AdminConfig) -> Live {
        Live {
            sessions: Sessions::new(Duration::from_secs(cfg.live_session_s)),
            subscribers: Subscribers::new(cfg.live_max_subscribers),
        }
    }

    /// Streams open now.
    pub fn subscribers(&self) -> usize {
        self.subscribers.open()
    }
}

/// Whether an admin path is the live page's.
pub fn is_live_path(path: &str) -> bool {
    path == "/live" || path.starts_with("/live/")
}

/// A refusal, counted like the admin API's.
fn refuse(shared: &Shared, status: StatusCode, code: &'static str, msg: &str) -> Response<ResBody> {
    if status == StatusCode::UNAUTHORIZED {
        shared.metrics.decision(
            "none",
            slackgate_core::Action::Error.into(),
            LineReason::Unauthorized,
        );
    }
    let mut r = response::admin_error(status, code, msg);
    no_store(&mut r);
    r
}

fn no_store(r: &mut Response<ResBody>) {
    let h = r.headers_mut();
    h.insert(
        http::header::CACHE_CONTROL,
        HeaderValue::from_static("no-store"),
    );
    h.insert("referrer-policy", HeaderValue::from_static("no-referrer"));
    h.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
}

/// Answer a request to the live page's paths.
pub fn route<B>(live: &Live, shared: &Shared, req: &Request<B>) -> Response<ResBody> {
    let path = req.uri().path();
    let query = req.uri().query().unwrap_or("");
    if req.method() != Method::GET {
        let mut r = refuse(
            shared,
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            &format!("the live page takes GET only, not {}", req.method()),
        );
        r.headers_mut()
            .insert(http::header::ALLOW, HeaderValue::from_static("GET"));
        return r;
    }
    if query.len() > MAX_QUERY {
        return refuse(
            shared,
            StatusCode::URI_TOO_LONG,
            "query_too_long",
            &format!("the live page reads queries of at most {MAX_QUERY} bytes"),
        );
    }
    if path == "/live" && !query.is_empty() {
        return exchange(live, shared, query);
    }
    if !query.is_empty() {
        return in_query(shared, path, query);
    }
    if let Some(why) = unauthorized(live, shared, req.headers()) {
        return refuse(shared, StatusCode::UNAUTHORIZED, "unauthorized", why);
    }
    match path {
        "/live/stream" => stream(live, shared, req.headers()),
        _ => match assets::asset(path) {
            Some(a) => assets::serve(a),
            None => refuse(
                shared,
                StatusCode::NOT_FOUND,
                "not_found",
                "no such live page path (/live, /live/stream and its assets)",
            ),
        },
    }
}

/// A query on a path other than `/live`: a token there is refused on its own terms.
fn in_query(shared: &Shared, path: &str, query: &str) -> Response<ResBody> {
    if query_param(query, "token").is_some() {
        return refuse(
            shared,
            StatusCode::BAD_REQUEST,
            "token_in_query",
            &format!(
                "{path} never takes the token in its URL: open /live?token=... once, the \
                 page then uses its cookie"
            ),
        );
    }
    refuse(
        shared,
        StatusCode::BAD_REQUEST,
        "invalid_query",
        "the live page's paths take no query (but /live?token=...)",
    )
}

/// `/live?token=T`: a session cookie and a redirect to `/live`, or 401.
fn exchange(live: &Live, shared: &Shared, query: &str) -> Response<ResBody> {
    let Some(raw) = query_param(query, "token") else {
        return in_query(shared, "/live", query);
    };
    if !shared.control.has_token() {
        return refuse(
            shared,
            StatusCode::UNAUTHORIZED,
            "admin_token_unset",
            "no admin token is configured (admin.token_file or SLACKGATE_ADMIN_TOKEN): the live page is closed",
        );
    }
    let token = percent_decode(raw);
    if !token
        .as_deref()
        .is_some_and(|t| shared.control.token_matches(t.trim()))
    {
        return refuse(
            shared,
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "wrong admin token",
        );
    }
    let id = match live.sessions.open(Instant::now()) {
        Ok(id) => id,
        Err(e) => {
            return refuse(
                shared,
                StatusCode::SERVICE_UNAVAILABLE,
                "live_sessions_full",
                &e.to_string(),
            )
        }
    };
    let mut r = Response::new(response::full(bytes::Bytes::new()));
    *r.status_mut() = StatusCode::SEE_OTHER;
    no_store(&mut r);
    let h = r.headers_mut();
    h.insert(http::header::LOCATION, HeaderValue::from_static("/live"));
    if let Ok(v) = HeaderValue::from_str(&session::set_cookie(&id, live.sessions.ttl())) {
        h.insert(http::header::SET_COOKIE, v);
    }
    r
}

/// A live session's cookie, or the admin bearer token; `Some` says why neither is there.
fn unauthorized(live: &Live, shared: &Shared, headers: &http::HeaderMap) -> Option<&'static str> {
    if session::cookie_id(headers).is_some_and(|id| live.sessions.valid(id, Instant::now())) {
        return None;
    }
    let bearer = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    if bearer.is_some_and(|t| shared.control.token_matches(t)) {
        return None;
    }
    Some(if session::cookie_id(headers).is_some() {
        "the live page's session has expired or is unknown: open /live?token=<admin token> again"
    } else {
        "open /live?token=<admin token> once; the page then keeps a session cookie"
    })
}

/// `/live/stream`: the events, while there is room for one more subscriber.
fn stream(live: &Live, shared: &Shared, headers: &http::HeaderMap) -> Response<ResBody> {
    let Some(slot) = live.subscribers.take() else {
        return refuse(
            shared,
            StatusCode::SERVICE_UNAVAILABLE,
            "live_subscribers_full",
            &format!(
                "{} live streams are open (admin.live_max_subscribers): close one, or raise the limit",
                live.subscribers.max()
            ),
        );
    };
    let seen = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(0);
    let mut r = Response::new(stream::events(&shared.frames, seen, slot, STREAM_LIFETIME));
    no_store(&mut r);
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    r
}

/// The raw value of `name` in a query string (`a=1&name=value`).
fn query_param<'q>(query: &'q str, name: &str) -> Option<&'q str> {
    query
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// `%XX` escapes and `+` decoded; `None` when an escape is broken or the result is not
/// UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let mut out = Vec::with_capacity(s.len());
    let mut bytes = s.bytes();
    while let Some(b) = bytes.next() {
        match b {
            b'%' => {
                let hi = (bytes.next()? as char).to_digit(16)?;
                let lo = (bytes.next()? as char).to_digit(16)?;
                out.push(u8::try_from(hi * 16 + lo).ok()?);
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_are_read_and_escapes_decoded_or_refused() {
        assert_eq!(query_param("a=1&token=x%2By", "token"), Some("x%2By"));
        assert_eq!(query_param("tokens=1", "token"), None);
        assert_eq!(percent_decode("x%2By%20z").as_deref(), Some("x+y z"));
        assert_eq!(percent_decode("a+b").as_deref(), Some("a b"));
        assert_eq!(percent_decode("%"), None);
        assert_eq!(percent_decode("%4"), None);
        assert_eq!(percent_decode("%zz"), None);
        assert_eq!(percent_decode("%ff"), None, "not UTF-8");
    }

    #[test]
    fn only_the_page_paths_are_the_pages() {
        assert!(is_live_path("/live"));
        assert!(is_live_path("/live/stream"));
        assert!(!is_live_path("/lively"));
        assert!(!is_live_path("/admin/flags"));
    }
}
