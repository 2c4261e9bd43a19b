//! The host functions of `leasehold:turn/waits` (0.2.0): named waits with
//! an inbox and a deadline, and one-use answer links (see `store::inbox`).
//!
//! * `wait-for` with a timeout records its deadline first (call
//!   `wait.deadline`, of the database's clock), so a resumed wait keeps it.
//!   Its end (the input taken, or the timeout) is the row of call `wait`,
//!   written with the take: a replay takes the same branch.
//! * `answer-link`'s token is derived from the run's secret, its id, the
//!   call's position and the name, so the replay of the call makes the
//!   same link without the token being stored anywhere; the database keeps
//!   only its SHA-256.

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::host::leasehold::turn::waits::Host;
use super::host::{Interrupt, SegmentState, WitEffectError, detached};
use super::phase::Phase;
use super::text::decode_error;
use crate::effects::EffectError;
use crate::runtime::GuestErrorKind;
use crate::store::{EffectState, NamedWait};

/// Longest wait name, in bytes.
pub const MAX_WAIT_NAME: usize = 128;

impl Host for SegmentState {
    async fn wait_for(&mut self, name: String, prompt: String, timeout_ms: Option<u64>) -> wasmtime::Result<Option<String>> {
        self.wait_for_call(name, prompt, timeout_ms).await
    }

    async fn answer_link(&mut self, name: String) -> wasmtime::Result<Result<String, WitEffectError>> {
        Ok(self.answer_link_call(name).await?.map_err(WitEffectError::from))
    }
}

/// Whether `name` may name a wait: 1 to 128 bytes of `a-z`, `0-9`, `.`,
/// `_`, `-`.
pub fn valid_wait_name(name: &str) -> bool {
    (1..=MAX_WAIT_NAME).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-'))
}

/// The SHA-256 of an answer link's token, hex: what the database keeps.
pub fn token_hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

impl SegmentState {
    fn checked_name(&mut self, name: &str) -> wasmtime::Result<()> {
        if valid_wait_name(name) {
            return Ok(());
        }
        let message = format!("a wait name must be 1 to {MAX_WAIT_NAME} bytes of a-z, 0-9, '.', '_', '-'");
        self.limit(GuestErrorKind::Limit, message)
    }

    async fn wait_for_call(&mut self, name: String, prompt: String, timeout_ms: Option<u64>) -> wasmtime::Result<Option<String>> {
        self.charge()?;
        self.checked_name(&name)?;
        if prompt.len() > self.limits.max_prompt_bytes {
            let message = format!("a wait-for prompt of {} bytes is over the {}-byte cap", prompt.len(), self.limits.max_prompt_bytes);
            return self.limit(GuestErrorKind::Limit, message);
        }
        let prompt = super::text::storable(prompt);
        let deadline = match timeout_ms {
            None => None,
            Some(ms) => {
                let ms = i64::try_from(ms).unwrap_or(i64::MAX / 4);
                let call = self.call("wait.deadline", &ms.to_string());
                Some(self.recorded_deadline(call, ms).await?)
            }
        };
        let call = self.call("wait", &json!({ "name": name, "prompt": prompt }).to_string());
        if let Some(row) = self.replayed(&call).await? {
            let ended: Value = serde_json::from_str(row.result.as_deref().unwrap_or("{}")).unwrap_or(Value::Null);
            return Ok(ended["input"].as_str().map(str::to_string));
        }
        if self.offline {
            return self.frontier(&call, "not recorded: the turn waits for input here");
        }
        let timed_out = match deadline {
            Some(deadline) => self.db_now().await? >= deadline,
            None => false,
        };
        self.room(20)?;
        let ended = {
            let _db = self.phase.enter(Phase::DATABASE);
            self.flush_stream().await?;
            let (db, lease, c, n) = (self.db.clone(), self.lease.clone(), call.clone(), name.clone());
            match detached(async move { db.end_wait(&lease, &c, &n, timed_out).await }).await {
                Ok(ended) => ended,
                Err(e) => return self.store_failed(e),
            }
        };
        let Some(row) = ended else {
            return self.stop(Interrupt::WaitNamed(NamedWait { name, prompt, deadline }));
        };
        self.settled += 1;
        let result = row.result.unwrap_or_default();
        self.wrote(&call, result.len());
        let ended: Value = serde_json::from_str(&result).unwrap_or(Value::Null);
        Ok(ended["input"].as_str().map(str::to_string))
    }

    async fn answer_link_call(&mut self, name: String) -> wasmtime::Result<Result<String, EffectError>> {
        self.charge()?;
        self.checked_name(&name)?;
        let call = self.call("wait.link", &name);
        let link = match (&self.answer_base, &self.secret) {
            (Some(base), Some(secret)) => {
                let token = hex::encode(Sha256::digest(
                    format!("leasehold answer link\0{secret}\0{}\0{}\0{name}", self.lease.run_id, call.seq).as_bytes(),
                ));
                Some((format!("{}/v1/answers/{token}", base.trim_end_matches('/')), token))
            }
            _ => None,
        };
        if let Some(row) = self.replayed(&call).await? {
            return Ok(match row.state {
                EffectState::Committed => Ok(link.map(|(url, _)| url).unwrap_or_default()),
                _ => Err(decode_error(row.result.as_deref().unwrap_or(""))),
            });
        }
        if self.offline {
            return self.frontier(&call, "not recorded: the turn makes an answer link here");
        }
        let Some((url, token)) = link else {
            let why = if self.answer_base.is_none() {
                "wait.link: this host has no public URL for answer links (serve --public-url)"
            } else {
                "wait.link: the run has no secret to derive a link from (it was submitted before runs had one)"
            };
            return self.refuse(&call, EffectError::Denied(why.into())).await;
        };
        self.room(20)?;
        let _db = self.phase.enter(Phase::DATABASE);
        self.flush_stream().await?;
        let (db, lease, c, hash) = (self.db.clone(), self.lease.clone(), call.clone(), token_hash(&token));
        match detached(async move { db.add_answer_link(&lease, &c, &name, &hash).await }).await {
            Ok(_) => {
                self.settled += 1;
                self.wrote(&call, 0);
                Ok(Ok(url))
            }
            Err(e) => self.store_failed(e),
        }
    }
}
