//! Implicit feedback and its split: ratings at or above `min_rating` become interactions,
//! users and items get dense ids, and each user's interactions are cut 8:1:1 into train, valid
//! and test; optionally a share of the items and of the users is held out of training
//! entirely (cold start).
//!
//! Owns: which interaction lands where, deterministically for a seed. Must not: read files or
//! know models (a model learns the warm ids `0..n_warm_*` only).

use super::{mix_seed, shuffle, RawData};

/// Shares of the items and users held out of training entirely (`data.cold_items`,
/// `data.cold_users`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ColdShares {
    pub items: f64,
    pub users: f64,
}

/// Implicit-feedback interactions with dense ids and a per-user 8:1:1 split.
///
/// Dense ids put the warm users and items first: users `0..n_warm_users` and items
/// `0..n_warm_items` are the ones training sees; the rest are cold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dataset {
    pub n_users: u32,
    pub n_items: u32,
    /// Users and items that training sees (the first dense ids); equal to the totals without
    /// cold start.
    pub n_warm_users: u32,
    pub n_warm_items: u32,
    /// Dense user index -> original ML-1M user id (increasing among the warm ones, then among
    /// the cold ones).
    pub user_ids: Vec<u32>,
    /// Dense item index -> original ML-1M movie id (likewise).
    pub item_ids: Vec<u32>,
    /// Per dense user: sorted dense item ids (warm users and warm items only).
    pub train: Vec<Vec<u32>>,
    pub valid: Vec<Vec<u32>>,
    pub test: Vec<Vec<u32>>,
    /// Per dense user: the cold items a warm user interacted with (all of them), sorted.
    pub cold_items: Vec<Vec<u32>>,
    /// Per dense user: the warm items a cold user interacted with (all of them), sorted.
    /// Interactions of cold users with cold items are in no list.
    pub cold_users: Vec<Vec<u32>>,
}

impl Dataset {
    /// What the best model is tested on: `test`, then the cold-start parts the data has.
    pub fn test_splits(&self) -> Vec<crate::Split> {
        let mut splits = vec![crate::Split::Test];
        if self.n_warm_items < self.n_items {
            splits.push(crate::Split::ColdItems);
        }
        if self.n_warm_users < self.n_users {
            splits.push(crate::Split::ColdUsers);
        }
        splits
    }
}

/// Seed streams of the cold draws, apart from the per-user streams (keyed by user id).
const COLD_ITEM_STREAM: u64 = 0xC01D_17E5;
const COLD_USER_STREAM: u64 = 0xC01D_05E5;

/// Builds the implicit-feedback dataset.
///
/// Keeps ratings `>= min_rating`. Users and items that still have an interaction are cold with
/// the shares of `cold` (the first `round(share x n)` of their original ids shuffled with a
/// seeded stream), then remapped densely: warm ones first, each group in increasing
/// original-id order. Each warm user's distinct warm items are sorted, shuffled (Fisher–Yates,
/// SplitMix64 seeded from `(seed, original user id)`), then cut in this order: the first
/// `n - 2*floor(n/10)` go to train, the next `floor(n/10)` to valid, the last `floor(n/10)` to
/// test. Each part is then sorted. Deterministic for a seed; without cold shares the cold
/// draws do not happen and the split is the plain 8:1:1 one.
pub fn build_dataset(raw: &RawData, min_rating: u8, seed: u64, cold: ColdShares) -> Dataset {
    let kept = || raw.ratings.iter().filter(|r| r.rating >= min_rating);
    let max_u = kept().map(|r| r.user).max().unwrap_or(0) as usize;
    let max_m = kept().map(|r| r.movie).max().unwrap_or(0) as usize;
    let mut umap = vec![u32::MAX; max_u + 1];
    let mut imap = vec![u32::MAX; max_m + 1];
    for r in kept() {
        umap[r.user as usize] = 0;
        imap[r.movie as usize] = 0;
    }
    let (user_ids, n_warm_users) = densify(&mut umap, cold.users, mix_seed(seed, COLD_USER_STREAM));
    let (item_ids, n_warm_items) = densify(&mut imap, cold.items, mix_seed(seed, COLD_ITEM_STREAM));
    let mut per_user: Vec<Vec<u32>> = vec![Vec::new(); user_ids.len()];
    for r in kept() {
        per_user[umap[r.user as usize] as usize].push(imap[r.movie as usize]);
    }
    let n = user_ids.len();
    let mut ds = Dataset {
        n_users: n as u32,
        n_items: item_ids.len() as u32,
        n_warm_users,
        n_warm_items,
        user_ids,
        item_ids,
        train: Vec::with_capacity(n),
        valid: Vec::with_capacity(n),
        test: Vec::with_capacity(n),
        cold_items: Vec::with_capacity(n),
        cold_users: Vec::with_capacity(n),
    };
    for (d, mut items) in per_user.into_iter().enumerate() {
        items.sort_unstable();
        items.dedup();
        // Sorted, so the warm items are a prefix. A cold user's cold items are in no list.
        let cold_part = items.split_off(items.partition_point(|&i| i < n_warm_items));
        let (warm, cold_items, cold_user) = if d as u32 >= n_warm_users {
            (Vec::new(), Vec::new(), items)
        } else {
            (items, cold_part, Vec::new())
        };
        ds.cold_items.push(cold_items);
        ds.cold_users.push(cold_user);
        let (train, valid, test) = split_user(warm, mix_seed(seed, u64::from(ds.user_ids[d])));
        ds.train.push(train);
        ds.valid.push(valid);
        ds.test.push(test);
    }
    ds
}

