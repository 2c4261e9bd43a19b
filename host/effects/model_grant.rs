//! A plugin's grant of `model.chat` ([`ModelGrant`]): which models it may
//! name and how many tokens one answer may cost. A call outside it is
//! refused (`denied`) before anything is sent, and the refusal is recorded
//! like any result, so replay gives the same answer.

use serde_json::{Map, Value};

use super::EffectError;
use crate::store::ModelGrant;

/// Checks a chat request's body (its `model` already filled in) against
/// `grant`, and gives a call that asks for no `max_tokens` the grant's cap.
/// `n` above 1 (several answers for one call's price) is refused.
pub fn apply(body: &mut Map<String, Value>, grant: &ModelGrant) -> Result<(), EffectError> {
    let denied = |m: String| Err(EffectError::Denied(format!("model.chat: {m}")));
    if grant.models.is_empty() {
        return denied("not granted to this plugin (grant it with --model-allow, or `model_allow` when the plugin is registered)".into());
    }
    let model = body.get("model").and_then(Value::as_str).unwrap_or_default();
    if !grant.models.iter().any(|m| m == "*" || m == model) {
        return denied(format!("model {model:?} is not granted to this plugin (granted: {})", grant.models.join(", ")));
    }
    for key in ["max_tokens", "max_completion_tokens"] {
        match body.get(key) {
            None | Some(Value::Null) => {}
            Some(v) => match v.as_u64() {
                Some(n) if n <= grant.max_tokens => {}
                Some(n) => return denied(format!("{key} {n} is over this plugin's cap of {}", grant.max_tokens)),
                None => return Err(EffectError::Failed(format!("model.chat: bad request: `{key}` must be a whole number"))),
            },
        }
    }
    // A null is no cap: the grant's goes in its place (`"max_tokens":
    // null` would otherwise send the call uncapped).
    let given = |body: &Map<String, Value>, k: &str| body.get(k).is_some_and(|v| !v.is_null());
    if !given(body, "max_tokens") && !given(body, "max_completion_tokens") {
        body.remove("max_completion_tokens");
        body.insert("max_tokens".into(), Value::from(grant.max_tokens));
    }
    match body.get("n") {
        None | Some(Value::Null) => {}
        Some(v) if v.as_u64() == Some(1) => {}
        Some(v) => return denied(format!("n {v}: one answer per call")),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn a_call_inside_its_grant_goes_with_the_cap_filled_in() {
        let mut b = body(json!({ "model": "small", "messages": [] }));
        let grant = ModelGrant { models: vec!["small".into()], max_tokens: 512 };
        apply(&mut b, &grant).unwrap();
        assert_eq!(b["max_tokens"], json!(512));
        let mut b = body(json!({ "model": "big", "max_tokens": 100, "messages": [] }));
        apply(&mut b, &ModelGrant::any()).unwrap();
        assert_eq!(b["max_tokens"], json!(100));
    }

    #[test]
    fn a_null_cap_gets_the_grants_cap() {
        let grant = ModelGrant { models: vec!["small".into()], max_tokens: 512 };
        for nulls in [json!({ "max_tokens": null }), json!({ "max_completion_tokens": null }), json!({ "max_tokens": null, "max_completion_tokens": null })] {
            let mut b = body(json!({ "model": "small", "messages": [] }));
            b.extend(body(nulls.clone()));
            apply(&mut b, &grant).unwrap();
            assert_eq!(b["max_tokens"], json!(512), "{nulls}");
            assert!(b.get("max_completion_tokens").is_none_or(Value::is_null), "{nulls}");
        }
    }

    #[test]
    fn a_call_outside_its_grant_is_denied() {
        let grant = ModelGrant { models: vec!["small".into()], max_tokens: 512 };
        let denied = |v: Value, g: &ModelGrant| matches!(apply(&mut body(v), g), Err(EffectError::Denied(_)));
        assert!(denied(json!({ "model": "small" }), &ModelGrant::default()), "no grant");
        assert!(denied(json!({ "model": "big" }), &grant), "a model not listed");
        assert!(denied(json!({ "model": "small", "max_tokens": 513 }), &grant), "over the cap");
        assert!(denied(json!({ "model": "small", "max_completion_tokens": 100_000 }), &grant), "over the cap");
        assert!(denied(json!({ "model": "small", "n": 3 }), &grant), "several answers");
    }
}
