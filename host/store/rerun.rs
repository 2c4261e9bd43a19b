//! Reruns from a point in the ledger (docs/operations.md, "Rerunning from
//! a point in the ledger"). A rerun is a new run whose ledger starts with
//! the old run's rows below `from_seq`, with the old run's input, random
//! secret and creation time, so its turn replays that prefix as the old
//! one made it and performs none of it; from `from_seq` on it runs live.
//! The old run is never changed: the new one names it (`rerun_of`), and
//! it finds its reruns through the index on that column.
//!
//! The prefix must be settled (no call started or in doubt below
//! `from_seq`) and hold no child run or named wait: those belong to the old
//! run, whose children and inbox a rerun does not share. Whether the
//! prefix replays on the version the rerun is to run is the caller's
//! check (`runtime::offline`), made before [`Store::rerun`].

use serde_json::json;

use crate::store::log::{self, kind};
use crate::store::{EffectRow, EffectState, Run, Store, StoreError, sql};

/// Calls whose rows tie a run to its children or its inbox.
const TIED: [&str; 6] = ["spawn", "children.await", "children.deadline", "wait", "wait.deadline", "wait.link"];

impl Store {
    /// Run `run_id` and the rows a rerun of it from `from_seq` would start
    /// with, checked as above. `from_seq` is 0 (all live) to the number of
    /// rows (all replayed).
    pub async fn rerun_prefix(&self, run_id: i64, from_seq: i64) -> Result<(Run, Vec<EffectRow>), StoreError> {
        let run = self.get_run(run_id).await?;
        // A rerun is a root of its own: a child's would escape the budget
        // its tree is held to.
        if let Some(parent) = run.parent_id
            && self.budgeted(run_id).await?
        {
            return Err(StoreError::Refused(format!(
                "run {run_id} is a child (of run {parent}) in a tree with a budget, and a rerun is a root of its own \
                 that would not draw on it: rerun the tree's root instead"
            )));
        }
        let rows = self.effects(run_id).await?;
        let count = rows.len() as i64;
        if !(0..=count).contains(&from_seq) {
            return Err(StoreError::Refused(format!("from_seq must be 0 to {count}: run {run_id}'s ledger has {count} rows")));
        }
        let prefix: Vec<EffectRow> = rows.into_iter().filter(|r| r.seq < from_seq).collect();
        if let Some(r) = prefix.iter().find(|r| matches!(r.state, EffectState::Started | EffectState::InDoubt)) {
            return Err(StoreError::Refused(format!(
                "call {} ({}) below from_seq is {}: resolve it first (POST /v1/runs/{run_id}/effects/{}/resolve), or rerun from it",
                r.seq, r.name, r.state.as_str(), r.seq
            )));
        }
        if let Some(r) = prefix.iter().find(|r| TIED.contains(&r.name.as_str())) {
            return Err(StoreError::Refused(format!(
                "call {} ({}) below from_seq ties the run to its children or its inbox, which a rerun does not share: rerun from {} or before",
                r.seq, r.name, r.seq
            )));
        }
        Ok((run, prefix))
    }

    /// Writes the rerun of `old` from `from_seq` on version `digest`: the
    /// new run, queued, with the old rows below `from_seq`, in one
    /// transaction. Its fence starts at 1, so its first segment (fence 2)
    /// reads its ledger as any resumed segment does.
    pub async fn rerun(&self, old: &Run, from_seq: i64, digest: &str) -> Result<Run, StoreError> {
        let thread_id = uuid::Uuid::new_v4().to_string();
        let database_id = self.database_id().await?;
        let run = self
            .retry(|| async {
                let mut tx = self.writer().begin().await?;
                let row = sqlx::query(sql!(
                    self,
                    "INSERT INTO runs (thread_id, plugin, plugin_digest, input, status, max_attempts, not_before, created_at, \
                     updated_at, secret, priority, concurrency_key, budget_tokens, budget_usd_nanos, fence, rerun_of, rerun_from) \
                     SELECT $1, plugin, $2, input, 'queued', max_attempts, {now}, created_at, {now}, secret, priority, \
                     concurrency_key, budget_tokens, budget_usd_nanos, 1, id, $3 FROM runs WHERE id = $4 RETURNING {runs}"
                ))
                .bind(&thread_id)
                .bind(digest)
                .bind(from_seq)
                .bind(old.id)
                .fetch_optional(&mut *tx)
                .await?
                .ok_or(StoreError::RunNotFound(old.id))?;
                let run = Run::from_row(&row)?;
                sqlx::query(sql!(
                    self,
                    "INSERT INTO effects (run_id, seq, name, request_hash, request, idempotency_key, class, state, result, \
                     emit_pos, deltas, delta_bytes, fence_started, fence_completed, created_at, updated_at, kv_bytes, resolved_by, resolved_at) \
                     SELECT $1, seq, name, request_hash, request, $2 || CAST(seq AS TEXT), class, state, result, \
                     emit_pos, deltas, delta_bytes, 1, 1, created_at, {now}, kv_bytes, resolved_by, resolved_at \
                     FROM effects WHERE run_id = $3 AND seq < $4 ORDER BY seq"
                ))
                .bind(run.id)
                // `idempotency_key`'s form, for the new run.
                .bind(format!("{database_id}:{}:", run.id))
                .bind(old.id)
                .bind(from_seq)
                .execute(&mut *tx)
                .await?;
                if let Some(key) = &run.concurrency_key {
                    crate::store::concurrency::activate(self, &mut tx, key, &run.plugin).await?;
                }
                let payload = json!({ "plugin": run.plugin, "input": run.input, "rerun_of": old.id, "from_seq": from_seq });
                log::append(self, &mut tx, &run.thread_id, run.id, run.fence, kind::SUBMITTED, &payload).await?;
                tx.commit().await?;
                Ok(run)
            })
            .await?;
        self.signal_work(true).await;
        Ok(run)
    }

    /// The reruns of run `run_id`, oldest first (at most 100).
    pub async fn reruns_of(&self, run_id: i64) -> Result<Vec<i64>, StoreError> {
        Ok(sqlx::query_scalar(sql!(self, "SELECT id FROM runs WHERE rerun_of = $1 ORDER BY id LIMIT 100"))
            .bind(run_id)
            .fetch_all(self.pool())
            .await?)
    }
}
