//! `kv.get` / `kv.put`: a small key-value store in the host's database, one
//! namespace per plugin. Local class: the write and its ledger row commit in
//! one transaction, so a put happens exactly once however often the run dies.
//!
//! Requests (JSON): `kv.get {"key": K}` returns the stored JSON value or
//! `null`; `kv.put {"key": K, "value": V}` stores any JSON `V` and returns
//! `null`. Keys are non-empty strings of at most 512 bytes, without NUL;
//! values are at most the plugin's `max_kv_value_bytes` (64 KiB by
//! default), since every `kv.get` of one records it in the ledger.

use serde::Deserialize;

use crate::store::LocalOp;
use super::EffectError;

const MAX_KEY_BYTES: usize = 512;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Get {
    key: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Put {
    key: String,
    value: serde_json::Value,
}

pub fn op(name: &str, request: &str, namespace: &str, max_value: usize) -> Result<LocalOp, EffectError> {
    let bad = |e: serde_json::Error| EffectError::Failed(format!("{name}: bad request: {e}"));
    let (key, op) = match name {
        "kv.get" => {
            let Get { key } = serde_json::from_str(request).map_err(bad)?;
            (key.clone(), LocalOp::KvGet { namespace: namespace.to_string(), key })
        }
        _ => {
            let Put { key, value } = serde_json::from_str(request).map_err(bad)?;
            let value = value.to_string();
            // A value is read back into the ledger by every kv.get of it.
            if value.len() > max_value {
                return Err(EffectError::Failed(format!(
                    "{name}: a value of {} bytes is over the {max_value}-byte cap",
                    value.len()
                )));
            }
            let op = LocalOp::KvPut { namespace: namespace.to_string(), key: key.clone(), value };
            (key, op)
        }
    };
    if key.is_empty() || key.len() > MAX_KEY_BYTES {
        return Err(EffectError::Failed(format!(
            "{name}: key must be 1 to {MAX_KEY_BYTES} bytes"
        )));
    }
    // PostgreSQL cannot store it; replacing it could merge two keys.
    if key.contains('\0') {
        return Err(EffectError::Failed(format!("{name}: key must not contain NUL")));
    }
    Ok(op)
}
