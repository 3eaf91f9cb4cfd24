//! Tests of the recommender head: representations, tables, losses and the history tower.

use super::*;
use tch::nn::OptimizerConfig;

/// The scorers, with and without a text tower, that the score and loss tests cover.
const SCORERS_AND_TEXT: [(Scorer, bool); 3] = [
    (Scorer::Dot, false),
    (Scorer::Dot, true),
    (Scorer::Mlp, true),
];

fn ids(v: &[i64]) -> Tensor {
    Tensor::from_slice(v)
}

/// A dot-product head of embedding 8 over `users` and `items` (the first `warm_users` warm), its
/// text projections starting at zero.
fn config(users: i64, items: i64, warm_users: i64, user_tower: UserTower) -> RecConfig {
    RecConfig {
        n_users: users,
        n_items: items,
        n_warm_users: warm_users,
        n_warm_items: items,
        dim: 8,
        scorer: Scorer::Dot,
        text_l2: 0.0,
        zero_text_proj: true,
        user_tower,
        item_item: false,
    }
}

fn model(scorer: Scorer, text: bool) -> (nn::VarStore, Recommender) {
    model_with(
        RecConfig {
            scorer,
            ..config(5, 7, 5, UserTower::Id)
        },
        text,
    )
}

/// [`model`] with a config of its own (5 users, 7 items).
fn model_with(config: RecConfig, text: bool) -> (nn::VarStore, Recommender) {
    tch::manual_seed(0);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let text = if text {
        Text::Cached(TextFeatures {
            users: Tensor::randn([5, 12], (Kind::Float, tch::Device::Cpu)),
            items: Tensor::randn([7, 12], (Kind::Float, tch::Device::Cpu)),
        })
    } else {
        Text::None
    };
    let m = Recommender::new(&vs.root(), config, text);
    // The projections start at zero; give them weights so that text changes the scores.
    let _guard = tch::no_grad_guard();
    for (name, mut var) in vs.variables() {
        if name.contains("text_proj") {
            var.copy_(&(Tensor::randn_like(&var) * 0.3));
        }
    }
    (vs, m)
}

#[test]
fn a_new_model_with_text_scores_as_plain_mf() {
    tch::manual_seed(0);
    let config = config(5, 7, 5, UserTower::Id);
    let (vs_mf, vs_text) = (
        nn::VarStore::new(tch::Device::Cpu),
        nn::VarStore::new(tch::Device::Cpu),
    );
    let mf = Recommender::new(&vs_mf.root(), config, Text::None);
    let text = Text::Cached(TextFeatures {
        users: Tensor::randn([5, 12], (Kind::Float, tch::Device::Cpu)),
        items: Tensor::randn([7, 12], (Kind::Float, tch::Device::Cpu)),
    });
    let fused = Recommender::new(&vs_text.root(), config, text);
    let mut vs_mf = vs_mf;
    vs_mf.copy(&vs_text).unwrap();
    let users = ids(&[0, 1, 2, 3, 4]);
    assert!(fused
        .score_all_items(&users)
        .equal(&mf.score_all_items(&users)));
}

#[test]
fn text_l2_adds_the_squared_norms_of_the_text_parts() {
    let (_vs, mut m) = model(Scorer::Dot, true);
    let (u, p, n) = (ids(&[0, 1]), ids(&[2, 3]), ids(&[4, 5]));
    let plain = m.bpr_loss(&u, &p, &n, 0.0, true).double_value(&[]);
    m.config.text_l2 = 0.5;
    let with = m.bpr_loss(&u, &p, &n, 0.0, true).double_value(&[]);
    let text = |side, ids: &Tensor| {
        let (_, t) = m.parts(side, ids, true);
        t.unwrap().square().sum(Kind::Float).double_value(&[])
    };
    let norms = (text(Side::User, &u) + text(Side::Item, &p) + text(Side::Item, &n)) / 2.0;
    assert!(norms > 0.0);
    assert!(
        (with - plain - 0.5 * norms).abs() < 1e-5,
        "{with} {plain} {norms}"
    );
}

