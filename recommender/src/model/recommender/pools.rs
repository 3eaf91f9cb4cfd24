//! What the recommender pools over a user's training history: the history tower's rows
//! (`model.user_tower`), and the item-item matrix's rows (`model.item_item`), which give each
//! item a score of its own added to the model's. Both pool the same items with the same
//! weights ([`crate::model::history::History::bag`]). It must not own parameters: the
//! [`Recommender`] does.
//!
//! The item-item term is EASE's form (a user's scores are their history times an items x items
//! matrix) trained by the model's loss beside the low-rank pool, instead of fitted in closed
//! form: on real ML-100k a low-rank pool alone stays below EASE on test (docs/figures.md).

use tch::{nn, Kind, Tensor};

use super::Recommender;
use crate::model::history::POOL_EXPONENT;

impl Recommender {
    /// The pooled history rows [b, dim] of `users` (on the host: training gives them so; else
    /// read from the device) on the model's device, `leave_out[k]` left out of row `k`'s pool;
    /// a cold user's is the average warm user's (as a cold user's ID row is: it carries the
    /// popular taste). `None` without a history tower.
    pub(super) fn history_pool(
        &self,
        users: &Tensor,
        leave_out: Option<&Tensor>,
    ) -> Option<Tensor> {
        let table = self.history_item.as_ref()?;
        Some(self.pool_of(table, users, leave_out))
    }

    /// The item-item scores [b, n_items] of `users`, pooled as [`Recommender::history_pool`]
    /// pools; `None` without the item-item matrix.
    pub(super) fn item_scores(&self, users: &Tensor, leave_out: Option<&Tensor>) -> Option<Tensor> {
        let table = self.item_item.as_ref()?;
        let host = |t: &Tensor| Vec::<i64>::try_from(t.to_device(tch::Device::Cpu)).ok();
        let warm = self.config.n_warm_users;
        if let (Some(u), Some(out), None) =
            (host(users), leave_out.and_then(host), self.pool_dropout)
        {
            if u.iter().all(|&u| u < warm) {
                return Some(self.item_scores_by_user(table, &u, &out));
            }
        }
        Some(self.pool_of(table, users, leave_out))
    }

    /// A training batch's item-item scores with each distinct user's rows summed once: a
    /// sample's pool is its user's sum less the positive's row, over the rest's count to the
    /// pool's exponent (as [`crate::model::history::History::bag`] weighs it). The matrix's
    /// rows are as wide as the catalogue, so summing them once per user instead of once per
    /// sample is most of the term's cost (users recur within a batch).
    fn item_scores_by_user(
        &self,
        table: &nn::Embedding,
        users: &[i64],
        positives: &[i64],
    ) -> Tensor {
        let mut index = std::collections::HashMap::new();
        let mut distinct = Vec::new();
        let rows: Vec<i64> = users
            .iter()
            .map(|&u| {
                *index.entry(u).or_insert_with(|| {
                    distinct.push(u);
                    distinct.len() as i64 - 1
                })
            })
            .collect();
        let (items, starts) = self.history.sums(&distinct);
        // Per sample: whether its positive is in the pool (1 or 0), and the pool's weight.
        let (has, weight): (Vec<f32>, Vec<f32>) = users
            .iter()
            .zip(positives)
            .map(|(&u, &p)| {
                let has = self.history.contains(u, p);
                let kept = self.history.len_of(u) - usize::from(has);
                let weight = match kept {
                    0 => 0.0,
                    k => (k as f32).powf(-POOL_EXPONENT),
                };
                (f32::from(u8::from(has)), weight)
            })
            .unzip();
        let on = |t: Tensor| runtime::host_read::to_device(&t, table.ws.device());
        let column = |v: &[f32]| on(Tensor::from_slice(v)).unsqueeze(1);
        let sums =
            bag_sum(table, &items, &starts, None).index_select(0, &on(Tensor::from_slice(&rows)));
        let positive_rows = table.ws.index_select(0, &on(Tensor::from_slice(positives)));
        (sums - positive_rows * column(&has)) * column(&weight)
    }

    /// The average warm user's item-item scores [1, n_items] (a cold user's), or `None`.
    pub(super) fn average_item_scores(&self) -> Option<Tensor> {
        let table = self.item_item.as_ref()?;
        (self.config.n_warm_users > 0).then(|| self.average_pool(table))
    }

    /// The pools of `table`'s rows for `users`, cold users given the average warm user's.
    pub(super) fn pool_of(
        &self,
        table: &nn::Embedding,
        users: &Tensor,
        leave_out: Option<&Tensor>,
    ) -> Tensor {
        let host = |t: &Tensor| Vec::<i64>::try_from(t.to_device(tch::Device::Cpu)).ok();
        let users = host(users).unwrap_or_default();
        let leave_out = leave_out.and_then(host);
        let pooled = self.pools(table, &users, leave_out.as_deref());
        let warm = self.config.n_warm_users;
        if warm == 0 || users.iter().all(|&u| u < warm) {
            return pooled;
        }
        let cold: Vec<bool> = users.iter().map(|&u| u >= warm).collect();
        let cold = runtime::host_read::to_device(&Tensor::from_slice(&cold), pooled.device());
        let average = self.average_pool(table);
        average
            .expand_as(&pooled)
            .where_self(&cold.unsqueeze(-1), &pooled)
    }

    /// The mean of every warm user's pool of `table` [1, width].
    pub(super) fn average_pool(&self, table: &nn::Embedding) -> Tensor {
        let warm: Vec<i64> = (0..self.config.n_warm_users).collect();
        self.pools(table, &warm, None)
            .mean_dim([0i64].as_slice(), true, Kind::Float)
    }

    /// The pools [b, width] of `users`, `leave_out[k]` left out of row `k`'s.
    fn pools(&self, table: &nn::Embedding, users: &[i64], leave_out: Option<&[i64]>) -> Tensor {
        let (items, starts, weights) = self.history.bag(users, leave_out, self.pool_dropout);
        bag_sum(table, &items, &starts, Some(&weights))
    }
}

/// `embedding_bag`'s sums [bags, width] of `table`'s rows `items`, bag `k` from `starts[k]`, each
/// row weighed by `weights` when given.
fn bag_sum(
    table: &nn::Embedding,
    items: &[i64],
    starts: &[i64],
    weights: Option<&[f32]>,
) -> Tensor {
    let device = table.ws.device();
    let on = |t: Tensor| runtime::host_read::to_device(&t, device);
    let (sums, _, _, _) = Tensor::embedding_bag(
        &table.ws,
        &on(Tensor::from_slice(items)),
        &on(Tensor::from_slice(starts)),
        false,
        0, // the sum of the (weighted) rows
        false,
        weights.map(|w| on(Tensor::from_slice(w))),
        false,
    );
    sums
}
