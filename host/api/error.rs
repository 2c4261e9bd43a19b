//! API errors: `{"error": {"code", "message"}}` with a 4xx or 5xx status.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use crate::plugins::RegisterError;
use crate::runtime::PluginError;
use crate::store::StoreError;

/// Every error's body.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// What went wrong: a stable `code` and a message for people.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// e.g. `bad_request`, `unauthorized`, `not_found`, `conflict`,
    /// `idempotency_conflict`, `too_large`, `unsupported_media_type`,
    /// `misdirected`, `invalid_component`, `busy`, `timeout`,
    /// `database_unavailable`.
    pub code: String,
    pub message: String,
}

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, code, message: message.into() }
    }
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }
    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", message)
    }
    /// The same error, its message led by `prefix` (which item of a batch).
    pub fn prefixed(mut self, prefix: &str) -> ApiError {
        self.message.insert_str(0, prefix);
        self
    }
    /// 503 with `Retry-After`: the host is at a cap; try again shortly.
    pub fn busy(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "busy", message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() && self.code != "busy" {
            tracing::error!(code = self.code, message = %self.message, "request failed");
        }
        let body = ErrorBody { error: ErrorDetail { code: self.code.to_string(), message: self.message } };
        let busy = self.code == "busy";
        let mut response = (self.status, Json(body)).into_response();
        if busy {
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from_static("5"));
        }
        response
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> ApiError {
        match e {
            StoreError::RunNotFound(_) | StoreError::EffectNotFound { .. } | StoreError::NotFound(_) => ApiError::not_found(e.to_string()),
            StoreError::Conflict { .. } | StoreError::LeaseLost(_) => {
                ApiError::new(StatusCode::CONFLICT, "conflict", e.to_string())
            }
            StoreError::Config(_) => ApiError::bad_request(e.to_string()),
            StoreError::Refused(_) => ApiError::new(StatusCode::CONFLICT, "refused", e.to_string()),
            StoreError::Gone(_) => ApiError::new(StatusCode::GONE, "gone", e.to_string()),
            // The database is down or failing: the request may be retried.
            _ => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "database_unavailable", e.to_string()),
        }
    }
}

impl From<RegisterError> for ApiError {
    fn from(e: RegisterError) -> ApiError {
        match e {
            RegisterError::BadName(_) => ApiError::bad_request(e.to_string()),
            RegisterError::Plugin(PluginError::Cache(_)) => {
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "cache", e.to_string())
            }
            RegisterError::Plugin(p) => {
                ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_component", p.to_string())
            }
            RegisterError::Store(s) => s.into(),
        }
    }
}
