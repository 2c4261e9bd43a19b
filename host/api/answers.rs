//! `POST /v1/answers/{token}`: input for a run's named wait through a
//! one-use answer link (docs/concepts.md, "Named waits"), for a link in an
//! email or another system's webhook. It needs no API token: the link's
//! own token (256 bits, derived from the run's secret, only its SHA-256
//! stored) is the credential, good for one delivery and only while the
//! wait it answers is open. Every refusal of a well-formed link is the same
//! 410, so an answer tells a caller nothing about links it does not hold.

use axum::Json;
use axum::extract::State;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::{ApiError, AppState, ErrorBody, JsonBody, Params};
use crate::runtime::waits::token_hash;

/// `GET /v1/answers/{token}`: the link's page, with the wait's prompt and
/// a form that POSTs the answer (opening a link, as a mail scanner does,
/// uses nothing).
#[utoipa::path(get, path = "/v1/answers/{token}", tag = "runs", security(()),
    params(("token" = String, Path, description = "The link's token.")),
    responses(
        (status = 200, description = "A page with the wait's prompt (while the run waits on it) and a form that sends the answer.", content_type = "text/html", body = String),
        (status = 429, description = "Past this host's answer-link requests a second; try again after `Retry-After`.", body = ErrorBody),
    ))]
pub async fn page(State(s): State<AppState>, Params(token): Params<String>) -> axum::response::Response {
    let prompt = if well_formed(&token) {
        s.store.answer_prompt(&token_hash(&token)).await.unwrap_or_else(|e| {
            tracing::warn!(error = %e, "reading an answer link's prompt failed; the page shows none");
            None
        })
    } else {
        None
    };
    super::dashboard::answer_page(prompt.as_ref().map(|(plugin, p)| (plugin.as_str(), p.as_str())))
}

/// A token's form: 64 lowercase hex digits.
fn well_formed(token: &str) -> bool {
    token.len() == 64 && token.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// What an answer link delivers.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Answer {
    /// A string is delivered as it is; any other JSON as its text.
    input: Value,
}

/// A delivered answer.
#[derive(Serialize, ToSchema)]
pub struct Answered {
    delivered: bool,
    /// The wait it went to.
    name: String,
}

/// `POST /v1/answers/{token}` with `{"input"}`.
#[utoipa::path(post, path = "/v1/answers/{token}", tag = "runs", security(()), request_body = Answer,
    params(("token" = String, Path, pattern = "^[0-9a-f]{64}$", description = "The link's token: 64 lowercase hex digits.")),
    responses(
        (status = 200, description = "Delivered to the wait's inbox.", body = Answered),
        (status = 404, description = "Not a token's form.", body = ErrorBody),
        (status = 410, description = "The link was used, its wait has ended, or it never existed.", body = ErrorBody),
        (status = 429, description = "Past this host's answer-link requests a second; try again after `Retry-After`.", body = ErrorBody),
    ))]
pub async fn answer(
    State(s): State<AppState>,
    Params(token): Params<String>,
    JsonBody(req): JsonBody<Answer>,
) -> Result<([(axum::http::HeaderName, &'static str); 1], Json<Answered>), ApiError> {
    if !well_formed(&token) {
        return Err(ApiError::not_found("no answer link has this form: a token is 64 lowercase hex digits"));
    }
    let input = match req.input {
        Value::String(s) => s,
        other => other.to_string(),
    };
    if input.contains('\0') {
        return Err(ApiError::bad_request("input must not contain NUL characters"));
    }
    let (run, name) = s.store.answer(&token_hash(&token), &input).await?;
    tracing::info!(run_id = run.id, name = %name, "input delivered through an answer link");
    Ok(([(axum::http::header::CACHE_CONTROL, "no-store")], Json(Answered { delivered: true, name })))
}

/// Answer links' requests a second, over every link, and the most at once
/// after a quiet spell: the route needs no token, so anyone may call it.
/// A token bucket, refilled at `rate` a second up to `burst`.
pub(crate) struct Bucket {
    rate: f64,
    burst: f64,
    state: std::sync::Mutex<(f64, std::time::Instant)>,
}

impl Bucket {
    pub(crate) fn new(rate: u32, burst: u32) -> Bucket {
        let (rate, burst) = (f64::from(rate.max(1)), f64::from(burst.max(1)));
        Bucket { rate, burst, state: std::sync::Mutex::new((burst, std::time::Instant::now())) }
    }

    /// Takes one request's token, or says how long until there is one.
    fn take(&self) -> Result<(), std::time::Duration> {
        let mut state = self.state.lock().expect("answer bucket lock");
        let (tokens, at) = *state;
        let now = std::time::Instant::now();
        let tokens = (tokens + now.duration_since(at).as_secs_f64() * self.rate).min(self.burst);
        if tokens >= 1.0 {
            *state = (tokens - 1.0, now);
            Ok(())
        } else {
            *state = (tokens, now);
            Err(std::time::Duration::from_secs_f64((1.0 - tokens) / self.rate))
        }
    }
}

/// Refuses answer-link requests past the host's rate (`--answers-per-second`)
/// with 429 and `Retry-After`, before their body is read.
pub(crate) async fn gate(State(s): State<AppState>, req: axum::extract::Request, next: axum::middleware::Next) -> axum::response::Response {
    use axum::response::IntoResponse;
    match s.answers.take() {
        Ok(()) => next.run(req).await,
        Err(wait) => {
            let secs = wait.as_secs_f64().ceil().max(1.0) as u64;
            let mut refused = ApiError::new(
                axum::http::StatusCode::TOO_MANY_REQUESTS,
                "rate_limited",
                format!("too many answer requests to this host; try again in {secs} s"),
            )
            .into_response();
            refused.headers_mut().insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from(secs));
            refused
        }
    }
}
