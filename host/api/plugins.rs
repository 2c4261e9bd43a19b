//! `/v1/plugins`: register and list components.

use axum::Json;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::{ApiError, AppState, ErrorBody, Params, QueryParams, body_bytes};
use crate::plugins::PluginSettings;
use crate::store::{KvQuota, KvUsage, PluginInfo, UpgradePolicy, VersionInfo};

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct PutQuery {
    /// Comma-separated hosts (`host` or `host:port`) the plugin's `http`
    /// effects may reach. Default: none.
    http_allow: Option<String>,
    /// How runs in flight take this version. Default: `pinned`.
    #[param(value_type = Option<UpgradePolicy>)]
    upgrade: Option<String>,
    /// Comma-separated models the plugin may ask `model.chat` for (`*`:
    /// any). Default: none: `model.chat` is denied to it.
    model_allow: Option<String>,
    /// The most `max_tokens` one of its calls may ask for. Default: 4096.
    #[param(minimum = 1)]
    model_max_tokens: Option<u64>,
    /// Bytes (of keys and values) the plugin's kv may hold over all its
    /// runs. Default: 268435456 (256 MiB).
    #[param(minimum = 1)]
    kv_max_bytes: Option<u64>,
    /// Keys the plugin's kv may hold. Default: 100000.
    #[param(minimum = 1)]
    kv_max_keys: Option<u64>,
    /// The limit a submit gives its runs' concurrency keys when no operator
    /// ever set one for the key, 1 to 1000000. Default: none.
    #[param(minimum = 1, maximum = 1000000)]
    key_concurrency: Option<i64>,
    /// Comma-separated plugins whose runs the plugin's turns may spawn as
    /// children (`*`: any). Default: none: `spawn` is denied to it.
    #[param(pattern = r"^((\*|[a-z0-9_-]{1,64})(,(\*|[a-z0-9_-]{1,64}))*)?$")]
    spawn_allow: Option<String>,
}

/// A registered version.
#[derive(Serialize, ToSchema)]
pub struct Registered {
    name: String,
    /// The component's SHA-256, hex.
    digest: String,
}

/// A plugin: its current version and settings, and every version kept.
#[derive(Serialize, ToSchema)]
pub struct PluginView {
    name: String,
    /// The current version's digest: new runs take it.
    digest: String,
    /// The current component's size in bytes.
    size: i64,
    settings: PluginSettings,
    created_at: i64,
    updated_at: i64,
    /// What its kv holds now, against `settings.kv`.
    kv_usage: KvUsage,
    /// Every version, newest first, with its runs.
    versions: Vec<VersionInfo>,
}

/// Every registered plugin, by name.
#[derive(Serialize, ToSchema)]
pub struct PluginsList {
    plugins: Vec<PluginView>,
}

/// `PUT /v1/plugins/{name}?http_allow=host:port,…&spawn_allow=name,…&upgrade=pinned|auto&model_allow=m,…&model_max_tokens=N&kv_max_bytes=N&kv_max_keys=N&key_concurrency=N` with the component's
/// bytes: 201 `{name, digest}`; 422 with the reason when the bytes are not a
/// component implementing `leasehold:turn/turn`.
#[utoipa::path(put, path = "/v1/plugins/{name}", tag = "plugins",
    params(("name" = String, Path, pattern = "^[a-z0-9_-]{1,64}$", description = "The plugin's name: 1 to 64 of a-z, 0-9, '-' and '_'."), PutQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "The component's bytes (any content type is taken)."),
    responses(
        (status = 201, description = "The version is registered and current.", body = Registered),
        (status = 413, description = "The component is over the upload cap.", body = ErrorBody),
        (status = 422, description = "The bytes are not a component implementing leasehold:turn/turn.", body = ErrorBody),
    ))]
