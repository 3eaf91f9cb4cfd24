//! The small deterministic generator every part of the worker shares: SplitMix64 (Steele, Lea &
//! Flood; the seeding generator of xoshiro), bit-identical on every platform. The sampler, the
//! synthetic data, GPT-2's dropout seeds and the trainer's per-step seeds all derive from it.

/// The golden-ratio increment of SplitMix64's counter.
pub const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function: a bijective mix of 64 bits.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// SplitMix64: advances `state` and returns the next 64-bit output.
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(GOLDEN);
    mix(*state)
}

#[cfg(test)]
mod tests {
    #[test]
    fn matches_the_reference_outputs() {
        // The first outputs of SplitMix64 seeded with 1234567 (Vigna's reference code).
        let mut s = 1_234_567u64;
        let out: Vec<u64> = (0..3).map(|_| super::splitmix64(&mut s)).collect();
        assert_eq!(
            out,
            [
                6457827717110365317,
                3203168211198807973,
                9817491932198370423
            ]
        );
    }
}
