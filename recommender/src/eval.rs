//! Full-ranking evaluation of a recommender: top-K metrics over all items (RecBole protocol).
//!
//! Owns: ranking one user's scores over all items with excluded items removed (ties broken in
//! a fixed pseudo-random order of the items, deterministically), the per-user Recall/NDCG/MRR/Hit/Precision@K formulas
//! of REFERENCE.md ("Recommendation protocol"), the additive per-rank sums ([`MetricSums`]) with
//! a flat `f64` layout for an all-reduce, the final means ([`Metrics`]), and each user's own
//! row of them ([`UserMetrics`], what a paired comparison reads).
//!
//! Must not: know the model, libtorch, the data set files or other ranks. Callers hand in plain
//! `f32` scores and item-id lists; reducing [`MetricSums`] across ranks (adding [`MetricSums::to_vec`])
//! is the caller's job. Nothing here panics on bad input: mismatches are [`EvalError`]s, and
//! out-of-range item ids are ignored (an out-of-range positive still counts in |R(u)|).

use std::cmp::Ordering;
use std::marker::PhantomData;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Errors from combining or decoding metric sums.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum EvalError {
    #[error("eval: metric sums have different cut-offs: {left:?} vs {right:?}")]
    KsMismatch { left: Vec<usize>, right: Vec<usize> },
    #[error(
        "eval: flat metric vector has length {got}, expected {expected} (1 + 5 x {} cut-offs)",
        (expected - 1) / 5
    )]
    LengthMismatch { expected: usize, got: usize },
    #[error("eval: flat metric vector has an invalid user count {0} (need a finite integer >= 0)")]
    InvalidUsers(f64),
}

/// The five metrics at each cut-off of `ks` (index `j` of a series is cut-off `ks[j]`) over
/// `users` evaluated users. `What` says whether the values are sums ([`MetricSums`]) or per-user
/// means ([`Metrics`]); the two share the layout and differ in what they can do.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(bound = "")]
pub struct MetricTable<What> {
    pub ks: Vec<usize>,
    pub users: u64,
    pub recall: Vec<f64>,
    pub ndcg: Vec<f64>,
    pub mrr: Vec<f64>,
    pub hit: Vec<f64>,
    pub precision: Vec<f64>,
    /// Each user's metrics, where the evaluation kept them (the sharded evaluation does): what
    /// a paired comparison with a baseline needs ([`crate::per_user::paired`]). Not saved, and
    /// not part of equality: the table is its means.
    #[serde(skip)]
    pub per_user: Option<Arc<UserMetrics>>,
    #[serde(skip)]
    what: PhantomData<What>,
}

impl<What> PartialEq for MetricTable<What> {
    fn eq(&self, other: &Self) -> bool {
        (self.ks == other.ks && self.users == other.users) && self.columns() == other.columns()
    }
}

/// Marker: a [`MetricTable`] of sums over users.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sums;

/// Marker: a [`MetricTable`] of per-user means.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Means;

/// Sums over evaluated users, reducible across ranks by adding (so a split evaluation equals a
/// single-process one up to floating-point summation order).
pub type MetricSums = MetricTable<Sums>;

/// Per-user means of each metric at each cut-off.
pub type Metrics = MetricTable<Means>;

impl<What> MetricTable<What> {
    /// The metric names, in the order of [`MetricTable::columns`].
    pub const NAMES: [&'static str; 5] = ["recall", "ndcg", "mrr", "hit", "precision"];

    fn from_columns(ks: &[usize], users: u64, columns: [Vec<f64>; 5]) -> Self {
        let [recall, ndcg, mrr, hit, precision] = columns;
        MetricTable {
            ks: ks.to_vec(),
            users,
            recall,
            ndcg,
            mrr,
            hit,
            precision,
            per_user: None,
            what: PhantomData,
        }
    }

    /// The five series, in the order of [`MetricTable::NAMES`].
    pub fn columns(&self) -> [&Vec<f64>; 5] {
        [
            &self.recall,
            &self.ndcg,
            &self.mrr,
            &self.hit,
            &self.precision,
        ]
    }

    fn columns_mut(&mut self) -> [&mut Vec<f64>; 5] {
        [
            &mut self.recall,
            &mut self.ndcg,
            &mut self.mrr,
            &mut self.hit,
            &mut self.precision,
        ]
    }
}

impl MetricSums {
    /// Empty sums for the cut-offs `ks` (any order; a cut-off of 0 always contributes 0).
    pub fn new(ks: &[usize]) -> Self {
        Self::from_columns(ks, 0, std::array::from_fn(|_| vec![0.0; ks.len()]))
    }

