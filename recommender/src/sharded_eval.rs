//! Full-ranking evaluation across ranks: users split over the ranks, their metric sums gathered
//! and added in rank order, so every rank returns the metrics a single process would; and the
//! popularity baseline through the same path.

use std::time::Duration;

use dist::collective::{Collective, OpContext};
use tch::{Device, Kind, Tensor};

use crate::data::Dataset;
use crate::eval::{add_user, MetricSums, Metrics};
use crate::input::RecData;
use crate::model::recommender::popularity_scores;
use crate::{RecError, Split};

/// The popularity baseline's metrics on `split`, through the same sharded evaluation.
pub fn evaluate_popularity(
    data: &RecData,
    split: Split,
    ks: &[usize],
    batch_users: usize,
    comm: &mut dyn Collective,
    ctx: OpContext,
) -> Result<Metrics, RecError> {
    let ds = &data.dataset;
    let counts = Tensor::from_slice(&popularity_scores(&ds.train, ds.n_items as usize));
    let mut score = |batch: &[usize]| -> Result<Tensor, tch::TchError> {
        Ok(counts.unsqueeze(0).expand([batch.len() as i64, -1], false))
    };
    let train_valid: Vec<Vec<u32>>;
    let (exclude, positives) = match split {
        Split::Valid => (&ds.train, &ds.valid),
        Split::Test => {
            train_valid = train_and_valid(ds);
            (&train_valid, &ds.test)
        }
    };
    evaluate_sharded(&mut score, exclude, positives, ks, batch_users, comm, ctx)
}

/// Train ∪ valid per user, sorted: what a test ranking excludes.
pub(crate) fn train_and_valid(ds: &Dataset) -> Vec<Vec<u32>> {
    ds.train
        .iter()
        .zip(&ds.valid)
        .map(|(t, v)| {
            let mut both: Vec<u32> = t.iter().chain(v).copied().collect();
            both.sort_unstable();
            both
        })
        .collect()
}

/// Full-ranking metrics with users split across ranks: this rank scores the users `u` with
/// `u % world == rank` (and at least one positive), `batch_users` at a time (`score_batch` gives
/// `[b, n_items]`); the per-rank sums travel as f64 and are added in rank order, so every rank
/// returns the same metrics, equal to a single-process evaluation up to summation order.
pub fn evaluate_sharded(
    score_batch: &mut dyn FnMut(&[usize]) -> Result<Tensor, tch::TchError>,
    exclude: &[Vec<u32>],
    positives: &[Vec<u32>],
    ks: &[usize],
    batch_users: usize,
    comm: &mut dyn Collective,
    ctx: OpContext,
) -> Result<Metrics, RecError> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let users: Vec<usize> = (0..positives.len())
        .filter(|&u| u % world == rank && !positives[u].is_empty())
        .collect();
    let mut sums = MetricSums::new(ks);
    for chunk in users.chunks(batch_users.max(1)) {
        let scores = score_batch(chunk)?
            .f_to_device(Device::Cpu)?
            .f_to_kind(Kind::Float)?
            .f_contiguous()?;
        let n = scores.size().get(1).copied().unwrap_or(0) as usize;
        let flat = Vec::<f32>::try_from(scores.f_view([-1])?)?;
        for (row, &u) in chunk.iter().enumerate() {
            let mut s = flat[row * n..(row + 1) * n].to_vec();
            let ex = exclude.get(u).map_or(&[][..], Vec::as_slice);
            add_user(&mut sums, &mut s, ex, &positives[u]);
        }
    }
    let mine = Tensor::from_slice(&sums.to_vec());
    let gathered = comm.all_gather(&mine, ctx)?;
    let mut total = MetricSums::new(ks);
    for part in gathered {
        let v = Vec::<f64>::try_from(part.f_to_device(Device::Cpu)?)?;
        total.merge(&MetricSums::from_vec(ks, &v)?)?;
    }
    Ok(total.means())
}

/// Evaluation can take longer than a training collective: scoring every user.
pub const EVAL_TIMEOUT_MIN: Duration = Duration::from_secs(600);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eval::evaluate_all;
    use dist::collective::tcp::test_ring::with_ring;

    const CTX: OpContext = OpContext {
        step: 0,
        timeout: Duration::from_secs(20),
    };

    /// A deterministic, tie-free score table.
    fn score_of(u: usize, i: usize) -> f32 {
        (((u * 7919 + i * 104_729) % 1009) as f32) / 1009.0 + i as f32 * 1e-7
    }

    #[test]
    fn sharded_evaluation_equals_a_single_process_one() {
        let n_users = 53;
        let n_items = 40;
        let mut state = 7u64;
        let mut lists = |max: u64| -> Vec<Vec<u32>> {
            (0..n_users)
                .map(|_| {
                    let k = dist::rng::splitmix64(&mut state) % max;
                    let mut v: Vec<u32> = (0..k)
                        .map(|_| (dist::rng::splitmix64(&mut state) % n_items as u64) as u32)
                        .collect();
                    v.sort_unstable();
                    v.dedup();
                    v
                })
                .collect()
        };
        let exclude = lists(8);
        let positives = lists(5);
        let ks = vec![1, 5, 10];
        let users: Vec<usize> = (0..n_users).collect();
        let direct = evaluate_all(
            |u| (0..n_items).map(|i| score_of(u, i)).collect(),
            &users,
            &exclude,
            &positives,
            &ks,
        )
        .means();
        assert!(direct.users > 10);
        for world in [1u32, 2, 3] {
            let (ex, pos, k) = (exclude.clone(), positives.clone(), ks.clone());
            let results = with_ring(world, move |_, comm| {
                let mut score = |batch: &[usize]| -> Result<Tensor, tch::TchError> {
                    let rows: Vec<f32> = batch
                        .iter()
                        .flat_map(|&u| (0..n_items).map(move |i| score_of(u, i)))
                        .collect();
                    Ok(Tensor::from_slice(&rows).view([batch.len() as i64, n_items as i64]))
                };
                evaluate_sharded(&mut score, &ex, &pos, &k, 4, comm, CTX).unwrap()
            });
            for m in results {
                assert_eq!(m.users, direct.users, "world {world}");
                for name in ["recall@5", "ndcg@10", "mrr@1", "hit@5", "precision@10"] {
                    let (a, b) = (m.get(name).unwrap(), direct.get(name).unwrap());
                    assert!((a - b).abs() < 1e-12, "world {world} {name}: {a} vs {b}");
                }
            }
        }
    }
}