/// Dense ids of the slots of `map` that are taken (`0`), warm ones first: a `share` of them,
/// drawn with `state`, goes last. Returns dense -> original and the number of warm ones.
fn densify(map: &mut [u32], share: f64, mut state: u64) -> (Vec<u32>, u32) {
    let taken: Vec<u32> = (0..map.len() as u32)
        .filter(|&orig| map[orig as usize] != u32::MAX)
        .collect();
    let n_cold = (share * taken.len() as f64).round() as usize;
    let mut cold = vec![false; map.len()];
    if n_cold > 0 {
        let mut drawn = taken.clone();
        shuffle(&mut drawn, &mut state);
        for &orig in &drawn[..n_cold.min(drawn.len())] {
            cold[orig as usize] = true;
        }
    }
    let (warm, cold): (Vec<u32>, Vec<u32>) = taken.into_iter().partition(|&o| !cold[o as usize]);
    let n_warm = warm.len() as u32;
    let ids: Vec<u32> = warm.into_iter().chain(cold).collect();
    for (dense, &orig) in ids.iter().enumerate() {
        map[orig as usize] = dense as u32;
    }
    (ids, n_warm)
}

/// One user's sorted items cut 8:1:1 after a seeded shuffle; each part sorted.
fn split_user(mut items: Vec<u32>, mut state: u64) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    shuffle(&mut items, &mut state);
    let k = items.len() / 10;
    let n_train = items.len() - 2 * k;
    let mut test = items.split_off(n_train + k);
    let mut valid = items.split_off(n_train);
    items.sort_unstable();
    valid.sort_unstable();
    test.sort_unstable();
    (items, valid, test)
}

#[cfg(test)]
mod tests {
    use super::super::{generate_ml1m, read_ml1m};
    use super::*;
    use common::config::SyntheticSize;

    fn tiny() -> RawData {
        let dir = tempfile::tempdir().unwrap();
        generate_ml1m(dir.path(), SyntheticSize::Tiny, 5).unwrap();
        read_ml1m(dir.path()).unwrap()
    }

    const COLD: ColdShares = ColdShares {
        items: 0.2,
        users: 0.1,
    };

    #[test]
    fn cold_items_and_users_never_reach_training() {
        let raw = tiny();
        let ds = build_dataset(&raw, 3, 9, COLD);
        let (wu, wi) = (ds.n_warm_users as usize, ds.n_warm_items);
        assert_eq!(
            ds.n_users - ds.n_warm_users,
            (0.1 * ds.n_users as f64).round() as u32
        );
        assert_eq!(
            ds.n_items - ds.n_warm_items,
            (0.2 * ds.n_items as f64).round() as u32
        );
        for u in 0..ds.n_users as usize {
            let warm_lists = [&ds.train[u], &ds.valid[u], &ds.test[u]];
            assert!(warm_lists.iter().all(|l| l.iter().all(|&i| i < wi)));
            assert!(ds.cold_items[u].iter().all(|&i| i >= wi));
            assert!(ds.cold_users[u].iter().all(|&i| i < wi));
            if u < wu {
                assert!(ds.cold_users[u].is_empty());
            } else {
                assert!(warm_lists.iter().all(|l| l.is_empty()));
                assert!(ds.cold_items[u].is_empty());
            }
        }
        // Both evaluations have people to rank for.
        assert!(ds.cold_items.iter().filter(|l| !l.is_empty()).count() > 50);
        assert!(ds.cold_users.iter().filter(|l| !l.is_empty()).count() >= 10);
        // Ids stay increasing within the warm and within the cold group.
        assert!(ds.item_ids[..wi as usize].windows(2).all(|w| w[0] < w[1]));
        assert!(ds.item_ids[wi as usize..].windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn every_interaction_of_a_warm_user_lands_in_one_place() {
        let raw = tiny();
        let ds = build_dataset(&raw, 3, 9, COLD);
        let plain = build_dataset(&raw, 3, 9, ColdShares::default());
        // Per original user: the original movie ids of all its lists, with and without cold.
        let originals = |ds: &Dataset, u: usize, lists: &[&Vec<Vec<u32>>]| {
            let mut all: Vec<u32> = lists
                .iter()
                .flat_map(|l| l[u].iter().map(|&i| ds.item_ids[i as usize]))
                .collect();
            all.sort_unstable();
            all
        };
        for u in 0..ds.n_warm_users as usize {
            let orig = ds.user_ids[u];
            let p = plain.user_ids.binary_search(&orig).unwrap();
            assert_eq!(
                originals(&ds, u, &[&ds.train, &ds.valid, &ds.test, &ds.cold_items]),
                originals(&plain, p, &[&plain.train, &plain.valid, &plain.test]),
                "user {orig}"
            );
        }
    }

    #[test]
    fn no_cold_share_is_the_plain_split_and_the_draw_is_seeded() {
        let raw = tiny();
        let plain = build_dataset(&raw, 3, 9, ColdShares::default());
        assert_eq!(
            (plain.n_warm_users, plain.n_warm_items),
            (plain.n_users, plain.n_items)
        );
        assert!(plain
            .cold_items
            .iter()
            .chain(&plain.cold_users)
            .all(Vec::is_empty));
        assert_eq!(
            build_dataset(&raw, 3, 9, COLD),
            build_dataset(&raw, 3, 9, COLD)
        );
        assert_ne!(
            build_dataset(&raw, 3, 9, COLD).item_ids,
            build_dataset(&raw, 3, 10, COLD).item_ids
        );
    }
}