#[test]
fn cold_items_count_as_zero_cold_users_as_the_average_user() {
    let pair = |text: bool| {
        let (vs, warm) = model(Scorer::Dot, text);
        let mut config = warm.config();
        (config.n_warm_users, config.n_warm_items) = (4, 5);
        // The same variables under a config with the last user and two items cold.
        let features = match &warm.text {
            Text::Cached(f) => Text::Cached(TextFeatures {
                users: f.users.shallow_clone(),
                items: f.items.shallow_clone(),
            }),
            _ => Text::None,
        };
        let vs2 = nn::VarStore::new(tch::Device::Cpu);
        let cold = Recommender::new(&vs2.root(), config, features);
        let mut vs2 = vs2;
        vs2.copy(&vs).unwrap();
        (warm, cold)
    };
    let (warm, cold) = pair(false);
    let (wu, wi) = warm.tables(tch::Device::Cpu);
    let (cu, ci) = cold.tables(tch::Device::Cpu);
    assert!(cu.narrow(0, 0, 4).equal(&wu.narrow(0, 0, 4)));
    assert!(ci.narrow(0, 0, 5).equal(&wi.narrow(0, 0, 5)));
    let average = wu
        .narrow(0, 0, 4)
        .mean_dim([0i64].as_slice(), true, Kind::Float);
    let diff = (cu.narrow(0, 4, 1) - average).abs().max().double_value(&[]);
    assert!(
        diff < 1e-6,
        "a cold user is not the average warm user: {diff}"
    );
    assert_eq!(
        ci.narrow(0, 5, 2).abs().sum(Kind::Float).double_value(&[]),
        0.0
    );
    // With text, a cold item is its projected text: the warm representation minus its ID.
    let (warm, cold) = pair(true);
    let (_, wi) = warm.tables(tch::Device::Cpu);
    let (_, ci) = cold.tables(tch::Device::Cpu);
    let ids = ids(&[5, 6]);
    let expected = wi.index_select(0, &ids) - warm.item_id.forward(&ids);
    let diff = (ci.narrow(0, 5, 2) - expected)
        .abs()
        .max()
        .double_value(&[]);
    assert!(diff < 1e-6, "{diff}");
    assert!(ci.narrow(0, 5, 2).abs().sum(Kind::Float).double_value(&[]) > 0.0);
}

/// The tables (ID parts in one go) hold exactly what `repr` gives chunk by chunk, cold rows
/// and text included, over more rows than one chunk.
#[test]
fn tables_are_the_representations_bit_for_bit() {
    for text in [false, true] {
        tch::manual_seed(3);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let (n_users, n_items) = (300i64, 260i64);
        let config = RecConfig {
            n_users,
            n_items,
            n_warm_users: 250,
            n_warm_items: 200,
            dim: 8,
            scorer: Scorer::Dot,
            text_l2: 0.0,
            zero_text_proj: false,
            user_tower: UserTower::Id,
            item_item: false,
        };
        let features = Text::Cached(TextFeatures {
            users: Tensor::randn([n_users, 12], (Kind::Float, tch::Device::Cpu)),
            items: Tensor::randn([n_items, 12], (Kind::Float, tch::Device::Cpu)),
        });
        let m = Recommender::new(&vs.root(), config, if text { features } else { Text::None });
        let (users, items) = m.tables(tch::Device::Cpu);
        let _guard = tch::no_grad_guard();
        for (side, n, table) in [(Side::User, n_users, users), (Side::Item, n_items, items)] {
            let chunks: Vec<Tensor> = (0..n)
                .step_by(ENCODE_ROWS as usize)
                .map(|start| {
                    let len = ENCODE_ROWS.min(n - start);
                    m.repr(
                        side,
                        &Tensor::arange_start(start, start + len, (Kind::Int64, tch::Device::Cpu)),
                        false,
                    )
                })
                .collect();
            assert!(table.equal(&Tensor::cat(&chunks, 0)), "text {text}");
        }
    }
}

