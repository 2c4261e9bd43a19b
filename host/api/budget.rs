//! `/v1/runs/{id}/budget`: the budget (tokens, dollars) that binds a run most closely
//! (docs/concepts.md, "Budgets": its own share, an ancestor's, or its
//! tree's root's): read it with what its subtree has spent and holds, or
//! set it, which lets the tree's runs waiting for budget go on.

use axum::Json;
use axum::extract::State;

use super::runs::BudgetRequest;
use super::{ApiError, AppState, ErrorBody, JsonBody, Params};
use crate::store::Budget;

/// `GET /v1/runs/{id}/budget`.
#[utoipa::path(get, path = "/v1/runs/{id}/budget", tag = "runs",
    params(("id" = i64, Path, description = "A run.")),
    responses(
        (status = 200, description = "The budget, what its subtree spent and what its calls in flight hold.", body = Budget),
        (status = 404, description = "No such run.", body = ErrorBody),
    ))]
pub async fn show(State(s): State<AppState>, Params(id): Params<i64>) -> Result<Json<Budget>, ApiError> {
    Ok(Json(s.store.budget(id).await?))
}

/// `POST /v1/runs/{id}/budget` with `{"tokens": N}`, `{"usd": X}` or
/// both: sets that budget (the root's, when no share binds the run) in
/// the units given, leaving the other as it is; the tree's runs waiting
/// for budget look again.
#[utoipa::path(post, path = "/v1/runs/{id}/budget", tag = "runs", request_body = BudgetRequest,
    params(("id" = i64, Path, description = "A run.")),
    responses(
        (status = 200, description = "The budget as it now stands.", body = Budget),
        (status = 400, description = "A bad budget (a unit out of range).", body = ErrorBody),
        (status = 404, description = "No such run.", body = ErrorBody),
    ))]
pub async fn set(State(s): State<AppState>, Params(id): Params<i64>, JsonBody(req): JsonBody<BudgetRequest>) -> Result<Json<Budget>, ApiError> {
    let limits = req.checked()?;
    let budget = s.store.set_budget(id, limits).await?;
    tracing::info!(run_id = id, holder_id = budget.holder_id, tokens = ?budget.tokens, usd = ?budget.usd, spent = budget.spent, spent_usd = budget.spent_usd, "budget set");
    Ok(Json(budget))
}
