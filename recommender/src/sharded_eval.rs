//! Full-ranking evaluation across ranks: users split over the ranks, their metric sums gathered
//! and added in rank order, so every rank returns the metrics a single process would; the
//! tables' text encoding shared out the same way; and the popularity and EASE baselines through
//! the same path.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use runtime::collective::{Collective, OpContext};
use tch::{Device, Kind, Tensor};

use crate::data::Dataset;
use crate::eval::{add_user, MetricSums, Metrics, UserMetrics};
use crate::input::RecData;
use crate::model::recommender::{popularity_scores, TextChunks};
use crate::{RecError, Split};

/// A baseline evaluated beside the model.
pub enum Baseline<'a> {
    /// Items ranked by their training count.
    Popularity,
    /// A fitted EASE model: warm items scored from a user's training items.
    Ease(&'a crate::ease::Ease),
}

/// `baseline`'s metrics on `split`, through the same sharded evaluation as the model's.
pub fn evaluate_baseline(
    data: &RecData,
    baseline: Baseline<'_>,
    split: Split,
    ks: &[usize],
    batch_users: usize,
    comm: &mut dyn Collective,
    ctx: OpContext,
) -> Result<Metrics, RecError> {
    let ds = &data.dataset;
    type Score<'s> = Box<dyn FnMut(&[usize]) -> Result<Tensor, tch::TchError> + 's>;
    let mut score: Score<'_> = match baseline {
        Baseline::Popularity => {
            let counts = Tensor::from_slice(&popularity_scores(&ds.train, ds.n_items as usize));
            Box::new(move |batch| Ok(counts.unsqueeze(0).expand([batch.len() as i64, -1], false)))
        }
        Baseline::Ease(ease) => Box::new(move |batch| ease.scores(batch, &ds.train)),
    };
    let train_valid = match split {
        Split::Test => train_and_valid(ds),
        _ => Vec::new(),
    };
    let lists = split_lists(ds, &train_valid, split);
    evaluate_sharded(&mut *score, &lists, ks, batch_users, comm, ctx)
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

/// What an evaluation ranks: the candidate items (dense ids), per user the items not to rank
/// and the held-out positives (ids within the candidates).
pub struct SplitLists<'a> {
    pub candidates: Range<u32>,
    pub exclude: &'a [Vec<u32>],
    pub positives: &'a [Vec<u32>],
}

/// The lists of `split`: warm splits rank the warm items (cold ones are no candidates: no user
/// has them in valid or test), excluding what the user trained on (and for test, validated
/// on); cold items are ranked among themselves, and cold users get the warm items, both
/// excluding nothing (training saw none of those interactions).
pub(crate) fn split_lists<'a>(
    ds: &'a Dataset,
    train_valid: &'a [Vec<u32>],
    split: Split,
) -> SplitLists<'a> {
    let warm = 0..ds.n_warm_items;
    let (candidates, exclude, positives) = match split {
        Split::Valid => (warm, &ds.train[..], &ds.valid),
        Split::Test => (warm, train_valid, &ds.test),
        Split::ColdItems => (ds.n_warm_items..ds.n_items, &[][..], &ds.cold_items),
        Split::ColdUsers => (warm, &[][..], &ds.cold_users),
    };
    SplitLists {
        candidates,
        exclude,
        positives,
    }
}

/// Ids of `ids` within `range`, shifted to start at 0.
fn within(ids: &[u32], range: &Range<u32>) -> Vec<u32> {
    ids.iter()
        .filter(|i| range.contains(i))
        .map(|i| i - range.start)
        .collect()
}