#[test]
fn score_all_items_agrees_with_pairwise_scores() {
    for (scorer, text) in SCORERS_AND_TEXT {
        let (_vs, m) = model(scorer, text);
        let users = ids(&[0, 3]);
        let all = m.score_all_items(&users);
        assert_eq!(all.size(), vec![2, 7]);
        for (row, u) in [0i64, 3].iter().enumerate() {
            let items = Tensor::arange(7, (Kind::Int64, tch::Device::Cpu));
            let pair = m.score(
                &Tensor::full([7], *u, (Kind::Int64, tch::Device::Cpu)),
                &items,
            );
            let diff = (all.get(row as i64) - pair).abs().max().double_value(&[]);
            assert!(diff < 1e-5, "{scorer:?} text={text}: {diff}");
        }
    }
}

#[test]
fn scores_are_not_squashed_by_a_sigmoid() {
    let (_vs, m) = model(Scorer::Dot, false);
    // Scale the embeddings up: a raw inner product grows without bound.
    let _guard = tch::no_grad_guard();
    let big = m.score(&ids(&[1]), &ids(&[1])).abs().double_value(&[0]);
    let _ = m
        .user_id
        .ws
        .shallow_clone()
        .f_mul_(&Tensor::from(100.0))
        .unwrap();
    let bigger = m.score(&ids(&[1]), &ids(&[1])).abs().double_value(&[0]);
    assert!(bigger > 1.0 && bigger > big * 50.0, "{big} -> {bigger}");
}

#[test]
fn bpr_training_ranks_positives_above_negatives() {
    for scorer in [Scorer::Dot, Scorer::Mlp] {
        let (vs, m) = model(scorer, true);
        let mut opt = nn::Adam::default().build(&vs, 1e-2).unwrap();
        // The ID tables' sparse backward adds into dense gradients (tch's Adam takes no
        // sparse ones), as the DDP engine gives them and keeps them (zeroed, not unset as
        // `Optimizer::zero_grad` does).
        let mut params = vs.trainable_variables();
        runtime::ddp::give_dense_grads(&params).unwrap();
        let (u, p, n) = (
            ids(&[0, 1, 2, 3, 4]),
            ids(&[1, 2, 3, 4, 5]),
            ids(&[6, 6, 0, 0, 6]),
        );
        let first = m.bpr_loss(&u, &p, &n, 1e-4, true).double_value(&[]);
        for _ in 0..200 {
            params.iter_mut().for_each(Tensor::zero_grad);
            m.bpr_loss(&u, &p, &n, 1e-4, true).backward();
            opt.step();
        }
        let last = m.bpr_loss(&u, &p, &n, 1e-4, true).double_value(&[]);
        assert!(last < first * 0.2, "{scorer:?}: {first} -> {last}");
        let margin = (m.score(&u, &p) - m.score(&u, &n)).min().double_value(&[]);
        assert!(
            margin > 0.0,
            "{scorer:?}: a positive still ranks below its negative"
        );
    }
}

/// The full softmax (every item a negative, the positive's own copy left out) is the
/// cross-entropy of the positive over all the items' scores.
#[test]
fn the_full_softmax_is_cross_entropy_over_every_item() {
    for (scorer, text) in SCORERS_AND_TEXT {
        let (_vs, m) = model(scorer, text);
        let (u, p) = (ids(&[0, 1, 3, 4]), ids(&[2, 2, 6, 0]));
        let all = Tensor::arange(7, (Kind::Int64, tch::Device::Cpu));
        let loss = m
            .softmax_loss(&u, &p, &all, None, 0.0, false)
            .double_value(&[]);
        let expected = m
            .score_all_items(&u)
            .cross_entropy_for_logits(&p)
            .double_value(&[]);
        assert!(
            (loss - expected).abs() < 1e-5,
            "{scorer:?} {text}: {loss} vs {expected}"
        );
        // One correction for every item (uniform draws) changes nothing.
        let flat = Tensor::full([7], 1.5, (Kind::Float, tch::Device::Cpu));
        let corrected = m.softmax_loss(&u, &p, &all, Some(&flat), 0.0, false);
        assert!((corrected.double_value(&[]) - loss).abs() < 1e-5);
    }
}