pub async fn put(
    State(s): State<AppState>,
    Params(name): Params<String>,
    QueryParams(q): QueryParams<PutQuery>,
    req: Request,
) -> Result<(StatusCode, Json<Registered>), ApiError> {
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
    let mut model = crate::store::ModelGrant::listed(q.model_allow.as_deref().unwrap_or_default());
    if model.models.iter().any(|m| m.len() > 255 || m.contains(['\0', ' '])) {
        return Err(ApiError::bad_request("model_allow entries must be model names, or *"));
    }
    if let Some(n) = q.model_max_tokens {
        if n == 0 {
            return Err(ApiError::bad_request("model_max_tokens must be at least 1"));
        }
        model.max_tokens = n;
    }
    let mut kv = KvQuota::default();
    for (value, cap, name) in [(q.kv_max_bytes, &mut kv.max_bytes, "kv_max_bytes"), (q.kv_max_keys, &mut kv.max_keys, "kv_max_keys")] {
        match value {
            Some(0) => return Err(ApiError::bad_request(format!("{name} must be at least 1"))),
            Some(n) if n > i64::MAX as u64 => return Err(ApiError::bad_request(format!("{name} must be at most {}", i64::MAX))),
            Some(n) => *cap = n,
            None => {}
        }
    }
    if let Some(n) = q.key_concurrency {
        crate::store::concurrency::check_concurrency(n).map_err(|e| ApiError::bad_request(format!("key_{e}")))?;
    }
    let spawn_allow: Vec<String> =
        q.spawn_allow.unwrap_or_default().split(',').map(str::trim).filter(|p| !p.is_empty()).map(str::to_string).collect();
    if let Some(e) = spawn_allow.iter().find_map(|g| crate::plugins::check_spawn_grant(g).err()) {
        return Err(ApiError::bad_request(format!("spawn_allow: {e}")));
    }
    let settings = PluginSettings { http_allow, upgrade, model, kv, key_concurrency: q.key_concurrency, spawn_allow };
    // Awaited here, holding the permit: a caller that goes away drops the
    // registration, and with it the compiler child (`serve` compiles in
    // one), so nothing is left compiling for nobody.
    let plugin = crate::plugins::register(&s.store, &s.runtime, &name, bytes.to_vec(), settings).await?;
    drop(permit);
    tracing::info!(plugin = %name, digest = %plugin.digest, "plugin registered");
    Ok((StatusCode::CREATED, Json(Registered { name, digest: plugin.digest.clone() })))
}

/// `GET /v1/plugins`: every plugin with its versions and their runs.
#[utoipa::path(get, path = "/v1/plugins", tag = "plugins",
    responses((status = 200, description = "Every registered plugin.", body = PluginsList)))]
pub async fn list(State(s): State<AppState>) -> Result<Json<PluginsList>, ApiError> {
    let mut plugins = Vec::new();
    for p in s.store.list_plugins().await? {
        plugins.push(view(&s, p).await?);
    }
    Ok(Json(PluginsList { plugins }))
}

/// `GET /v1/plugins/{name}`: one plugin, its versions and its kv usage.
#[utoipa::path(get, path = "/v1/plugins/{name}", tag = "plugins",
    params(("name" = String, Path, description = "The plugin's name.")),
    responses(
        (status = 200, description = "The plugin.", body = PluginView),
        (status = 404, description = "No plugin of that name is registered.", body = ErrorBody),
    ))]
pub async fn show(State(s): State<AppState>, Params(name): Params<String>) -> Result<Json<PluginView>, ApiError> {
    let plugin = s.store.plugin(&name).await?;
    let Some(plugin) = plugin else {
        return Err(ApiError::not_found(format!("no plugin named {name:?} is registered")));
    };
    Ok(Json(view(&s, plugin).await?))
}

async fn view(s: &AppState, p: PluginInfo) -> Result<PluginView, ApiError> {
    let versions = s.store.plugin_versions(&p.name).await?;
    let kv_usage = s.store.kv_usage(&p.name).await?;
    Ok(PluginView {
        name: p.name,
        digest: p.digest,
        size: p.size,
        settings: p.settings,
        created_at: p.created_at,
        updated_at: p.updated_at,
        kv_usage,
        versions,
    })
}
