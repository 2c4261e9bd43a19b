//! How many runs the dispatcher's next claim asks for. It starts at
//! `claim_batch` and doubles after each claim that came back full (the
//! backlog had at least that many), up to [`GROWN_MAX`]; a claim that
//! came back short (the backlog is drained, or nearly) sets it back. So a
//! deep backlog is taken in claims of hundreds, filling the local queue
//! in one statement, while a quiet host's claims stay small and a run
//! submitted to it starts at once (a claim takes what there is).
//!
//! Claims of keyed runs stay at `claim_batch`: keys take turns in the
//! claim, and a key's new run would wait out a claim of hundreds.
//!
//! A claim never asks for more than its free slots and the room in the
//! local queue, whatever its size (`dispatch`), so a grown claim never
//! holds more runs on this host than a small one would.

/// The most a claim grows to: 256. `bench drain` (no-op turns, 64
/// workers, a local queue of 256, PostgreSQL, closes of up to 256),
/// alternating: claims of 256 drained 6,901, 7,974, 7,793 and 6,925
/// runs/s where claims of 64 drained 6,570, 5,972, 5,492 and 6,460.
pub(crate) const GROWN_MAX: usize = 256;

/// The size of the next claim.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClaimSize {
    base: usize,
    now: usize,
}

impl ClaimSize {
    /// Starts at `base` (at least 1).
    pub(crate) fn new(base: usize) -> ClaimSize {
        let base = base.max(1);
        ClaimSize { base, now: base }
    }

    /// Runs the next claim may ask for.
    pub(crate) fn get(&self) -> usize {
        self.now
    }

    /// A claim that asked for `asked` took `got`, `keyed` if any of them
    /// has a concurrency key. Only a claim that asked for its whole size
    /// grows it: one capped by the free slots and the queue's room says
    /// nothing of the backlog beyond them. A keyed claim sets it back:
    /// keys take turns in the claim, and a key's new run waited out
    /// claims of hundreds (`bench fairness`, PostgreSQL: the small key's
    /// p99 beside the backlog 36–57 ms in eight runs with them, 24–39 ms
    /// in ten without).
    pub(crate) fn claimed(&mut self, asked: usize, got: usize, keyed: bool) {
        if got < asked || keyed {
            self.now = self.base;
        } else if asked >= self.now {
            self.now = (self.now * 2).min(GROWN_MAX.max(self.base));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_claims_double_the_size_up_to_the_cap_and_a_short_one_sets_it_back() {
        let mut size = ClaimSize::new(16);
        let mut seen = vec![size.get()];
        for _ in 0..6 {
            size.claimed(size.get(), size.get(), false);
            seen.push(size.get());
        }
        assert_eq!(seen, [16, 32, 64, 128, 256, 256, 256]);
        size.claimed(256, 10, false);
        assert_eq!(size.get(), 16);
    }

    #[test]
    fn a_claim_capped_by_the_room_does_not_grow_the_size() {
        let mut size = ClaimSize::new(64);
        size.claimed(3, 3, false);
        assert_eq!(size.get(), 64);
    }

    #[test]
    fn a_claim_of_keyed_runs_sets_the_size_back() {
        let mut size = ClaimSize::new(16);
        size.claimed(16, 16, false);
        assert_eq!(size.get(), 32);
        size.claimed(32, 32, true);
        assert_eq!(size.get(), 16);
    }

    #[test]
    fn a_base_above_the_cap_is_kept() {
        let mut size = ClaimSize::new(500);
        size.claimed(500, 500, false);
        assert_eq!(size.get(), 500);
        assert_eq!(ClaimSize::new(0).get(), 1);
    }
}
