//! The guest's WASI random numbers, seeded from the run's secret.

use sha2::{Digest, Sha256};

/// The guest's WASI random: secure and insecure generators and the
/// insecure seed, all from the run's secret (the same on every replay, and
/// unknown outside the database). A run from before secrets existed keeps
/// the seed it started with: its run id.
pub(super) fn seeded_random(secret: Option<&str>, run_id: i64) -> (rand010::rngs::StdRng, rand010::rngs::StdRng, u128) {
    use rand010::SeedableRng;
    let seed = |stream: u8| -> [u8; 32] {
        match secret {
            Some(secret) => {
                let mut h = Sha256::new();
                h.update(secret.as_bytes());
                h.update([stream]);
                h.finalize().into()
            }
            None => {
                let mut bytes = [0u8; 32];
                let v = (run_id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ u64::from(stream);
                bytes[..8].copy_from_slice(&v.to_le_bytes());
                bytes
            }
        }
    };
    let insecure_seed = u128::from_le_bytes(seed(3)[..16].try_into().unwrap_or([0; 16]));
    let legacy = |stream: u64| rand010::rngs::StdRng::seed_from_u64((run_id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ stream);
    match secret {
        Some(_) => (rand010::rngs::StdRng::from_seed(seed(1)), rand010::rngs::StdRng::from_seed(seed(2)), insecure_seed),
        None => (legacy(1), legacy(2), run_id as u128),
    }
}