/// Full-ranking metrics with users split across ranks: this rank scores the users `u` with
/// `u % world == rank` (and at least one positive), `batch_users` at a time (`score_batch` gives
/// `[b, n_items]`, of which the candidates are ranked); the per-rank sums travel as f64 and are
/// added in rank order, so every rank returns the same metrics, equal to a single-process
/// evaluation up to summation order.
pub fn evaluate_sharded(
    score_batch: &mut dyn FnMut(&[usize]) -> Result<Tensor, tch::TchError>,
    lists: &SplitLists<'_>,
    ks: &[usize],
    batch_users: usize,
    comm: &mut dyn Collective,
    ctx: OpContext,
) -> Result<Metrics, RecError> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let positives = lists.positives;
    let users: Vec<usize> = (0..positives.len())
        .filter(|&u| u % world == rank && !positives[u].is_empty())
        .collect();
    let range = &lists.candidates;
    let (from, len) = (range.start as usize, range.len());
    let mut sums = MetricSums::new(ks);
    // Each user's row at slot `u / world` of this rank's part (users go to ranks by `u % world`),
    // NaN for users not evaluated: one gather gives every rank every user's row.
    let width = UserMetrics::width(ks);
    let slots = positives.len().div_ceil(world);
    let mut rows = vec![f64::NAN; slots * width];
    for chunk in users.chunks(batch_users.max(1)) {
        let scores = score_batch(chunk)?
            .f_to_device(Device::Cpu)?
            .f_to_kind(Kind::Float)?
            .f_contiguous()?;
        let n = scores.size().get(1).copied().unwrap_or(0) as usize;
        if from + len > n {
            return Err(RecError::Invalid(format!(
                "evaluation: {n} item scores for candidates {range:?}"
            )));
        }
        let flat = Vec::<f32>::try_from(scores.f_view([-1])?)?;
        // A NaN ranks nowhere in particular: metrics of such scores would be reported as if
        // they measured something.
        if let Some(at) = flat.iter().position(|v| !v.is_finite()) {
            return Err(RecError::Invalid(format!(
                "evaluation: user {}'s score of item {} is {} (not finite): the model's parameters are not finite (a diverged run, or an edited checkpoint); no metrics are reported",
                chunk[at / n.max(1)],
                at % n.max(1),
                flat[at]
            )));
        }
        for (row, &u) in chunk.iter().enumerate() {
            let mut s = flat[row * n + from..row * n + from + len].to_vec();
            let ex = lists.exclude.get(u).map_or(&[][..], Vec::as_slice);
            let (ex, pos) = (within(ex, range), within(&positives[u], range));
            if let Some(row) = add_user(&mut sums, &mut s, &ex, &pos) {
                rows[u / world * width..][..width].copy_from_slice(&row);
            }
        }
    }
    let mut mine = sums.to_vec();
    let n_sums = mine.len();
    mine.extend_from_slice(&rows);
    let gathered = comm.all_gather(&Tensor::from_slice(&mine), ctx)?;
    let mut total = MetricSums::new(ks);
    let mut parts = Vec::with_capacity(world);
    for part in gathered {
        let mut v = Vec::<f64>::try_from(part.f_to_device(Device::Cpu)?)?;
        let part_rows = v.split_off(n_sums.min(v.len()));
        total.merge(&MetricSums::from_vec(ks, &v)?)?;
        parts.push(part_rows);
    }
    let mut by_user = vec![f64::NAN; positives.len() * width];
    for (u, row) in by_user.chunks_exact_mut(width.max(1)).enumerate() {
        let part = &parts[u % world];
        if let Some(theirs) = part.get(u / world * width..(u / world + 1) * width) {
            row.copy_from_slice(theirs);
        }
    }
    let mut means = total.means();
    means.per_user = Some(Arc::new(UserMetrics::new(ks, by_user)));
    Ok(means)
}

