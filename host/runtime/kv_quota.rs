//! A plugin's kv quota, checked at each `kv.put` (see
//! [`crate::store::KvQuota`]). A put is held for the segment's next write,
//! so the stored usage lags this segment's own puts: the check adds every
//! put made since it last read the usage, as if each were a new key. Only
//! when that estimate is over the quota does the segment write what it
//! holds and read the usage again, with the key's own stored size, and
//! decide exactly. So a refusal is exact, and a put under the quota costs
//! no extra read. The estimate starts from the host's last read of the
//! namespace if it is under a second old (`Store::kv_seen`, which counts
//! every put of the host's segments since), else from a read of its own.
//! Runs of one plugin running at once, on other hosts especially, may
//! together pass the quota by what they put between two reads.

use crate::effects::EffectError;
use crate::store::{KvQuota, KvRoom, KvUsage};

/// What a segment knows of its plugin's kv usage.
#[derive(Debug, Default)]
pub(super) struct KvQuotaState {
    /// The usage as last read; `None` before the segment's first put.
    read: Option<KvUsage>,
    /// This segment's puts since then, each counted as a new key.
    since: KvUsage,
}

impl KvQuotaState {
    /// Whether a put of `size` bytes (key and value) fits by the estimate;
    /// if so, it is counted. `false`: read the usage and [`Self::decide`].
    /// `seen`: where an estimate may start without a read of its own (the
    /// host's recent read), asked only before the segment has one.
    pub(super) fn fits_estimate(&mut self, quota: &KvQuota, size: i64, seen: impl FnOnce() -> Option<KvUsage>) -> bool {
        if self.read.is_none() {
            self.read = seen();
        }
        let Some(read) = self.read else { return false };
        let (keys, bytes) = (read.keys + self.since.keys + 1, read.bytes + self.since.bytes + size);
        if keys > quota.max_keys as i64 || bytes > quota.max_bytes as i64 {
            return false;
        }
        self.since = KvUsage { keys: self.since.keys + 1, bytes: self.since.bytes + size };
        true
    }

    /// Decides a put of `size` bytes exactly from `room`, read after the
    /// segment wrote the puts it held; counts it if it fits, and otherwise
    /// says why it is refused.
    pub(super) fn decide(&mut self, quota: &KvQuota, room: KvRoom, size: i64, namespace: &str) -> Result<(), EffectError> {
        let KvRoom { usage, stored } = room;
        *self = KvQuotaState { read: Some(usage), since: KvUsage::default() };
        let keys = usage.keys + i64::from(stored.is_none());
        let bytes = usage.bytes - stored.unwrap_or(0) + size;
        let (max_keys, max_bytes) = (quota.max_keys as i64, quota.max_bytes as i64);
        if keys > max_keys || bytes > max_bytes {
            return Err(EffectError::Denied(format!(
                "kv.put: plugin {namespace:?}'s kv would hold {bytes} bytes in {keys} keys; its quota is {max_bytes} bytes in {max_keys} keys"
            )));
        }
        self.since = KvUsage { keys: i64::from(stored.is_none()), bytes: size - stored.unwrap_or(0) };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_estimate_over_the_quota_asks_for_an_exact_read_that_may_still_allow_the_put() {
        let quota = KvQuota { max_keys: 2, max_bytes: 100 };
        let mut state = KvQuotaState::default();
        assert!(!state.fits_estimate(&quota, 10, || None), "the first put reads the usage");
        let room = KvRoom { usage: KvUsage { keys: 1, bytes: 60 }, stored: Some(60) };
        assert!(state.decide(&quota, room, 90, "p").is_ok(), "overwriting the one key with 90 bytes fits");
        // Estimated as a second key of 20: 2 keys, 60 + 30 + 20 > 100 bytes.
        assert!(!state.fits_estimate(&quota, 20, || None));
        let room = KvRoom { usage: KvUsage { keys: 1, bytes: 90 }, stored: None };
        assert!(state.decide(&quota, room, 20, "p").is_err(), "a new key of 20 bytes is over 100");
        let room = KvRoom { usage: KvUsage { keys: 1, bytes: 90 }, stored: None };
        assert!(state.decide(&quota, room, 10, "p").is_ok());
        assert!(!state.fits_estimate(&quota, 1, || None), "a third key is over 2 keys");
    }
}