/// Sampled negatives: a drawn copy of a sample's positive is left out of its softmax, and
/// the correction lowers each logit by its item's log expected count.
#[test]
fn sampled_softmax_masks_accidental_hits_and_corrects_by_log_q() {
    let (_vs, m) = model(Scorer::Dot, false);
    let (u, p) = (ids(&[0, 1]), ids(&[2, 5]));
    let negs = ids(&[2, 4, 4]);
    let log_q = Tensor::from_slice(&[0.0f32, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6]);
    let loss = m
        .softmax_loss(&u, &p, &negs, Some(&log_q), 0.0, false)
        .double_value(&[]);
    let s = |user: i64, item: i64| m.score(&ids(&[user]), &ids(&[item])).double_value(&[0]);
    let q = |item: i64| 0.1 * item as f64;
    let ce = |logits: &[f64]| {
        let max = logits.iter().cloned().fold(f64::MIN, f64::max);
        let sum: f64 = logits.iter().map(|l| (l - max).exp()).sum();
        -(logits[0] - max - sum.ln())
    };
    // User 0's positive 2 was also drawn: its copy is out; user 1's 5 was not.
    let first = ce(&[s(0, 2) - q(2), s(0, 4) - q(4), s(0, 4) - q(4)]);
    let second = ce(&[
        s(1, 5) - q(5),
        s(1, 2) - q(2),
        s(1, 4) - q(4),
        s(1, 4) - q(4),
    ]);
    let expected = (first + second) / 2.0;
    assert!((loss - expected).abs() < 1e-5, "{loss} vs {expected}");
}

#[test]
fn softmax_training_ranks_positives_first_and_l2_counts_users_and_positives() {
    let (vs, m) = model(Scorer::Dot, true);
    let mut opt = nn::Adam::default().build(&vs, 1e-2).unwrap();
    let mut params = vs.trainable_variables();
    runtime::ddp::give_dense_grads(&params).unwrap();
    let (u, p) = (ids(&[0, 1, 2, 3, 4]), ids(&[1, 2, 3, 4, 5]));
    let negs = Tensor::arange(7, (Kind::Int64, tch::Device::Cpu));
    for _ in 0..200 {
        params.iter_mut().for_each(Tensor::zero_grad);
        m.softmax_loss(&u, &p, &negs, None, 1e-4, true).backward();
        opt.step();
    }
    let scores = m.score_all_items(&u);
    let top = scores.argmax(1, false);
    assert!(top.equal(&p), "positives are not ranked first: {top:?}");
    let plain = m
        .softmax_loss(&u, &p, &negs, None, 0.0, true)
        .double_value(&[]);
    let with = m
        .softmax_loss(&u, &p, &negs, None, 0.5, true)
        .double_value(&[]);
    let norms = (m.user_id.forward(&u).square().sum(Kind::Float)
        + m.item_id.forward(&p).square().sum(Kind::Float))
    .double_value(&[])
        / 5.0;
    assert!((with - plain - 0.5 * norms).abs() < 1e-5);
}

fn history_model(tower: UserTower) -> (nn::VarStore, Recommender) {
    tch::manual_seed(0);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let mut m = Recommender::new(&vs.root(), config(4, 6, 3, tower), Text::None);
    // User 3 is cold: no history.
    m.set_history(History::new(&[vec![0, 2, 5], vec![1], vec![0, 1, 2, 3]]));
    (vs, m)
}

