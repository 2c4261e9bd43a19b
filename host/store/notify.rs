//! Announcing new work: in process, a wake-up of one idle worker; across
//! hosts on PostgreSQL, a `NOTIFY` on [`WORK_CHANNEL`], coalesced so that
//! one covers many submits.

use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::SeqCst;

use super::{Backend, Store, WORK_CHANNEL};

/// PostgreSQL takes one database-wide lock for every committing transaction
/// that has sent a `NOTIFY`, held through its commit's WAL flush, so
/// notifying transactions commit one at a time. A `NOTIFY` inside every
/// submit's statement made submits queue on that lock (under the e2e bench,
/// the most sampled wait event). So a store has at most one notifying
/// transaction in flight, and announcements made while one is in flight are
/// folded into the next: under load one `NOTIFY` covers many submits. A
/// woken host claims a batch, so it finds every run announced.
///
/// The notifying transaction is a submit batch's own statement when one is
/// about to be written ([`Store::carry_announcement`]): a `NOTIFY` on its own
/// is one more transaction, with its own WAL flush, and those were more
/// than a third of the e2e bench's statements. A `NOTIFY` on its own is
/// sent only for announcements that no submit carried before the batch
/// writer went idle ([`Store::flush_announcements`]), and for other work
/// (a delivered input).
#[derive(Debug, Default)]
pub(super) struct Announce {
    /// An announcement not yet covered by a sent `NOTIFY`.
    owed: AtomicBool,
    /// A task is sending.
    sending: AtomicBool,
    /// Wakes this process's dispatcher for a new run that may belong ahead
    /// of the runs in its local queue (see [`Store::ahead_signal`]).
    ahead: tokio::sync::Notify,
}

impl Store {
    /// Announces one new piece of claimable work: wakes one idle worker in
    /// this process (or leaves a permit for the next one that looks), and
    /// on PostgreSQL, when `other_hosts`, those of other hosts through
    /// `NOTIFY`. One wake-up per item: waking every idle worker would have
    /// them all run the claim statement for a single run. Best effort:
    /// workers also poll.
    pub async fn signal_work(&self, other_hosts: bool) {
        self.work.notify_one();
        if other_hosts && self.backend == Backend::Postgres {
            self.announce.owed.store(true, SeqCst);
            self.send_owed();
        }
    }

    /// Notified for each new run of this process's submits that carries a
    /// concurrency key or a priority other than 0: a run that the claim
    /// may order ahead of runs a host already holds in its local queue, so
    /// the dispatcher claims it at once rather than when the queue is half
    /// free (`pool`'s express claim). Runs of other hosts are found by the
    /// queue's next claim.
    pub fn ahead_signal(&self) -> &tokio::sync::Notify {
        &self.announce.ahead
    }

    /// PostgreSQL, before a submit statement: whether it should carry this
    /// store's `NOTIFY` (see [`Announce`]). Yes when no other notifying
    /// transaction is in flight; the statement then covers every
    /// announcement owed so far. Pair with [`Store::announcement_carried`].
    pub(crate) fn carry_announcement(&self) -> bool {
        let carry = !self.announce.sending.swap(true, SeqCst);
        if carry {
            self.announce.owed.store(false, SeqCst);
        }
        carry
    }

    /// PostgreSQL, after a submit statement that wrote new runs (`wrote`)
    /// or failed: a statement that carried the `NOTIFY` lets the next one
    /// carry it; new runs that another statement's `NOTIFY` may have missed
    /// are owed, for the next submit statement or [`Store::flush_announcements`].
    pub(crate) fn announcement_carried(&self, carried: bool, wrote: bool, failed: bool) {
        if carried {
            if failed {
                // It may have covered announcements owed before it.
                self.announce.owed.store(true, SeqCst);
            }
            self.announce.sending.store(false, SeqCst);
        } else if wrote {
            self.announce.owed.store(true, SeqCst);
        }
    }

    /// Sends a `NOTIFY` on its own for announcements that no submit
    /// statement carried. The submit batch writer calls it when it goes
    /// idle.
    pub(crate) fn flush_announcements(&self) {
        if self.announce.owed.load(SeqCst) {
            self.send_owed();
        }
    }

    /// Sends `NOTIFY`s on their own until nothing is owed, unless another
    /// notifying transaction is in flight (that one's sender, or the next
    /// submit statement, sends for what is owed then).
    fn send_owed(&self) {
        if self.announce.sending.swap(true, SeqCst) {
            return;
        }
        let store = self.clone();
        // Its own task: the caller (a submit) does not wait for the NOTIFY.
        tokio::spawn(async move {
            loop {
                while store.announce.owed.swap(false, SeqCst) {
                    let sent = sqlx::query("SELECT pg_notify($1, $2)")
                        .bind(WORK_CHANNEL)
                        .bind(&*store.node)
                        .execute(&store.pool)
                        .await;
                    if let Err(e) = sent {
                        tracing::debug!(error = %e, "NOTIFY failed; other hosts will find the work by polling");
                    }
                }
                store.announce.sending.store(false, SeqCst);
                // An announcement made after the last check whose caller
                // saw `sending` still set: take the sender's role back.
                if !store.announce.owed.load(SeqCst) || store.announce.sending.swap(true, SeqCst) {
                    return;
                }
            }
        });
    }
}
