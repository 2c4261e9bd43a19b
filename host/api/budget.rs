//! `/v1/runs/{id}/budget`: the token budget a run's tree shares
//! (docs/concepts.md, "Budgets"): read it with what the tree has spent and
//! holds, or set it, which lets the tree's runs waiting for budget go on.

use axum::Json;
use axum::extract::State;

use super::runs::BudgetRequest;
use super::{ApiError, AppState, ErrorBody, JsonBody, Params};
use crate::store::Budget;

/// `GET /v1/runs/{id}/budget`.
#[utoipa::path(get, path = "/v1/runs/{id}/budget", tag = "runs",
    params(("id" = i64, Path, description = "Any run of the tree.")),
    responses(
        (status = 200, description = "The tree's budget, what it spent and what its calls in flight hold.", body = Budget),
        (status = 404, description = "No such run.", body = ErrorBody),
    ))]
pub async fn show(State(s): State<AppState>, Params(id): Params<i64>) -> Result<Json<Budget>, ApiError> {
    Ok(Json(s.store.budget(id).await?))
}

/// `POST /v1/runs/{id}/budget` with `{"tokens": N}`: sets the budget of
/// the run's tree (on its root) to N tokens; the tree's runs waiting for
/// budget look again.
#[utoipa::path(post, path = "/v1/runs/{id}/budget", tag = "runs", request_body = BudgetRequest,
    params(("id" = i64, Path, description = "Any run of the tree.")),
    responses(
        (status = 200, description = "The tree's budget as it now stands.", body = Budget),
        (status = 404, description = "No such run.", body = ErrorBody),
    ))]
pub async fn set(State(s): State<AppState>, Params(id): Params<i64>, JsonBody(req): JsonBody<BudgetRequest>) -> Result<Json<Budget>, ApiError> {
    let tokens = req.checked()?;
    let budget = s.store.set_budget(id, Some(tokens)).await?;
    tracing::info!(run_id = id, root_id = budget.root_id, tokens, spent = budget.spent, "budget set");
    Ok(Json(budget))
}
