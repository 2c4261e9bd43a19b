//! The web dashboard: seven files (and the answer links' page, two more) embedded in the binary and served at `/`
//! (nothing is fetched from elsewhere, so it works offline). The page holds
//! no data and needs no token; it asks the API for everything with the
//! token the operator gives it (`/#token=…`, kept in the tab's
//! sessionStorage), through documented endpoints only.
//!
//! Served with a strict Content-Security-Policy (its own scripts and
//! styles only, no inline code, no framing): run inputs and outputs are
//! hostile text, and the page must not run them or be framed by a page
//! that clicks its cancel buttons.

use axum::Router;
use axum::http::{HeaderName, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

const INDEX: &str = include_str!("dashboard/index.html");
const APP_JS: &str = include_str!("dashboard/app.js");
const QUEUES_JS: &str = include_str!("dashboard/queues.js");
const CHARTS_JS: &str = include_str!("dashboard/charts.js");
const SCHEDULES_JS: &str = include_str!("dashboard/schedules.js");
const TREE_JS: &str = include_str!("dashboard/tree.js");
const TIMELINE_JS: &str = include_str!("dashboard/timeline.js");
const ANSWER_HTML: &str = include_str!("dashboard/answer.html");
const ANSWER_JS: &str = include_str!("dashboard/answer.js");
const STYLE_CSS: &str = include_str!("dashboard/style.css");

const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                   img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

pub(super) fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/", get(|| async { asset("text/html; charset=utf-8", INDEX) }))
        .route("/ui/app.js", get(|| async { asset("text/javascript; charset=utf-8", APP_JS) }))
        .route("/ui/queues.js", get(|| async { asset("text/javascript; charset=utf-8", QUEUES_JS) }))
        .route("/ui/charts.js", get(|| async { asset("text/javascript; charset=utf-8", CHARTS_JS) }))
        .route("/ui/schedules.js", get(|| async { asset("text/javascript; charset=utf-8", SCHEDULES_JS) }))
        .route("/ui/tree.js", get(|| async { asset("text/javascript; charset=utf-8", TREE_JS) }))
        .route("/ui/timeline.js", get(|| async { asset("text/javascript; charset=utf-8", TIMELINE_JS) }))
        .route("/ui/answer.js", get(|| async { asset("text/javascript; charset=utf-8", ANSWER_JS) }))
        .route("/ui/style.css", get(|| async { asset("text/css; charset=utf-8", STYLE_CSS) }))
}

/// The page an answer link opens (`GET /v1/answers/{token}`): a form that
/// POSTs the answer. The same for every token, so opening it tells
/// nothing and uses nothing.
/// The answer page, with the wait's `prompt` (HTML-escaped) where it
/// says so.
/// The prompt is the plugin's text, not this service's, and the page says
/// so. Never cached: it shows a wait that ends.
pub(super) fn answer_page(prompt: Option<(&str, &str)>) -> Response {
    let shown = match prompt {
        Some((plugin, p)) => format!(
            "<p class=\"muted\">The plugin <code>{}</code> asks (its text, not this service's):</p>\
             <blockquote id=\"answer-prompt\" class=\"prompt\" data-source=\"plugin\">{}</blockquote>",
            escape_html(plugin),
            escape_html(p)
        ),
        None => String::new(),
    };
    let mut page = asset("text/html; charset=utf-8", ANSWER_HTML.replace("<!-- prompt -->", &shown));
    page.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    page
}

fn escape_html(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn asset(content_type: &'static str, body: impl Into<axum::body::Body>) -> Response {
    let headers: [(HeaderName, HeaderValue); 6] = [
        (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
        (header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP)),
        (header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY")),
        (header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff")),
        (header::REFERRER_POLICY, HeaderValue::from_static("no-referrer")),
        // A new binary serves new files: never a stale page against a newer API.
        (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
    ];
    let body: axum::body::Body = body.into();
    (headers, body).into_response()
}