/// A user is the sum of their history's rows over the square root of their number (plus
/// the ID row with "both"); a cold user is the average warm user.
#[test]
fn the_history_tower_pools_each_user_s_items() {
    for tower in [UserTower::History, UserTower::Both] {
        let (_vs, m) = history_model(tower);
        let h = m.history_item.as_ref().unwrap();
        let rows = |items: &[i64]| {
            h.forward(&ids(items))
                .sum_dim_intlist(0, false, Kind::Float)
        };
        let id = |u: i64| match tower {
            UserTower::Both => m.user_id.forward(&ids(&[u])).squeeze_dim(0),
            _ => Tensor::zeros([8], (Kind::Float, tch::Device::Cpu)),
        };
        let (users, _) = m.tables(tch::Device::Cpu);
        let expected = [
            rows(&[0, 2, 5]) / 3f64.sqrt() + id(0),
            rows(&[1]) + id(1),
            rows(&[0, 1, 2, 3]) / 2.0 + id(2),
        ];
        for (u, e) in expected.iter().enumerate() {
            let diff = (users.get(u as i64) - e).abs().max().double_value(&[]);
            assert!(diff < 1e-6, "{tower:?} user {u}: {diff}");
        }
        // A cold user is the average warm user: ID row (with "both") and pool.
        let pools = Tensor::stack(
            &[
                rows(&[0, 2, 5]) / 3f64.sqrt(),
                rows(&[1]),
                rows(&[0, 1, 2, 3]) / 2.0,
            ],
            0,
        )
        .mean_dim([0i64].as_slice(), false, Kind::Float);
        let stand_in = match tower {
            UserTower::Both => {
                m.user_id
                    .ws
                    .narrow(0, 0, 3)
                    .mean_dim([0i64].as_slice(), false, Kind::Float)
                    + &pools
            }
            _ => pools.shallow_clone(),
        };
        let cold = users.get(3).abs().max().double_value(&[]);
        let diff = (users.get(3) - stand_in).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "{tower:?}: cold user {cold} {diff}");
    }
}

/// In training a sample's own positive is left out of its user's pool (only that sample's):
/// the loss is that of the user pooled without it.
#[test]
fn training_leaves_the_positive_out_of_its_own_pool() {
    let (_vs, m) = history_model(UserTower::History);
    let h = m.history_item.as_ref().unwrap();
    let negatives = Tensor::arange(6, (Kind::Int64, tch::Device::Cpu));
    let loss = m
        .softmax_loss(
            &ids(&[0, 0, 1]),
            &ids(&[2, 5, 1]),
            &negatives,
            None,
            0.0,
            true,
        )
        .double_value(&[]);
    let all = m.item_id.ws.shallow_clone();
    let ce = |pool: Tensor, pos: i64| {
        pool.unsqueeze(0)
            .matmul(&all.transpose(0, 1))
            .cross_entropy_for_logits(&ids(&[pos]))
            .double_value(&[])
    };
    let rows = |items: &[i64]| {
        h.forward(&ids(items))
            .sum_dim_intlist(0, false, Kind::Float)
    };
    let expected = (ce(rows(&[0, 5]) / 2f64.sqrt(), 2)
        + ce(rows(&[0, 2]) / 2f64.sqrt(), 5)
        + ce(Tensor::zeros([8], (Kind::Float, tch::Device::Cpu)), 1))
        / 3.0;
    assert!((loss - expected).abs() < 1e-5, "{loss} vs {expected}");
    // Evaluation pools the whole history.
    let whole = m.score(&ids(&[0]), &ids(&[2])).double_value(&[0]);
    let pool = rows(&[0, 2, 5]) / 3f64.sqrt();
    let direct = (pool * m.item_id.ws.get(2))
        .sum(Kind::Float)
        .double_value(&[]);
    assert!((whole - direct).abs() < 1e-6);
}

/// The history model with the item-item matrix, its entries drawn at random (it starts at zero).
fn item_item_model() -> (nn::VarStore, Recommender) {
    tch::manual_seed(0);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let config = RecConfig {
        item_item: true,
        ..config(4, 6, 3, UserTower::History)
    };
    let mut m = Recommender::new(&vs.root(), config, Text::None);
    m.set_history(History::new(&[vec![0, 2, 5], vec![1], vec![0, 1, 2, 3]]));
    let _guard = tch::no_grad_guard();
    let w = m.item_item.as_ref().unwrap().ws.shallow_clone();
    assert_eq!(w.abs().max().double_value(&[]), 0.0, "starts at zero");
    w.shallow_clone().copy_(&Tensor::randn_like(&w));
    (vs, m)
}