/// Every chunk of a table's text parts
/// ([`Recommender::tables_with`](crate::model::recommender::Recommender::tables_with)), shared out over the
/// ranks: this rank encodes chunks `rank, rank + world, ...` (in dynamic mode each one a GPT-2
/// pass, the bulk of an evaluation), and the others' come by one all-gather. A chunk holds the
/// same rows wherever it is encoded, so the result is bit for bit what one process computes.
pub fn text_chunks_shared(
    chunks: &TextChunks<'_>,
    comm: &mut dyn Collective,
    ctx: OpContext,
) -> Result<Vec<Tensor>, RecError> {
    let (rank, world, count) = (comm.rank(), comm.world_size(), chunks.rows.len());
    let encode = |c: usize| {
        chunks.encode(c).ok_or_else(|| {
            RecError::Invalid("internal error: a table's text chunks without a text tower".into())
        })
    };
    if world == 1 || count == 0 {
        return (0..count).map(encode).collect();
    }
    // Every rank's chunks one after another in slots of the first (longest) chunk's rows, so
    // that all ranks gather the same shape.
    let slot = chunks.rows[0];
    let per_rank = count.div_ceil(world) as i64;
    let mine = Tensor::f_zeros([per_rank * slot, chunks.dim], (Kind::Float, chunks.device))?;
    for (k, c) in (rank..count).step_by(world).enumerate() {
        let part = encode(c)?.f_to_kind(Kind::Float)?;
        mine.f_narrow(0, k as i64 * slot, chunks.rows[c])?
            .f_copy_(&part)?;
    }
    // Back where the tables are: `tcp` gathers CUDA tensors through host memory.
    let gathered = comm
        .all_gather(&mine, ctx)?
        .iter()
        .map(|part| part.f_to_device(chunks.device))
        .collect::<Result<Vec<_>, _>>()?;
    (0..count)
        .map(|c| {
            let from = &gathered[c % world];
            Ok(from.f_narrow(0, (c / world) as i64 * slot, chunks.rows[c])?)
        })
        .collect()
}