    /// Adds `other` into `self`. Errors (leaving `self` unchanged) when the cut-offs differ.
    pub fn merge(&mut self, other: &MetricSums) -> Result<(), EvalError> {
        if self.ks != other.ks {
            return Err(EvalError::KsMismatch {
                left: self.ks.clone(),
                right: other.ks.clone(),
            });
        }
        self.users += other.users;
        for (a, b) in self.columns_mut().into_iter().zip(other.columns()) {
            for (x, y) in a.iter_mut().zip(b) {
                *x += *y;
            }
        }
        Ok(())
    }

    /// Flat layout for an all-reduce (sum): `[users, recall.., ndcg.., mrr.., hit.., precision..]`,
    /// length `1 + 5 * ks.len()`. The user count is exact up to 2^53.
    pub fn to_vec(&self) -> Vec<f64> {
        let mut v = Vec::with_capacity(1 + 5 * self.ks.len());
        v.push(self.users as f64);
        for column in self.columns() {
            v.extend_from_slice(column);
        }
        v
    }

    /// Inverse of [`MetricSums::to_vec`] for the cut-offs `ks`.
    pub fn from_vec(ks: &[usize], v: &[f64]) -> Result<Self, EvalError> {
        let n = ks.len();
        let expected = 1 + 5 * n;
        if v.len() != expected {
            return Err(EvalError::LengthMismatch {
                expected,
                got: v.len(),
            });
        }
        let u = v[0];
        if !u.is_finite() || u < 0.0 || u.fract() != 0.0 || u > u64::MAX as f64 {
            return Err(EvalError::InvalidUsers(u));
        }
        let part = |i: usize| v[1 + i * n..1 + (i + 1) * n].to_vec();
        Ok(Self::from_columns(ks, u as u64, std::array::from_fn(part)))
    }

    /// Means over the evaluated users (all zeros when no user was evaluated).
    pub fn means(&self) -> Metrics {
        let d = if self.users == 0 {
            0.0
        } else {
            1.0 / self.users as f64
        };
        let columns = self.columns().map(|s| s.iter().map(|x| x * d).collect());
        Metrics::from_columns(&self.ks, self.users, columns)
    }
}

impl Metrics {
    /// A metric by name, e.g. `"recall@10"`, `"NDCG@20"` (names: recall, ndcg, mrr, hit,
    /// precision; case-insensitive). `None` for an unknown name or a cut-off not evaluated.
    pub fn get(&self, name: &str) -> Option<f64> {
        let (column, idx) = locate(&self.ks, name)?;
        self.columns()[column].get(idx).copied()
    }

    /// One line, e.g. `users=6040 recall@10=0.1776 mrr@10=0.4187 ndcg@10=0.2401 hit@10=0.7199
    /// precision@10=0.1779` (columns in the order of REFERENCE.md's table, per cut-off).
    pub fn summary_line(&self) -> String {
        let mut s = format!("users={}", self.users);
        for (i, k) in self.ks.iter().enumerate() {
            s.push_str(&format!(
                " recall@{k}={:.4} mrr@{k}={:.4} ndcg@{k}={:.4} hit@{k}={:.4} precision@{k}={:.4}",
                self.recall[i], self.mrr[i], self.ndcg[i], self.hit[i], self.precision[i]
            ));
        }
        s
    }
}

/// One evaluation's metrics per user, by user id (a row is [`MetricSums::to_vec`]'s layout
/// without the user count): `NaN` rows for users not evaluated (no positive in the split).
#[derive(Clone)]
pub struct UserMetrics {
    ks: Vec<usize>,
    /// `rows[u * width ..][..width]`: user `u`'s five metrics at each cut-off.
    rows: Vec<f64>,
}

/// Its size, not its rows: a [`Metrics`] in an error or a log stays one line.
impl std::fmt::Debug for UserMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let users = self.rows.len() / Self::width(&self.ks).max(1);
        write!(f, "UserMetrics {{ users: {users}, ks: {:?} }}", self.ks)
    }
}