/// Every score (all items, pairs, the tables, a cold user's) is the low-rank score plus the
/// user's pool of the item-item rows, pooled as the history rows are.
#[test]
fn the_item_item_matrix_adds_each_user_s_pooled_rows_to_every_score() {
    let (_vs, m) = item_item_model();
    let w = m.item_item.as_ref().unwrap().ws.shallow_clone();
    let pool = |items: &[i64]| {
        w.index_select(0, &ids(items))
            .sum_dim_intlist(0, false, Kind::Float)
            / (items.len() as f64).sqrt()
    };
    let pools = [pool(&[0, 2, 5]), pool(&[1]), pool(&[0, 1, 2, 3])];
    let cold = Tensor::stack(&pools, 0).mean_dim([0i64].as_slice(), false, Kind::Float);
    let extra = Tensor::stack(&[&pools[0], &pools[1], &pools[2], &cold], 0);
    let users = ids(&[0, 1, 2, 3]);
    let all = m.score_all_items(&users);
    let low_rank = m
        .repr(Side::User, &users, false)
        .matmul(&m.item_id.ws.transpose(0, 1));
    let close = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]) < 1e-5;
    assert!(close(&all, &(low_rank + &extra)));
    let (user_table, item_table) = m.tables(tch::Device::Cpu);
    assert_eq!(
        user_table.size(),
        [4, 8 + 6],
        "a user row ends with its item scores"
    );
    assert!(close(&m.score_tables(&user_table, &item_table), &all));
    for u in 0..4 {
        let pair = m.score(
            &Tensor::full([6], u, (Kind::Int64, tch::Device::Cpu)),
            &ids(&[0, 1, 2, 3, 4, 5]),
        );
        assert!(close(&pair, &all.get(u)), "user {u}");
    }
}

/// The training losses add the item-item scores of the pool without the sample's positive.
#[test]
fn the_item_item_scores_of_a_training_sample_leave_its_positive_out() {
    let (_vs, m) = item_item_model();
    let w = m.item_item.as_ref().unwrap().ws.shallow_clone();
    let h = m.history_item.as_ref().unwrap().ws.shallow_clone();
    let pool = |t: &Tensor, items: &[i64]| {
        t.index_select(0, &ids(items))
            .sum_dim_intlist(0, false, Kind::Float)
            / (items.len() as f64).sqrt()
    };
    let logits =
        |items: &[i64]| pool(&h, items).matmul(&m.item_id.ws.transpose(0, 1)) + pool(&w, items);
    let ce = |l: Tensor, pos: i64| {
        l.unsqueeze(0)
            .cross_entropy_for_logits(&ids(&[pos]))
            .double_value(&[])
    };
    let negatives = Tensor::arange(6, (Kind::Int64, tch::Device::Cpu));
    let loss = m
        .softmax_loss(&ids(&[0, 2]), &ids(&[2, 3]), &negatives, None, 0.0, true)
        .double_value(&[]);
    let expected = (ce(logits(&[0, 5]), 2) + ce(logits(&[0, 1, 2]), 3)) / 2.0;
    assert!((loss - expected).abs() < 1e-5, "{loss} vs {expected}");
    let bpr = m
        .bpr_loss(&ids(&[0]), &ids(&[2]), &ids(&[4]), 0.0, true)
        .double_value(&[]);
    let l = logits(&[0, 5]);
    let diff = l.get(2) - l.get(4);
    let expected = -(diff.sigmoid() + 1e-10).log().double_value(&[]);
    assert!((bpr - expected).abs() < 1e-5, "{bpr} vs {expected}");
}

/// The full softmax's own path (negatives `0..n` in order) and the general one (the same items
/// in another order) give the same loss and the same gradients, the item-item matrix and the
/// penalties included.
#[test]
fn the_full_softmax_path_equals_the_general_one() {
    let (vs, m) = item_item_model();
    full_and_general_agree(&vs, &m, &ids(&[0, 2, 1, 0]), &ids(&[2, 3, 1, 5]), 6);
    // Every scorer, with and without text (its penalty too), 2 of 7 items cold.
    for (scorer, text) in SCORERS_AND_TEXT {
        let config = RecConfig {
            scorer,
            n_warm_items: 5,
            text_l2: 0.5,
            ..config(5, 7, 5, UserTower::Id)
        };
        let (vs, m) = model_with(config, text);
        full_and_general_agree(&vs, &m, &ids(&[0, 4, 1, 3]), &ids(&[2, 0, 4, 2]), 5);
    }
}

