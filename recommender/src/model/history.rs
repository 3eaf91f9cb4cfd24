//! The users' training histories as the history tower pools them (`model.user_tower`):
//! each user's items, and the inputs of `embedding_bag` for a batch's pools. It must not hold
//! parameters or tensors: [`crate::model::recommender::Recommender`] owns the history rows.

use runtime::rng::{mix, GOLDEN};

/// A history pool is the sum of its rows over its size to this power (FISM's normalisation):
/// with the history alone on real ML-100k (seed 42, softmax, dim 256, lr 3e-3, l2 1e-2), 0.5
/// gave validation NDCG@10 0.2588 and the plain sum (0) 0.2316; the mean (1), at lr 1e-3 and
/// l2 0.1, 0.2369.
pub(crate) const POOL_EXPONENT: f32 = 0.5;

/// Tags the history dropout's stream apart from the step's other draws.
const STREAM: u64 = 0x6869_7374_6f72_7921; // "history!"

/// History dropout (`model.history_dropout`): in training, each item of a sample's pool is
/// left out with probability `rate`, decided by the step's key, the sample (user, positive)
/// and the item alone, so a run is the same at any world size; the pool is then the kept
/// rows over the kept count to [`POOL_EXPONENT`]. A user seen through a random part of their
/// history each time is Mult-DAE's denoising, and what keeps the tower from memorising.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolDropout {
    pub rate: f32,
    /// A function of `run.seed` and the optimizer step ([`PoolDropout::key`]).
    pub key: u64,
}

impl PoolDropout {
    /// The key of optimizer step `step` of a run seeded `seed`.
    pub fn key(seed: u64, step: u64) -> u64 {
        mix(seed ^ STREAM ^ step.wrapping_mul(GOLDEN))
    }

    /// Whether `item` stays in the pool of the sample (`user`, `positive`).
    fn keeps(&self, user: i64, positive: i64, item: i64) -> bool {
        let h = mix(self.key ^ mix(user as u64 ^ mix(positive as u64 ^ mix(item as u64))));
        let u = (h >> 40) as f32 * (1.0 / (1u64 << 24) as f32);
        u >= self.rate
    }
}

/// Each user's training items, pooled into the user's representation by the history tower:
/// user `u`'s are `items[starts[u]..starts[u + 1]]`.
#[derive(Debug, Clone, Default)]
pub struct History {
    starts: Vec<usize>,
    items: Vec<i64>,
}

impl History {
    /// The history of every user of `train` (a list of item ids per user).
    pub fn new(train: &[Vec<u32>]) -> History {
        let mut starts = Vec::with_capacity(train.len() + 1);
        starts.push(0);
        let mut items = Vec::new();
        for list in train {
            items.extend(list.iter().map(|&i| i64::from(i)));
            starts.push(items.len());
        }
        History { starts, items }
    }

    fn of(&self, user: i64) -> &[i64] {
        let u = usize::try_from(user).unwrap_or(usize::MAX);
        match (self.starts.get(u), self.starts.get(u.wrapping_add(1))) {
            (Some(&a), Some(&b)) => &self.items[a..b],
            _ => &[], // a user without history (cold, or beyond the table)
        }
    }

    /// The number of `user`'s training items (0 for a user without history).
    pub(crate) fn len_of(&self, user: i64) -> usize {
        self.of(user).len()
    }

    /// Whether `item` is among `user`'s training items.
    pub(crate) fn contains(&self, user: i64, item: i64) -> bool {
        self.of(user).contains(&item)
    }

    /// `embedding_bag`'s inputs for the plain sums of `users`' rows: the items and where each
    /// user's start.
    pub(crate) fn sums(&self, users: &[i64]) -> (Vec<i64>, Vec<i64>) {
        let (mut items, mut starts) = (Vec::new(), Vec::new());
        for &u in users {
            starts.push(items.len() as i64);
            items.extend_from_slice(self.of(u));
        }
        (items, starts)
    }

    /// `embedding_bag`'s inputs for the pools of `users`: the items, where each user's rows
    /// start, and each item's weight (the pool's size to the power -[`POOL_EXPONENT`]),
    /// `leave_out[k]` weighing nothing in row `k`'s pool, nor (in training, with `leave_out`)
    /// the items `dropout` drops from that sample's pool.
    pub(crate) fn bag(
        &self,
        users: &[i64],
        leave_out: Option<&[i64]>,
        dropout: Option<PoolDropout>,
    ) -> (Vec<i64>, Vec<i64>, Vec<f32>) {
        let (mut items, mut starts, mut weights) = (Vec::new(), Vec::new(), Vec::new());
        for (k, &u) in users.iter().enumerate() {
            starts.push(items.len() as i64);
            let list = self.of(u);
            let out = leave_out.and_then(|l| l.get(k)).copied();
            let keep = |i: i64| match (out, dropout) {
                (Some(o), _) if o == i => false,
                (Some(o), Some(d)) => d.keeps(u, o, i),
                _ => true,
            };
            let first = weights.len();
            weights.extend(list.iter().map(|&i| if keep(i) { 1.0 } else { 0.0 }));
            let kept = weights[first..].iter().filter(|&&w| w > 0.0).count();
            if kept > 0 {
                let w = (kept as f32).powf(-POOL_EXPONENT);
                weights[first..].iter_mut().for_each(|x| *x *= w);
            }
            items.extend_from_slice(list);
        }
        (items, starts, weights)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bag_weighs_each_pool_by_its_size_and_leaves_the_positive_out() {
        let h = History::new(&[vec![0, 2, 5], vec![1], vec![]]);
        let (items, starts, weights) = h.bag(&[0, 1, 2, 9], None, None);
        assert_eq!(items, [0, 2, 5, 1]);
        assert_eq!(
            starts,
            [0, 3, 4, 4],
            "an empty or unknown user's pool is empty"
        );
        let third = 1.0 / 3f32.sqrt();
        assert_eq!(weights, [third, third, third, 1.0]);
        // User 0's positive 2 weighs nothing in its row only; user 1's only item leaves nothing.
        let (_, _, weights) = h.bag(&[0, 0, 1], Some(&[2, 7, 1]), None);
        let half = 1.0 / 2f32.sqrt();
        assert_eq!(weights, [half, 0.0, half, third, third, third, 0.0]);
    }

    #[test]
    fn dropout_leaves_out_a_share_of_a_training_pool_the_same_for_the_same_key() {
        let list: Vec<u32> = (0..400).collect();
        let h = History::new(&[list]);
        let d = PoolDropout {
            rate: 0.25,
            key: PoolDropout::key(42, 3),
        };
        let (_, _, weights) = h.bag(&[0], Some(&[7]), Some(d));
        let kept = weights.iter().filter(|&&w| w > 0.0).count();
        assert!((270..330).contains(&kept), "kept {kept} of 399");
        assert_eq!(weights[7], 0.0, "the positive is always out");
        let w = (kept as f32).powf(-0.5);
        assert!(weights.iter().all(|&x| x == 0.0 || x == w));
        assert_eq!((h.bag(&[0], Some(&[7]), Some(d))).2, weights, "same key");
        let other = PoolDropout {
            key: PoolDropout::key(42, 4),
            ..d
        };
        assert_ne!(h.bag(&[0], Some(&[7]), Some(other)).2, weights);
        // Evaluation (no positive left out) pools the whole history whatever the dropout.
        let (_, _, all) = h.bag(&[0], None, Some(d));
        assert!(all.iter().all(|&x| x == 0.05));
    }
}
