//! `/v1/plugins`: register and list components.

use axum::Json;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use serde::Deserialize;
use serde_json::{Value, json};

use super::{ApiError, AppState, Params, QueryParams, body_bytes};
use crate::plugins::PluginSettings;
use crate::store::UpgradePolicy;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PutQuery {
    /// Comma-separated hosts the plugin's `http` effects may reach.
    http_allow: Option<String>,
    /// `pinned` (default) or `auto`: how runs in flight take this version.
    upgrade: Option<String>,
}

/// `PUT /v1/plugins/{name}?http_allow=host:port,…&upgrade=pinned|auto` with the component's
/// bytes: 201 `{name, digest}`; 422 with the reason when the bytes are not a
/// component implementing `leasehold:turn/turn`.
pub async fn put(
    State(s): State<AppState>,
    Params(name): Params<String>,
    QueryParams(q): QueryParams<PutQuery>,
    req: Request,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    if !crate::plugins::valid_name(&name) {
        return Err(crate::plugins::RegisterError::BadName(name).into());
    }
    // Compiling is the costliest thing a caller can ask for: a few at once.
    let Ok(permit) = s.uploads.clone().try_acquire_owned() else {
        return Err(ApiError::busy(format!(
            "{} plugin uploads are compiling, this host's cap; try again shortly",
            s.config.max_uploads
        )));
    };
    let bytes = body_bytes(req, &()).await?;
    if bytes.is_empty() {
        return Err(ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_component", "the body is empty"));
    }
    let http_allow: Vec<String> = q
        .http_allow
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(str::to_string)
        .collect();
    if http_allow.iter().any(|h| h.len() > 255 || h.contains(['/', '\0', ' '])) {
        return Err(ApiError::bad_request("http_allow entries must be host or host:port"));
    }
    let upgrade = match q.upgrade.as_deref() {
        None => UpgradePolicy::default(),
        Some(p) => UpgradePolicy::parse(p).ok_or_else(|| ApiError::bad_request("upgrade must be pinned or auto"))?,
    };
    let settings = PluginSettings { http_allow, upgrade };
    // Awaited here, holding the permit: a caller that goes away drops the
    // registration, and with it the compiler child (`serve` compiles in
    // one), so nothing is left compiling for nobody.
    let plugin = crate::plugins::register(&s.store, &s.runtime, &name, bytes.to_vec(), settings).await?;
    drop(permit);
    tracing::info!(plugin = %name, digest = %plugin.digest, "plugin registered");
    Ok((StatusCode::CREATED, Json(json!({ "name": name, "digest": plugin.digest }))))
}

pub async fn list(State(s): State<AppState>) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!({ "plugins": s.store.list_plugins().await? })))
}