impl UserMetrics {
    /// A user's row: the five metrics (in [`MetricTable::NAMES`] order) at each cut-off of `ks`.
    pub fn width(ks: &[usize]) -> usize {
        5 * ks.len()
    }

    /// The table of `rows` (`users x width(ks)` values, `NaN` where a user was not evaluated).
    pub fn new(ks: &[usize], rows: Vec<f64>) -> UserMetrics {
        UserMetrics {
            ks: ks.to_vec(),
            rows,
        }
    }

    /// Each user's value of `name` (`"ndcg@10"`; as [`MetricTable::get`] reads it), `None` for
    /// users not evaluated; `None` altogether for a metric not evaluated.
    pub fn column(&self, name: &str) -> Option<Vec<Option<f64>>> {
        let (series, at_k) = locate(&self.ks, name)?;
        let width = Self::width(&self.ks);
        let at = series * self.ks.len() + at_k;
        Some(
            self.rows
                .chunks_exact(width.max(1))
                .map(|row| Some(row[at]).filter(|v| !v.is_nan()))
                .collect(),
        )
    }
}

/// Where `name` (`"ndcg@10"`, case-insensitive) is among the cut-offs `ks`: its series (in
/// [`MetricTable::NAMES`] order) and its cut-off's index; `None` for an unknown name or a
/// cut-off not evaluated.
fn locate(ks: &[usize], name: &str) -> Option<(usize, usize)> {
    let (metric, k) = name.split_once('@')?;
    let k: usize = k.trim().parse().ok()?;
    let at_k = ks.iter().position(|&x| x == k)?;
    let metric = metric.trim().to_ascii_lowercase();
    let series = MetricTable::<()>::NAMES.iter().position(|n| *n == metric)?;
    Some((series, at_k))
}

/// Sort key of a score: NaN ranks below everything, -0.0 equals 0.0.
fn key(s: f32) -> f32 {
    if s.is_nan() {
        f32::NEG_INFINITY
    } else {
        s + 0.0
    }
}

