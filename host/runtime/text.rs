//! What the host does to text a guest hands it before storing or logging
//! it: NULs replaced, names checked, lines escaped and cut; and how a
//! request and a failure are written in the ledger.

use serde_json::json;
use sha2::{Digest, Sha256};

use crate::effects::EffectError;
use crate::store::REQUEST_PREVIEW;

/// `text` as the store keeps it: each NUL replaced by U+FFFD. PostgreSQL
/// cannot store NUL in text (SQLite can), so without this a guest that
/// wrote one would fail differently on each backend, and on PostgreSQL only
/// after its segments had been abandoned until the reaper gave up.
pub(crate) fn storable(text: String) -> String {
    if text.contains('\0') { text.replace('\0', "\u{FFFD}") } else { text }
}

/// Longest effect name.
pub const MAX_EFFECT_NAME: usize = 128;

/// An effect name as it is recorded, and the refusal if it is not a valid
/// name (1 to 128 bytes of `a-z`, `0-9`, `.`, `_` and `-`). An invalid
/// name is recorded as `invalid:` and its first 32 characters, made safe,
/// and its refusal says only its size.
pub(super) fn effect_name(name: String) -> (String, Option<EffectError>) {
    let valid = (1..=MAX_EFFECT_NAME).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-'));
    if valid {
        return (name, None);
    }
    let shown: String = name
        .chars()
        .take(32)
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') { c } else { '?' })
        .collect();
    let error = EffectError::Denied(format!(
        "effect names are 1 to {MAX_EFFECT_NAME} bytes of a-z, 0-9, '.', '_' and '-'; this one is {} bytes ({shown:?}…)",
        name.len()
    ));
    (format!("invalid:{shown}"), Some(error))
}

/// `text` cut to at most `max` bytes, at a character boundary, with `…`.
pub(super) fn truncated(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// What the ledger keeps of a request beside its hash: its first
/// [`REQUEST_PREVIEW`] bytes, cut at a character boundary (`…` marks a
/// cut), NUL made storable.
pub fn request_preview(request: &str) -> String {
    storable(truncated(request, REQUEST_PREVIEW))
}

/// A guest's log line made safe for the host's log: control characters
/// (newlines, escape sequences, NUL) are written as escapes, so a guest
/// cannot forge log lines or drive the operator's terminal.
pub fn escape_log(text: String) -> String {
    if !text.chars().any(char::is_control) {
        return text;
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

/// `sha256(name NUL request)`, hex.
pub fn request_hash(name: &str, request: &str) -> String {
    let mut h = Sha256::new();
    h.update(name.as_bytes());
    h.update([0]);
    h.update(request.as_bytes());
    hex::encode(h.finalize())
}

/// How a failed effect is stored in the ledger's `result`.
pub fn encode_error(e: &EffectError) -> String {
    let (kind, message) = match e {
        EffectError::Failed(m) => ("failed", m),
        EffectError::InDoubt(m) => ("in-doubt", m),
        EffectError::Denied(m) => ("denied", m),
    };
    json!({ "kind": kind, "message": message }).to_string()
}

pub(super) fn decode_error(stored: &str) -> EffectError {
    let v: serde_json::Value = serde_json::from_str(stored).unwrap_or_default();
    let message = v["message"].as_str().unwrap_or(stored).to_string();
    match v["kind"].as_str() {
        Some("denied") => EffectError::Denied(message),
        Some("in-doubt") => EffectError::InDoubt(message),
        _ => EffectError::Failed(message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_lines_have_their_control_characters_escaped() {
        assert_eq!(escape_log("a\nb\u{1b}[31m\r\u{0}".into()), "a\\nb\\u{1b}[31m\\r\\u{0}");
        assert_eq!(escape_log("plain é".into()), "plain é");
        assert_eq!(truncated("ééé", 3), "é…");
    }

    #[test]
    fn effect_names_are_checked_and_a_refused_one_is_recorded_short() {
        assert!(effect_name("kv.get".into()).1.is_none());
        assert!(effect_name("model.chat".into()).1.is_none());
        let (stored, refused) = effect_name("a".repeat(300));
        assert!(refused.is_some() && stored.len() <= 8 + 32, "{stored}");
        let (stored, refused) = effect_name("Bad Name!".into());
        assert!(refused.is_some() && stored == "invalid:Bad?Name?", "{stored}");
        assert!(effect_name(String::new()).1.is_some());
    }
}
