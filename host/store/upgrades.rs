//! What an `auto` upgrade records on a run (see `executor`): the version it
//! was checked against, what came of it, and, when it moved, its new
//! version. Under the run's (owner, fence) guard, like every write that
//! changes what the run will do.

use crate::store::guard::{guarded, rejected};
use crate::store::{Lease, Store, StoreError, sql};

impl Store {
    /// Records an upgrade check on the run `lease` holds: `moved_to` is its
    /// new version (`None`: it stays on its own), `checked` the version it
    /// was checked against, `note` what came of it.
    pub async fn record_upgrade(&self, lease: &Lease, moved_to: Option<&str>, checked: &str, note: &str) -> Result<(), StoreError> {
        let row = self
            .retry(|| async move {
                Ok(sqlx::query(sql!(
                    self,
                    concat!(
                        "UPDATE runs SET plugin_digest = COALESCE($4, plugin_digest), upgrade_checked = $5, \
                         upgrade_note = $6, heartbeat_at = {now}, updated_at = {now} WHERE ",
                        guarded!(),
                        " RETURNING id"
                    )
                ))
                .bind(lease.run_id)
                .bind(&lease.owner)
                .bind(lease.fence)
                .bind(moved_to)
                .bind(checked)
                .bind(note)
                .fetch_optional(self.writer())
                .await?)
            })
            .await?;
        match row {
            Some(_) => Ok(()),
            None => Err(rejected(lease)),
        }
    }
}
