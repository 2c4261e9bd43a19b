//! The plugin registry's table: each plugin's current component and
//! settings, and every version a run may have been submitted with.

use serde::{Deserialize, Serialize};
use sqlx::Row;

use crate::store::{KvQuota, Store, StoreError, sql};

/// What an operator sets per plugin. Every field documents its default.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PluginSettings {
    /// Hosts (`host` or `host:port`) the plugin's `http` effects may reach.
    /// Default: none.
    #[serde(default)]
    pub http_allow: Vec<String>,
    /// What happens to runs in flight when a new version is registered.
    /// Default: `pinned`.
    #[serde(default)]
    pub upgrade: UpgradePolicy,
    /// What the plugin may ask of `model.chat`. Default: nothing, so
    /// `model.chat` is denied to it.
    #[serde(default)]
    pub model: ModelGrant,
    /// How much the plugin's kv namespace may hold. Default: 256 MiB in
    /// 100,000 keys.
    #[serde(default)]
    pub kv: KvQuota,
    /// The limit a submit gives its runs' concurrency keys when no operator
    /// ever set one for the key (docs/flow-control.md). Default: none.
    /// Kept in a column of its own (`plugins.key_concurrency`), never in the
    /// settings JSON, which the previous release reads strictly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_concurrency: Option<i64>,
    /// Plugins whose runs the plugin's turns may spawn as children
    /// (docs/concepts.md, "Child runs"); `*` grants any. Default: none, so
    /// `spawn` is denied. A column of its own (`plugins.spawn_allow`), as
    /// `key_concurrency` is.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub spawn_allow: Vec<String>,
}

/// What a plugin may ask of `model.chat`, as its `http` allow-list says
/// what it may reach: the guest chooses the model and the size of the
/// answer, and both cost money. Every field documents its default.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelGrant {
    /// Models the plugin may name (a call that names none asks for the
    /// host's `--model`, which must be listed too); `*` grants any.
    /// Default: none, so `model.chat` is denied.
    #[serde(default)]
    pub models: Vec<String>,
    /// The most `max_tokens` one call may ask for; a call that asks for
    /// none is given this. Default: 4,096.
    #[serde(default = "ModelGrant::default_max_tokens")]
    pub max_tokens: u64,
}

impl ModelGrant {
    fn default_max_tokens() -> u64 {
        4_096
    }

    /// Any model, the default cap on tokens.
    pub fn any() -> ModelGrant {
        ModelGrant { models: vec!["*".into()], ..ModelGrant::default() }
    }

    /// `models` from a comma-separated list, the default cap.
    pub fn listed(models: &str) -> ModelGrant {
        let models = models.split(',').map(str::trim).filter(|m| !m.is_empty()).map(str::to_string).collect();
        ModelGrant { models, ..ModelGrant::default() }
    }
}

impl Default for ModelGrant {
    fn default() -> Self {
        ModelGrant { models: Vec::new(), max_tokens: ModelGrant::default_max_tokens() }
    }
}

/// How a plugin's runs in flight take a new version.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq, Hash, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum UpgradePolicy {
    /// Runs finish on the version they started with; new runs take the
    /// new one.
    #[default]
    Pinned,
    /// A run moves to the current version at its next segment if its
    /// recorded ledger replays clean on it (`leasehold replay`); otherwise
    /// it stays, and says why in its `upgrade_note`.
    Auto,
}

impl UpgradePolicy {
    pub fn parse(s: &str) -> Option<UpgradePolicy> {
        match s {
            "pinned" => Some(UpgradePolicy::Pinned),
            "auto" => Some(UpgradePolicy::Auto),
            _ => None,
        }
    }
}

/// A registered plugin, as listed.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct PluginInfo {
    pub name: String,
    pub digest: String,
    pub size: i64,
    pub settings: PluginSettings,
    pub created_at: i64,
    pub updated_at: i64,
}

impl Store {
    pub async fn put_plugin(
        &self,
        name: &str,
        digest: &str,
        component: &[u8],
        settings: &PluginSettings,
    ) -> Result<(), StoreError> {
        let key_concurrency = settings.key_concurrency;
        let spawn_allow = serde_json::to_string(&settings.spawn_allow).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let settings = PluginSettings { key_concurrency: None, spawn_allow: Vec::new(), ..settings.clone() };
        let settings = serde_json::to_string(&settings).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        self.retry(|| async {
            // The version first: a run submitted with the new current
            // digest must find its component.
            let mut tx = self.writer().begin().await?;
            sqlx::query(sql!(
                self,
                "INSERT INTO plugin_versions (name, digest, component, created_at) VALUES ($1, $2, $3, {now}) \
                 ON CONFLICT (name, digest) DO NOTHING"
            ))
            .bind(name)
            .bind(digest)
            .bind(component.to_vec())
            .execute(&mut *tx)
            .await?;
            sqlx::query(sql!(
                self,
                "INSERT INTO plugins (name, digest, component, settings, key_concurrency, spawn_allow, created_at, updated_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, {now}, {now}) \
                 ON CONFLICT (name) DO UPDATE SET digest = excluded.digest, component = excluded.component, \
                 settings = excluded.settings, key_concurrency = excluded.key_concurrency, \
                 spawn_allow = excluded.spawn_allow, updated_at = excluded.updated_at"
            ))
            .bind(name)
            .bind(digest)
            .bind(component.to_vec())
            .bind(&settings)
            .bind(key_concurrency)
            .bind(&spawn_allow)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            Ok(())
        })
        .await
    }