/// Evaluation can take longer than a training collective: scoring every user.
pub const EVAL_TIMEOUT_MIN: Duration = Duration::from_secs(600);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eval::evaluate_all;
    use runtime::collective::tcp::test_ring::with_ring;

    const CTX: OpContext = OpContext {
        step: 0,
        timeout: Duration::from_secs(20),
    };

    /// Text chunks shared out over 2 and 3 ranks arrive whole and in order, bit for bit what
    /// one process computes: a last chunk shorter than the others, ranks with more chunks than
    /// others, ranks with none, and no chunk at all.
    #[test]
    fn shared_text_chunks_are_the_chunks_computed_here() {
        // Chunk c's row j: values no other chunk or row has, in every column.
        fn chunk_of(c: usize, rows: i64) -> Tensor {
            let value = |j: i64, d: i64| (c as i64 * 1000 + j * 10 + d) as f32 + 0.25;
            let v: Vec<f32> = (0..rows)
                .flat_map(|j| (0..3).map(move |d| value(j, d)))
                .collect();
            Tensor::from_slice(&v).view([rows, 3])
        }
        for world in [2u32, 3] {
            for rows in [vec![], vec![4], vec![4, 4], vec![4, 4, 4, 4, 2], vec![4; 7]] {
                let expected: Vec<Vec<f32>> = rows
                    .iter()
                    .enumerate()
                    .map(|(c, &r)| Vec::<f32>::try_from(chunk_of(c, r).view([-1])).unwrap())
                    .collect();
                let rows_here = rows.clone();
                let results = with_ring(world, move |rank, comm| {
                    let encoded = std::cell::RefCell::new(Vec::new());
                    let encode = |c: usize| {
                        encoded.borrow_mut().push(c);
                        Some(chunk_of(c, rows_here[c]))
                    };
                    let chunks = TextChunks::new(rows_here.clone(), 3, Device::Cpu, &encode);
                    let parts = text_chunks_shared(&chunks, comm, CTX).unwrap();
                    let mine: Vec<usize> =
                        (rank..rows_here.len()).step_by(world as usize).collect();
                    assert_eq!(
                        *encoded.borrow(),
                        mine,
                        "rank {rank} encodes its share only"
                    );
                    parts
                        .iter()
                        .map(|p| Vec::<f32>::try_from(p.contiguous().view([-1])).unwrap())
                        .collect::<Vec<_>>()
                });
                for got in results {
                    assert_eq!(got, expected, "world {world}, chunks {rows:?}");
                }
            }
        }
    }

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
                    let k = runtime::rng::splitmix64(&mut state) % max;
                    let mut v: Vec<u32> = (0..k)
                        .map(|_| (runtime::rng::splitmix64(&mut state) % n_items as u64) as u32)
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
        // All items, and a range of them (as cold items are ranked among themselves).
        for range in [0..n_items as u32, 12..n_items as u32] {
            let shifted = |l: &[Vec<u32>]| -> Vec<Vec<u32>> {
                l.iter().map(|ids| within(ids, &range)).collect()
            };
            let direct = evaluate_all(
                |u| range.clone().map(|i| score_of(u, i as usize)).collect(),
                &users,
                &shifted(&exclude),
                &shifted(&positives),
                &ks,
            )
            .means();
            assert!(direct.users > 10);
            // Each user alone, as the per-user table must hold them (`None`: no positive).
            let alone: Vec<Option<Metrics>> = users
                .iter()
                .map(|&u| {
                    let m = evaluate_all(
                        |u| range.clone().map(|i| score_of(u, i as usize)).collect(),
                        &[u],
                        &shifted(&exclude),
                        &shifted(&positives),
                        &ks,
                    );
                    (m.users == 1).then(|| m.means())
                })
                .collect();
            for world in [1u32, 2, 3] {
                let (ex, pos, k) = (exclude.clone(), positives.clone(), ks.clone());
                let candidates = range.clone();
                let results = with_ring(world, move |_, comm| {
                    let mut score = |batch: &[usize]| -> Result<Tensor, tch::TchError> {
                        let rows: Vec<f32> = batch
                            .iter()
                            .flat_map(|&u| (0..n_items).map(move |i| score_of(u, i)))
                            .collect();
                        Ok(Tensor::from_slice(&rows).view([batch.len() as i64, n_items as i64]))
                    };
                    let lists = SplitLists {
                        candidates: candidates.clone(),
                        exclude: &ex,
                        positives: &pos,
                    };
                    evaluate_sharded(&mut score, &lists, &k, 4, comm, CTX).unwrap()
                });
                for m in results {
                    assert_eq!(m.users, direct.users, "world {world}");
                    for name in ["recall@5", "ndcg@10", "mrr@1", "hit@5", "precision@10"] {
                        let (a, b) = (m.get(name).unwrap(), direct.get(name).unwrap());
                        assert!((a - b).abs() < 1e-12, "world {world} {name}: {a} vs {b}");
                        let column = m.per_user.as_ref().unwrap().column(name).unwrap();
                        assert_eq!(column.len(), n_users, "world {world}");
                        for (u, (got, want)) in column.iter().zip(&alone).enumerate() {
                            let want = want.as_ref().map(|w| w.get(name).unwrap());
                            assert_eq!(*got, want, "world {world} user {u} {name}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn scores_that_are_not_finite_are_refused_naming_the_user_and_item() {
        let exclude = vec![Vec::new(); 6];
        let positives = vec![vec![1u32]; 6];
        let results = with_ring(1, move |_, comm| {
            let mut score = |batch: &[usize]| -> Result<Tensor, tch::TchError> {
                let rows: Vec<f32> = batch
                    .iter()
                    .flat_map(|&u| {
                        (0..4).map(move |i| if u == 4 && i == 2 { f32::NAN } else { 0.5 })
                    })
                    .collect();
                Ok(Tensor::from_slice(&rows).view([batch.len() as i64, 4]))
            };
            let lists = SplitLists {
                candidates: 0..4,
                exclude: &exclude,
                positives: &positives,
            };
            evaluate_sharded(&mut score, &lists, &[1], 4, comm, CTX)
                .err()
                .map(|e| e.to_string())
        });
        let text = results[0].clone().expect("NaN scores were evaluated");
        assert!(
            text.contains("user 4's score of item 2 is NaN (not finite)"),
            "{text}"
        );
    }
}
