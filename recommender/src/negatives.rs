//! The negatives of the softmax loss (`train.loss = "softmax"`): the items every positive of
//! one optimizer step is ranked against, drawn once per step from `run.seed` and the step
//! alone, so every rank and every micro-batch of the step shares them and a run is the same at
//! any world size; or every warm item (the full softmax). With each drawn item comes the log of
//! its expected count among the draws, for the logQ correction.
//!
//! It must not score, compute a loss or touch tensors: [`crate::task::RecTask`] turns the ids
//! into representations.

use runtime::rng::{mix, splitmix64, GOLDEN};

/// Tags this generator's stream apart from the trainer's other per-step draws.
const STREAM: u64 = 0x6e65_6761_7469_7665; // "negative"

/// Where a step's negatives come from.
#[derive(Debug, Clone)]
pub struct NegativeSampler {
    /// Draws per step; `0` means every warm item.
    draws: u32,
    /// Warm items (ids `0..n_warm`): the only ones training may rank against.
    n_warm: u32,
    /// Cumulative probability of items `0..=j` (empty when drawing uniformly or taking all).
    cdf: Vec<f64>,
    /// `ln(draws * q_j)` for every warm item `j` (empty when taking all: no correction).
    log_expected: Vec<f32>,
    seed: u64,
}

impl NegativeSampler {
    /// `draws` items a step (0: all warm items), item `j` drawn with probability proportional
    /// to `(count_j + 1)^power`, its count the training interactions in `train` (a list of item
    /// ids per user).
    pub fn new(train: &[Vec<u32>], n_warm: u32, draws: u32, power: f64, seed: u64) -> Self {
        let n = n_warm as usize;
        let (mut cdf, mut log_expected) = (Vec::new(), Vec::new());
        if draws > 0 && n > 0 {
            let mut weight = vec![1.0f64; n];
            if power != 0.0 {
                for &item in train.iter().flatten() {
                    if let Some(w) = weight.get_mut(item as usize) {
                        *w += 1.0;
                    }
                }
                weight.iter_mut().for_each(|w| *w = w.powf(power));
            }
            let total: f64 = weight.iter().sum();
            log_expected = weight
                .iter()
                .map(|w| (f64::from(draws) * w / total).ln() as f32)
                .collect();
            if power != 0.0 {
                let mut acc = 0.0;
                cdf = weight
                    .iter()
                    .map(|w| {
                        acc += w / total;
                        acc
                    })
                    .collect();
            }
        }
        NegativeSampler {
            draws,
            n_warm,
            cdf,
            log_expected,
            seed,
        }
    }

    /// Whether every warm item is a negative (the full softmax).
    pub fn takes_all(&self) -> bool {
        self.draws == 0
    }

    /// `ln(expected count)` of every warm item among a step's draws, for the logQ correction;
    /// `None` for the full softmax (nothing drawn, nothing to correct).
    pub fn log_expected(&self) -> Option<&[f32]> {
        (!self.takes_all()).then_some(self.log_expected.as_slice())
    }

    /// The negatives of optimizer step `step` (with repeats, as independent draws give them):
    /// a function of the seed and the step alone.
    pub fn draw(&self, step: u64) -> Vec<i64> {
        if self.takes_all() || self.n_warm == 0 {
            return (0..i64::from(self.n_warm)).collect();
        }
        let mut state = mix(self.seed ^ STREAM ^ step.wrapping_mul(GOLDEN));
        (0..self.draws)
            .map(|_| {
                let x = splitmix64(&mut state);
                let item = if self.cdf.is_empty() {
                    ((u128::from(x) * u128::from(self.n_warm)) >> 64) as usize
                } else {
                    let u = (x >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
                    // Rounding may leave the last sum a hair under 1: clamp to the last item.
                    self.cdf
                        .partition_point(|&c| c <= u)
                        .min(self.cdf.len() - 1)
                };
                item as i64
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn train() -> Vec<Vec<u32>> {
        // Item 0 rated by every user, item 3 by none; items 4 and 5 are cold (not warm).
        vec![vec![0, 1], vec![0, 2], vec![0, 1, 2], vec![0]]
    }

    #[test]
    fn a_step_draws_the_same_items_whoever_asks_and_another_step_others() {
        let s = NegativeSampler::new(&train(), 4, 64, 0.0, 42);
        let again = NegativeSampler::new(&train(), 4, 64, 0.0, 42);
        assert_eq!(s.draw(7), again.draw(7));
        assert_eq!(s.draw(7).len(), 64);
        assert_ne!(s.draw(7), s.draw(8));
        assert_ne!(
            s.draw(7),
            NegativeSampler::new(&train(), 4, 64, 0.0, 43).draw(7)
        );
        // Only warm items, every one of them in 64 draws of 4.
        let mut seen = s.draw(7);
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen, [0, 1, 2, 3]);
    }

    #[test]
    fn popular_items_are_drawn_as_often_as_their_weight_says() {
        // Weights (count + 1)^1: 5, 3, 3, 1 of 12.
        let s = NegativeSampler::new(&train(), 4, 1000, 1.0, 1);
        let mut counts = [0usize; 4];
        for step in 0..60 {
            for i in s.draw(step) {
                counts[i as usize] += 1;
            }
        }
        let total = 60_000.0;
        for (item, weight) in [5.0, 3.0, 3.0, 1.0].iter().enumerate() {
            let share = counts[item] as f64 / total;
            assert!((share - weight / 12.0).abs() < 0.01, "item {item}: {share}");
        }
        let log = s.log_expected().unwrap();
        assert!((f64::from(log[0]) - (1000.0 * 5.0 / 12.0f64).ln()).abs() < 1e-4);
        assert!((f64::from(log[3]) - (1000.0 / 12.0f64).ln()).abs() < 1e-4);
    }

    #[test]
    fn uniform_draws_have_one_correction_and_zero_draws_take_every_warm_item() {
        let s = NegativeSampler::new(&train(), 4, 8, 0.0, 1);
        let log = s.log_expected().unwrap();
        assert!(
            log.iter().all(|&l| (l - 2.0f32.ln()).abs() < 1e-6),
            "{log:?}"
        );
        let all = NegativeSampler::new(&train(), 4, 0, 0.0, 1);
        assert!(all.takes_all() && all.log_expected().is_none());
        assert_eq!(all.draw(3), [0, 1, 2, 3]);
    }
}
