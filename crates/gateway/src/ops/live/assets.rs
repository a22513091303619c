//! The live page's files, compiled into the binary: the page, its script and stylesheet
//! (`assets/`), and uPlot 1.6.32 (`assets/uplot/`, MIT, vendored from the npm registry with
//! its LICENSE). The page's Content-Security-Policy allows this origin's scripts, styles and
//! stream only: nothing inline, nothing from elsewhere, no framing.

use crate::wire::response::{self, ResBody};
use bytes::Bytes;
use http::{HeaderValue, Response};

/// uPlot 1.6.32's script (`dist/uPlot.iife.min.js`), for the page and the drill's HTML report.
pub const UPLOT_JS: &str = include_str!("assets/uplot/uPlot.iife.min.js");
/// uPlot's stylesheet (`dist/uPlot.min.css`).
pub const UPLOT_CSS: &str = include_str!("assets/uplot/uPlot.min.css");
/// uPlot's license (MIT), shipped with every copy.
pub const UPLOT_LICENSE: &str = include_str!("assets/uplot/LICENSE");

/// The page's Content-Security-Policy.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

/// One file of the page.
#[derive(Debug, Clone, Copy)]
pub struct Asset {
    content_type: &'static str,
    body: &'static str,
    /// The HTML page itself (its headers carry the policy).
    page: bool,
}

/// The file at `path`, if the page has one there.
pub fn asset(path: &str) -> Option<Asset> {
    let (content_type, body, page) = match path {
        "/live" => (
            "text/html; charset=utf-8",
            include_str!("assets/index.html"),
            true,
        ),
        "/live/app.js" => (
            "text/javascript; charset=utf-8",
            include_str!("assets/app.js"),
            false,
        ),
        "/live/app.css" => (
            "text/css; charset=utf-8",
            include_str!("assets/app.css"),
            false,
        ),
        "/live/uplot.js" => ("text/javascript; charset=utf-8", UPLOT_JS, false),
        "/live/uplot.css" => ("text/css; charset=utf-8", UPLOT_CSS, false),
        _ => return None,
    };
    Some(Asset {
        content_type,
        body,
        page,
    })
}

/// A 200 with the file, the policy and no caching (a new binary may bring a new page).
pub fn serve(a: Asset) -> Response<ResBody> {
    let mut r = response::bytes(a.content_type, Bytes::from_static(a.body.as_bytes()));
    let h = r.headers_mut();
    h.insert(
        http::header::CACHE_CONTROL,
        HeaderValue::from_static("no-store"),
    );
    h.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    h.insert("referrer-policy", HeaderValue::from_static("no-referrer"));
    if a.page {
        h.insert(
            http::header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(CSP),
        );
        h.insert("x-frame-options", HeaderValue::from_static("DENY"));
    }
    r
}