/// Where an item goes among items of equal score: a fixed pseudo-random order (murmur3's
/// 32-bit finaliser, a bijection, so distinct ids never tie). Not the id itself: ids follow the
/// data's own order (release order, or how a generator numbered its items), and a model
/// that gives many items one score (popularity on items without counts, an ID-only model on
/// items it never saw) would be credited with whatever that order carries.
pub fn tie_order(id: u32) -> u32 {
    let mut h = id ^ 0x9e37_79b9;
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

/// Score descending, then [`tie_order`] (a total order over distinct ids).
fn rank_cmp(scores: &[f32], a: u32, b: u32) -> Ordering {
    key(scores[b as usize])
        .total_cmp(&key(scores[a as usize]))
        .then(tie_order(a).cmp(&tie_order(b)))
}

/// The top `k` item ids by score (descending; ties in [`tie_order`]) among items not in `exclude`.
/// Returns fewer than `k` ids when fewer items remain. Out-of-range ids in `exclude` are ignored.
pub fn top_k(scores: &[f32], exclude: &[u32], k: usize) -> Vec<u32> {
    let mut excluded = vec![false; scores.len()];
    for &e in exclude {
        if let Some(x) = excluded.get_mut(e as usize) {
            *x = true;
        }
    }
    let mut cand: Vec<u32> = (0..scores.len() as u32)
        .filter(|&i| !excluded[i as usize])
        .collect();
    let k = k.min(cand.len());
    if k == 0 {
        return Vec::new();
    }
    if k < cand.len() {
        cand.select_nth_unstable_by(k - 1, |&a, &b| rank_cmp(scores, a, b));
        cand.truncate(k);
    }
    cand.sort_unstable_by(|&a, &b| rank_cmp(scores, a, b));
    cand
}

/// Adds one user's contribution: `scores` over all items (mutated: excluded items set to -inf),
/// `exclude` = item ids not to rank (train items; for test also valid items), `positives` = the
/// held-out items (duplicates counted once). Users with no positive are skipped (`users` unchanged).
/// Returns the user's own row ([`UserMetrics`]' layout), `None` for a user skipped.
pub fn add_user(
    sums: &mut MetricSums,
    scores: &mut [f32],
    exclude: &[u32],
    positives: &[u32],
) -> Option<Vec<f64>> {
    for &e in exclude {
        if let Some(s) = scores.get_mut(e as usize) {
            *s = f32::NEG_INFINITY;
        }
    }
    let mut pos = positives.to_vec();
    pos.sort_unstable();
    pos.dedup();
    if pos.is_empty() {
        return None;
    }
    let n_pos = pos.len();
    let max_k = sums.ks.iter().copied().max().unwrap_or(0);
    let top = top_k(scores, exclude, max_k);
    // hit_flags[i] = whether the item at rank i+1 is a positive.
    let hit_flags: Vec<bool> = top.iter().map(|i| pos.binary_search(i).is_ok()).collect();

    let mut row = MetricSums::new(&sums.ks);
    for (j, &k) in sums.ks.iter().enumerate() {
        if k == 0 {
            continue;
        }
        let mut hits = 0usize;
        let mut dcg = 0.0f64;
        let mut first: Option<usize> = None;
        for (i, &h) in hit_flags.iter().take(k).enumerate() {
            if h {
                hits += 1;
                dcg += 1.0 / ((i + 2) as f64).log2();
                first.get_or_insert(i + 1);
            }
        }
        let idcg: f64 = (0..n_pos.min(k))
            .map(|i| 1.0 / ((i + 2) as f64).log2())
            .sum();
        row.recall[j] = hits as f64 / n_pos as f64;
        row.ndcg[j] = dcg / idcg;
        row.mrr[j] = first.map_or(0.0, |r| 1.0 / r as f64);
        row.hit[j] = if hits > 0 { 1.0 } else { 0.0 };
        row.precision[j] = hits as f64 / k as f64;
    }
    sums.users += 1;
    for (total, mine) in sums.columns_mut().into_iter().zip(row.columns()) {
        for (t, m) in total.iter_mut().zip(mine) {
            *t += *m;
        }
    }
    Some(row.to_vec().split_off(1))
}

/// Evaluates `users` (e.g. this rank's shard), in order. `exclude` and `positives` are indexed
/// by user id (a user id beyond their length has no exclusions / no positives). `score_fn(u)`
/// returns the scores of all items for user `u`; it is not called for users without positives.
pub fn evaluate_all(
    mut score_fn: impl FnMut(usize) -> Vec<f32>,
    users: &[usize],
    exclude: &[Vec<u32>],
    positives: &[Vec<u32>],
    ks: &[usize],
) -> MetricSums {
    let mut sums = MetricSums::new(ks);
    for &u in users {
        let pos = positives.get(u).map_or(&[][..], |p| p.as_slice());
        if pos.is_empty() {
            continue;
        }
        let ex = exclude.get(u).map_or(&[][..], |e| e.as_slice());
        let mut scores = score_fn(u);
        add_user(&mut sums, &mut scores, ex, pos);
    }
    sums
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    fn one(scores: &[f32], exclude: &[u32], positives: &[u32], ks: &[usize]) -> Metrics {
        let mut s = MetricSums::new(ks);
        add_user(&mut s, &mut scores.to_vec(), exclude, positives);
        s.means()
    }

    #[test]
    fn hand_computed_two_positives_at_ranks_1_and_3() {
        // Items 0..5 ranked 0,1,2,3,4; positives {0,2} at ranks 1 and 3.
        let m = one(&[0.9, 0.8, 0.7, 0.6, 0.5], &[], &[2, 0], &[2, 5]);
        assert_eq!(m.users, 1);
        // K=2: top {0,1}, 1 hit. recall 1/2, precision 1/2, hit 1, mrr 1/1.
        // DCG = 1/log2(2) = 1; IDCG over min(2,2)=2 = 1 + 1/log2(3) = 1.6309297535714575;
        // NDCG = 1/1.6309297535714575 = 0.6131471927654584.
        assert!(close(m.get("recall@2").unwrap(), 0.5));
        assert!(close(m.get("precision@2").unwrap(), 0.5));
        assert!(close(m.get("hit@2").unwrap(), 1.0));
        assert!(close(m.get("mrr@2").unwrap(), 1.0));
        assert!(close(m.get("ndcg@2").unwrap(), 0.6131471927654584));
        // K=5: 2 hits. recall 1, precision 2/5 = 0.4, hit 1, mrr 1.
        // DCG = 1 + 1/log2(4) = 1.5; IDCG = 1.6309297535714575; NDCG = 0.9197207891481876.
        assert!(close(m.get("recall@5").unwrap(), 1.0));
        assert!(close(m.get("precision@5").unwrap(), 0.4));
        assert!(close(m.get("hit@5").unwrap(), 1.0));
        assert!(close(m.get("mrr@5").unwrap(), 1.0));
        assert!(close(m.get("ndcg@5").unwrap(), 0.9197207891481876));
        assert_eq!(m.get("bogus@5"), None);
        assert_eq!(m.get("recall@3"), None);
        assert!(close(m.get("NDCG@5").unwrap(), 0.9197207891481876));
    }

    #[test]
    fn excluded_items_never_ranked() {
        let mut scores = vec![100.0, 99.0, 0.1, 0.2, f32::INFINITY];
        assert_eq!(top_k(&scores, &[0, 1, 4], 5), vec![3, 2]);
        let mut s = MetricSums::new(&[1]);
        // Positive 0 is excluded: it cannot be hit although it has the highest score.
        add_user(&mut s, &mut scores, &[0, 1, 4, 99], &[0]);
        assert_eq!(scores[0], f32::NEG_INFINITY);
        assert_eq!(scores[4], f32::NEG_INFINITY);
        let m = s.means();
        assert_eq!(m.get("hit@1"), Some(0.0));
        // The top item after exclusion is 3.
        assert_eq!(
            one(&[100.0, 99.0, 0.1, 0.2], &[0, 1], &[3], &[1]).get("hit@1"),
            Some(1.0)
        );
    }

    #[test]
    fn ties_follow_a_fixed_pseudo_random_order_not_the_ids() {
        // tie_order: 1 < 0 < 3 < 2 (and 4 < 5).
        let scores = [1.0, 2.0, 2.0, 1.0, -0.0, 0.0, f32::NAN];
        assert_eq!(top_k(&scores, &[], 7), vec![1, 2, 0, 3, 4, 5, 6]);
        assert_eq!(top_k(&scores, &[], 3), vec![1, 2, 0]);
        assert_eq!(top_k(&[1.0; 4], &[], 4), vec![1, 0, 3, 2]);
        assert_eq!(one(&[1.0; 4], &[], &[1], &[1]).get("hit@1"), Some(1.0));
        assert_eq!(one(&[1.0; 4], &[], &[0], &[1]).get("hit@1"), Some(0.0));
        // A bijection: distinct ids never tie.
        let mut keys: Vec<u32> = (0..10_000).map(tie_order).collect();
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(keys.len(), 10_000);
    }

    #[test]
    fn user_without_positives_skipped() {
        let mut s = MetricSums::new(&[1, 5]);
        add_user(&mut s, &mut [1.0, 2.0], &[], &[]);
        assert_eq!(s, MetricSums::new(&[1, 5]));
        assert_eq!(s.means().recall, vec![0.0, 0.0]);
        let sums = evaluate_all(
            |_| panic!("must not score a user without positives"),
            &[0, 1, 7],
            &[vec![], vec![0]],
            &[vec![], vec![]],
            &[10],
        );
        assert_eq!(sums.users, 0);
    }

    #[test]
    fn mrr_first_hit_at_rank_2() {
        // Positive 1 at rank 2: MRR = 1/2 for K >= 2, 0 for K = 1.
        // NDCG@2 = (1/log2(3)) / (1/log2(2)) = 0.6309297535714575.
        let m = one(&[0.9, 0.8, 0.7], &[], &[1], &[1, 2, 3]);
        assert_eq!(m.get("mrr@1"), Some(0.0));
        assert!(close(m.get("mrr@2").unwrap(), 0.5));
        assert!(close(m.get("mrr@3").unwrap(), 0.5));
        assert!(close(m.get("ndcg@2").unwrap(), 0.6309297535714575));
        assert_eq!(m.get("hit@1"), Some(0.0));
    }

    #[test]
    fn precision_with_k_larger_than_item_count() {
        // 3 items, 1 positive (item 2, rank 2), K = 10: hits/K = 1/10 (not 1/3); recall 1;
        // NDCG = (1/log2(3)) / (1/log2(2)) = 0.6309297535714575; MRR 1/2.
        let m = one(&[0.1, 0.5, 0.3], &[], &[2], &[10]);
        assert!(close(m.get("precision@10").unwrap(), 0.1));
        assert!(close(m.get("recall@10").unwrap(), 1.0));
        assert!(close(m.get("ndcg@10").unwrap(), 0.6309297535714575));
        assert!(close(m.get("mrr@10").unwrap(), 0.5));
    }

    /// Per-user (scores, exclude, positives) tables.
    type Synthetic = (Vec<Vec<f32>>, Vec<Vec<u32>>, Vec<Vec<u32>>);

    fn synthetic(n_users: usize, n_items: usize) -> Synthetic {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut scores = Vec::new();
        let mut ex = Vec::new();
        let mut pos = Vec::new();
        for _ in 0..n_users {
            scores.push((0..n_items).map(|_| (next() % 1000) as f32).collect());
            ex.push((0..n_items as u32).filter(|_| next() % 5 == 0).collect());
            pos.push((0..n_items as u32).filter(|_| next() % 7 == 0).collect());
        }
        (scores, ex, pos)
    }

    #[test]
    fn merge_of_two_halves_equals_all_users() {
        let (scores, ex, pos) = synthetic(40, 60);
        let ks = [1, 5, 10, 20];
        let users: Vec<usize> = (0..40).collect();
        let f = |u: usize| scores[u].clone();
        let all = evaluate_all(f, &users, &ex, &pos, &ks);
        let mut a = evaluate_all(f, &users[..17], &ex, &pos, &ks);
        let b = evaluate_all(f, &users[17..], &ex, &pos, &ks);
        a.merge(&b).unwrap();
        assert_eq!(a.users, all.users);
        for (x, y) in a.to_vec().iter().zip(all.to_vec()) {
            assert!((x - y).abs() < 1e-12, "{x} vs {y}");
        }
        let mut c = MetricSums::new(&[1, 5]);
        let before = c.clone();
        assert!(matches!(c.merge(&all), Err(EvalError::KsMismatch { .. })));
        assert_eq!(c, before);
    }

    #[test]
    fn to_vec_from_vec_round_trip() {
        let (scores, ex, pos) = synthetic(10, 30);
        let ks = [3, 10];
        let s = evaluate_all(
            |u| scores[u].clone(),
            &(0..10).collect::<Vec<_>>(),
            &ex,
            &pos,
            &ks,
        );
        let v = s.to_vec();
        assert_eq!(v.len(), 11);
        assert_eq!(MetricSums::from_vec(&ks, &v).unwrap(), s);
        assert!(matches!(
            MetricSums::from_vec(&ks, &v[..10]),
            Err(EvalError::LengthMismatch {
                expected: 11,
                got: 10
            })
        ));
        let mut bad = v.clone();
        bad[0] = 1.5;
        assert!(matches!(
            MetricSums::from_vec(&ks, &bad),
            Err(EvalError::InvalidUsers(_))
        ));
        let line = s.means().summary_line();
        assert!(line.starts_with(&format!("users={}", s.users)), "{line}");
        assert!(line.contains("recall@10="), "{line}");
    }

    proptest! {
        #[test]
        fn metrics_in_unit_interval_and_recall_monotone(
            scores in proptest::collection::vec(-10.0f32..10.0, 1..40),
            ex_mask in proptest::collection::vec(any::<bool>(), 40),
            pos_mask in proptest::collection::vec(0u8..4, 40),
        ) {
            let n = scores.len();
            let ex: Vec<u32> = (0..n as u32).filter(|&i| ex_mask[i as usize]).collect();
            let pos: Vec<u32> = (0..n as u32).filter(|&i| pos_mask[i as usize] == 0).collect();
            let ks = [1, 2, 3, 5, 10, 20, 50];
            let m = one(&scores, &ex, &pos, &ks);
            for series in [&m.recall, &m.ndcg, &m.mrr, &m.hit, &m.precision] {
                for &x in series.iter() {
                    prop_assert!((0.0..=1.0 + 1e-12).contains(&x), "{x} out of [0,1]: {m:?}");
                }
            }
            for w in m.recall.windows(2) {
                prop_assert!(w[0] <= w[1] + 1e-12, "recall not monotone: {m:?}");
            }
            for w in m.hit.windows(2) {
                prop_assert!(w[0] <= w[1], "hit not monotone: {m:?}");
            }
        }
    }
}
