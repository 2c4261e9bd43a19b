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
    responses((status = 200, description = "A page with the wait's prompt and a form that sends the answer.", content_type = "text/html", body = String)))]
pub async fn page(State(s): State<AppState>, Params(token): Params<String>) -> axum::response::Response {
    let prompt = if well_formed(&token) {
        s.store.answer_prompt(&token_hash(&token)).await.unwrap_or_else(|e| {
            tracing::warn!(error = %e, "reading an answer link's prompt failed; the page shows none");
            None
        })
    } else {
        None
    };
    super::dashboard::answer_page(prompt.as_deref())
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
    ))]
pub async fn answer(State(s): State<AppState>, Params(token): Params<String>, JsonBody(req): JsonBody<Answer>) -> Result<Json<Answered>, ApiError> {
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
    Ok(Json(Answered { delivered: true, name }))
}