/// The loss and gradients of users `u` with positives `p` against every warm item `0..n`,
/// through the full softmax's own path and through the general one (the same items reversed).
fn full_and_general_agree(vs: &nn::VarStore, m: &Recommender, u: &Tensor, p: &Tensor, n: i64) {
    let params = vs.trainable_variables();
    runtime::ddp::give_dense_grads(&params).unwrap();
    let (u, p) = (u.shallow_clone(), p.shallow_clone());
    let run = |negatives: &Tensor| {
        params.iter().for_each(|t| t.shallow_clone().zero_grad());
        let loss = m.softmax_loss(&u, &p, negatives, None, 0.3, true);
        loss.backward();
        let grads: Vec<Tensor> = params.iter().map(|t| t.grad().copy()).collect();
        (loss.double_value(&[]), grads)
    };
    let in_order = Tensor::arange(n, (Kind::Int64, tch::Device::Cpu));
    assert_eq!(every_item(&p, &in_order, None), Some(n));
    let reversed = in_order.flip([0i64].as_slice());
    assert_eq!(every_item(&p, &reversed, None), None);
    let (full, full_grads) = run(&in_order);
    let (general, general_grads) = run(&reversed);
    assert!((full - general).abs() < 1e-5, "{full} vs {general}");
    for (a, b) in full_grads.iter().zip(&general_grads) {
        let gap = (a - b).abs().max().double_value(&[]);
        assert!(gap < 1e-5, "gradients differ by {gap}");
    }
    let flat = Tensor::zeros([n], (Kind::Float, tch::Device::Cpu));
    assert_eq!(every_item(&p, &in_order, Some(&flat)), None, "a correction");
    assert_eq!(
        every_item(&ids(&[n]), &in_order, None),
        None,
        "a positive outside"
    );
}

/// Summing each distinct user's rows once (training without dropout) gives each sample's pool
/// as pooling it alone does, users repeated and a positive outside the history included.
#[test]
fn item_item_scores_summed_once_per_user_are_each_sample_s_pool() {
    let (_vs, mut m) = item_item_model();
    let (users, positives) = (ids(&[0, 0, 2, 0, 1, 2]), ids(&[2, 5, 3, 0, 1, 4]));
    let once = m.item_scores(&users, Some(&positives)).unwrap();
    let table = m.item_item.as_ref().unwrap();
    let each = m.pool_of(table, &users, Some(&positives));
    let diff = (&once - &each).abs().max().double_value(&[]);
    assert!(diff < 1e-5, "{diff}");
    assert_eq!(
        once.get(4).abs().max().double_value(&[]),
        0.0,
        "user 1's only item is out"
    );
    // With dropout every sample is pooled on its own.
    m.set_pool_dropout(Some(PoolDropout { rate: 0.5, key: 7 }));
    let dropped = m.item_scores(&users, Some(&positives)).unwrap();
    let each = m.pool_of(m.item_item.as_ref().unwrap(), &users, Some(&positives));
    assert!(dropped.equal(&each));
}

#[test]
fn l2_adds_the_squared_norms_of_the_batch_embeddings() {
    let (_vs, m) = model(Scorer::Dot, false);
    let (u, p, n) = (ids(&[0, 1]), ids(&[2, 3]), ids(&[4, 5]));
    let plain = m.bpr_loss(&u, &p, &n, 0.0, true).double_value(&[]);
    let with = m.bpr_loss(&u, &p, &n, 0.5, true).double_value(&[]);
    let norms = (m.user_id.forward(&u).square().sum(Kind::Float)
        + m.item_id.forward(&p).square().sum(Kind::Float)
        + m.item_id.forward(&n).square().sum(Kind::Float))
    .double_value(&[])
        / 2.0;
    assert!((with - plain - 0.5 * norms).abs() < 1e-5);
}

#[test]
fn popularity_counts_training_interactions() {
    let train = vec![vec![0, 2], vec![2], vec![2, 3, 9]];
    assert_eq!(popularity_scores(&train, 4), vec![1.0, 0.0, 3.0, 1.0]);
}