    /// The component of version `digest` of plugin `name`, if registered.
    pub async fn plugin_version(&self, name: &str, digest: &str) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(sqlx::query_scalar(sql!(self, "SELECT component FROM plugin_versions WHERE name = $1 AND digest = $2"))
            .bind(name)
            .bind(digest)
            .fetch_optional(self.pool())
            .await?)
    }

    /// Every registered plugin, by name.
    pub async fn list_plugins(&self) -> Result<Vec<PluginInfo>, StoreError> {
        let rows = sqlx::query(sql!(
            self,
            "SELECT name, digest, LENGTH(component) AS size, settings, key_concurrency, spawn_allow, created_at, updated_at \
             FROM plugins ORDER BY name"
        ))
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(plugin_info).collect()
    }

    /// Plugin `name`, as [`Store::list_plugins`] lists it; `None` if no
    /// plugin has that name.
    pub async fn plugin(&self, name: &str) -> Result<Option<PluginInfo>, StoreError> {
        let row = sqlx::query(sql!(
            self,
            "SELECT name, digest, LENGTH(component) AS size, settings, key_concurrency, spawn_allow, created_at, updated_at \
             FROM plugins WHERE name = $1"
        ))
        .bind(name)
        .fetch_optional(self.pool())
        .await?;
        row.as_ref().map(plugin_info).transpose()
    }

    /// Whether plugin `name` is registered. The service never removes a
    /// plugin (it keeps every version while runs may use it), so a name
    /// once seen is remembered and later calls ask the database nothing:
    /// a submit names its plugin's version as
    /// [`crate::store::NewRun::CURRENT_VERSION`],
    /// which the statement that writes the run reads, rather than reading
    /// it first in a round trip of its own.
    pub async fn plugin_exists(&self, name: &str) -> Result<bool, StoreError> {
        if self.known_plugins.read().expect("known plugins lock").contains(name) {
            return Ok(true);
        }
        let found = self.plugin_digest(name).await?.is_some();
        if found {
            self.known_plugins.write().expect("known plugins lock").insert(name.to_string());
        }
        Ok(found)
    }

    /// The digest of plugin `name`, if registered.
    pub async fn plugin_digest(&self, name: &str) -> Result<Option<String>, StoreError> {
        Ok(sqlx::query_scalar(sql!(self, "SELECT digest FROM plugins WHERE name = $1"))
            .bind(name)
            .fetch_optional(self.pool())
            .await?)
    }

    /// The digest and settings of plugin `name`, if registered.
    pub async fn plugin_settings(&self, name: &str) -> Result<Option<(String, PluginSettings)>, StoreError> {
        let row = sqlx::query(sql!(self, "SELECT digest, settings, key_concurrency, spawn_allow FROM plugins WHERE name = $1"))
            .bind(name)
            .fetch_optional(self.pool())
            .await?;
        match row {
            None => Ok(None),
            Some(r) => Ok(Some((r.try_get("digest")?, settings_of(&r)?))),
        }
    }

    /// The current component and settings of plugin `name`, if registered.
    pub async fn plugin_component(&self, name: &str) -> Result<Option<(Vec<u8>, PluginSettings)>, StoreError> {
        let row = sqlx::query(sql!(self, "SELECT component, settings, key_concurrency, spawn_allow FROM plugins WHERE name = $1"))
            .bind(name)
            .fetch_optional(self.pool())
            .await?;
        match row {
            None => Ok(None),
            Some(r) => Ok(Some((r.try_get("component")?, settings_of(&r)?))),
        }
    }
}

/// A plugin row's settings: its JSON, and its columns of their own.
fn settings_of(r: &sqlx::any::AnyRow) -> Result<PluginSettings, StoreError> {
    let s: String = r.try_get("settings")?;
    let mut settings: PluginSettings =
        serde_json::from_str(&s).map_err(|e| StoreError::Corrupt(format!("plugin settings {s:?}: {e}")))?;
    settings.key_concurrency = r.try_get("key_concurrency")?;
    let spawn: String = r.try_get("spawn_allow")?;
    settings.spawn_allow = serde_json::from_str(&spawn).map_err(|e| StoreError::Corrupt(format!("plugin spawn_allow {spawn:?}: {e}")))?;
    Ok(settings)
}

impl Store {
    /// Every (plugin, version) a run not yet finished was submitted with
    /// or moved to: the versions a host must still be able to run.
    pub async fn open_versions(&self) -> Result<Vec<(String, String)>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT DISTINCT plugin, plugin_digest FROM runs \
             WHERE status IN ('queued', 'running', 'waiting_input', 'waiting_takeover')",
        )
        .fetch_all(self.pool())
        .await?)
    }
}

fn plugin_info(r: &sqlx::any::AnyRow) -> Result<PluginInfo, StoreError> {
    Ok(PluginInfo {
        name: r.try_get("name")?,
        digest: r.try_get("digest")?,
        size: r.try_get::<i64, _>("size").or_else(|_| r.try_get::<i32, _>("size").map(i64::from))?,
        settings: settings_of(&r)?,
        created_at: r.try_get("created_at")?,
        updated_at: r.try_get("updated_at")?,
    })
}
