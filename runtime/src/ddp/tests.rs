//! The DDP engine's tests: training through real rings on threads.
use super::*;

/// The runtime trains any `tch` model: a plain MLP regressing `y = x0 - 2 x1` data-parallel
/// over a real TCP ring of two ranks, with the sharded sampler, gradient accumulation and
/// AdamW — no recommender anywhere. The loss falls and the ranks end bit-identical.
#[test]
fn a_plain_mlp_trains_data_parallel_through_the_runtime_alone() {
    use crate::collective::tcp::test_ring::with_ring_owned;
    use tch::nn::{self, Module};

    struct Mlp {
        net: nn::Sequential,
        x: Tensor,
        y: Tensor,
    }
    impl MicroBatchLoss<Vec<usize>> for Mlp {
        fn loss(&mut self, micro: &Vec<usize>) -> Result<Tensor, tch::TchError> {
            let idx = Tensor::from_slice(&micro.iter().map(|&i| i as i64).collect::<Vec<_>>());
            let (x, y) = (self.x.index_select(0, &idx), self.y.index_select(0, &idx));
            Ok((self.net.forward(&x) - y).square().mean(tch::Kind::Float))
        }
    }

    let results = with_ring_owned(2, |rank, ring| {
        tch::manual_seed(7);
        let x = Tensor::randn([256, 2], (tch::Kind::Float, tch::Device::Cpu));
        let y = (x.select(1, 0) - x.select(1, 1) * 2.0).unsqueeze(1);
        tch::manual_seed(100 + rank as i64); // different on each rank: the broadcast fixes it
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let net = nn::seq()
            .add(nn::linear(vs.root() / "l1", 2, 16, Default::default()))
            .add_fn(|t| t.relu())
            .add(nn::linear(vs.root() / "l2", 16, 1, Default::default()));
        let mut model = Mlp { net, x, y };
        let config = DdpConfig {
            grad_accum: 2,
            bucket_bytes: 256,
            max_grad_norm: 1.0,
            check_params_every: 10,
            timeout: Duration::from_secs(20),
            sparse: Vec::new(),
            shared_tables: true,
            shard_optimizer: false,
            overlap_backward: false,
            zero: 0,
            units: Vec::new(),
            offload: false,
        };
        let world = ring.world_size();
        let mut ddp = Ddp::new(Box::new(ring), &vs, config).unwrap();
        let mut adam = AdamW::new(ddp.params(), 0.9, 0.999, 1e-8, 0.0);
        let sampler = crate::sampler::DistributedSampler::new(256, world, rank, 1).unwrap();
        let (mut first, mut last, mut step) = (None, 0.0, 0u64);
        for epoch in 0..30 {
            for window in sampler.batches(epoch, 16, 0, true).chunks(2) {
                let stats = ddp.step(window, &mut model, &mut adam, 0.02, step).unwrap();
                step += 1;
                first.get_or_insert(stats.loss);
                last = stats.loss;
            }
        }
        let params: Vec<Vec<f32>> = ddp
            .params()
            .iter()
            .map(|t| Vec::<f32>::try_from(t.flatten(0, -1)).unwrap())
            .collect();
        (first.unwrap(), last, params)
    });
    let (first, last, params0) = &results[0];
    assert!(last < &(first / 10.0), "loss {first} -> {last}");
    assert_eq!(params0, &results[1].2, "the ranks' parameters differ");
}

/// A tiny matrix-factorisation model (two embedding tables and a bias) over fixed random
/// (user, item, rating) triples: trains `steps` steps data-parallel over `world` ranks and
/// returns rank 0's loss curve and final parameters.
/// Sparse runs keep their tables in shared memory where they can (as by default).
fn train_embeddings(
    world: u32,
    options: crate::collective::tcp::TcpOptions,
    sparse: bool,
    steps: u64,
) -> (Vec<f64>, Vec<Vec<f32>>) {
    train_embeddings_hinted(world, options, sparse, Hint::None, steps, true)
}

/// What the test model says of the rows its micro-batches used.
#[derive(Clone, Copy, PartialEq)]
enum Hint {
    /// Nothing: the engine scans the gradients.
    None,
    /// The users and items looked up.
    Exact,
    /// Only the first half of the items: a model that under-reports.
    Short,
}

/// Where the test model's parameters live on the ranks of one host.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Keep {
    /// Every rank its own copy.
    Private,
    /// The row-sparse tables once per host (`shared_tables`).
    SharedTables,
    /// Every parameter once per host, each rank updating its rows (`shard_optimizer`).
    Sharded,
    /// Every rank its own copy, the dense buckets all-reduced during backward
    /// (`overlap_backward`).
    Overlapped,
    /// ZeRO stage 1 (`zero = 1`, `shard_optimizer` off): the dense parameters' moments
    /// sharded over the ranks, on any backend.
    Zero,
    /// [`Keep::Zero`] with the row-sparse tables once per host (`shared_tables`).
    ZeroSharedTables,
    /// [`Keep::Zero`] with the buckets reduce-scattered during backward (`overlap_backward`).
    ZeroOverlapped,
    /// ZeRO stage 2 (`zero = 2`): the gradients sharded too (reduce-scattered during backward,
    /// only the shard kept).
    Zero2,
}

/// Where the test's ranks run.
#[derive(Clone, Copy, Debug)]
enum Ranks {
    /// One ring of this many ranks on this host.
    Ring(u32, crate::collective::tcp::TcpOptions),
    /// This many hosts (each its own shared memory) of this many ranks.
    Hosts(u32, u32),
}

fn train_embeddings_hinted(
    world: u32,
    options: crate::collective::tcp::TcpOptions,
    sparse: bool,
    hint: Hint,
    steps: u64,
    shared_tables: bool,
) -> (Vec<f64>, Vec<Vec<f32>>) {
    let keep = if shared_tables {
        Keep::SharedTables
    } else {
        Keep::Private
    };
    let (losses, params, _) = train_embeddings_kept(world, options, sparse, hint, steps, keep);
    (losses, params)
}

/// A tiny matrix-factorisation model: two embedding tables and a bias over (user, item,
/// rating) rows of `data`, saying (per `hint`) which rows its micro-batches used.
struct Mf {
    users: nn::Embedding,
    items: nn::Embedding,
    bias: Tensor,
    data: Tensor,
    hint: Hint,
    used: Vec<(String, Vec<i64>)>,
}
impl MicroBatchLoss<Vec<i64>> for Mf {
    fn rows_used(&self, table: &str) -> Option<&[i64]> {
        let (_, rows) = self.used.iter().find(|(name, _)| name == table)?;
        Some(rows)
    }

    fn loss(&mut self, micro: &Vec<i64>) -> Result<Tensor, tch::TchError> {
        use tch::nn::Module;
        let rows = self.data.index_select(0, &Tensor::from_slice(micro));
        let (u, i) = (rows.select(1, 0), rows.select(1, 1));
        let ids = |t: &Tensor| Vec::<i64>::try_from(t).unwrap();
        let (mut users, mut items) = (ids(&u), ids(&i));
        if self.hint == Hint::Short {
            items.truncate(items.len() / 2);
        }
        self.used = match self.hint {
            Hint::None => Vec::new(),
            _ => vec![
                ("users.weight".into(), std::mem::take(&mut users)),
                ("items.weight".into(), std::mem::take(&mut items)),
            ],
        };
        let y = rows.select(1, 2).to_kind(tch::Kind::Float);
        let score = (self.users.forward(&u) * self.items.forward(&i)).sum_dim_intlist(
            1,
            false,
            tch::Kind::Float,
        ) + &self.bias;
        Ok((score - y).square().mean(tch::Kind::Float))
    }
}

/// [`train_embeddings_hinted`] with the parameters kept as `keep` says; also returns the
/// gradient norm of each step.
fn train_embeddings_kept(
    world: u32,
    options: crate::collective::tcp::TcpOptions,
    sparse: bool,
    hint: Hint,
    steps: u64,
    keep: Keep,
) -> (Vec<f64>, Vec<Vec<f32>>, Vec<f64>) {
    let ranks = Ranks::Ring(world, options);
    let (losses, params, norms, _) = train_embeddings_on(ranks, sparse, hint, steps, keep);
    (losses, params, norms)
}

/// The test model with deterministic data and weights (the RNG is shared by the rank threads);
/// `sparse`: the tables' backward is sparse too, added into the dense gradients the engine
/// gives them.
fn mf_model(sparse: bool, hint: Hint) -> (nn::VarStore, Mf) {
    let k = Tensor::arange(400, (tch::Kind::Int64, tch::Device::Cpu));
    let data = Tensor::stack(
        &[
            (&k * 7).remainder(200),
            (&k * 13).remainder(300),
            (&k * 5 + 1).remainder(5),
        ],
        1,
    );
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let emb = nn::EmbeddingConfig {
        sparse,
        ..Default::default()
    };
    let mut model = Mf {
        users: nn::embedding(vs.root() / "users", 200, 8, emb),
        items: nn::embedding(vs.root() / "items", 300, 8, emb),
        bias: vs.root().zeros("bias", &[1]),
        data,
        hint,
        used: Vec::new(),
    };
    tch::no_grad(|| {
        for (t, phase) in [(&mut model.users.ws, 0.3), (&mut model.items.ws, 1.7)] {
            let n = t.numel() as i64;
            let init = (Tensor::arange(n, (tch::Kind::Float, tch::Device::Cpu)) + phase)
                .sin()
                .view([-1, 8]);
            t.copy_(&init);
        }
    });
    (vs, model)
}

/// [`train_embeddings_kept`] on `ranks`; also returns the optimizer's whole state at the end
/// (moments gathered where sharded), as (name, values).
#[allow(clippy::type_complexity)]
fn train_embeddings_on(
    ranks: Ranks,
    sparse: bool,
    hint: Hint,
    steps: u64,
    keep: Keep,
) -> (Vec<f64>, Vec<Vec<f32>>, Vec<f64>, Vec<(String, Vec<f32>)>) {
    use crate::collective::tcp::test_ring::{with_hosts_owned, with_ring_owned_opts};
    let (world, options) = match ranks {
        Ranks::Ring(world, options) => (world, options),
        Ranks::Hosts(hosts, per_host) => (hosts * per_host, Default::default()),
    };
    let body = move |rank: usize, ring: crate::collective::tcp::TcpCollective| {
        let (vs, mut model) = mf_model(sparse, hint);
        let config = DdpConfig {
            grad_accum: 2,
            // Two buckets: the bias and the items' table together, the users' table alone.
            bucket_bytes: 12_000,
            max_grad_norm: 1.0,
            check_params_every: 25,
            timeout: Duration::from_secs(20),
            sparse: if sparse {
                vec!["users.weight".into(), "items.weight".into()]
            } else {
                Vec::new()
            },
            shared_tables: matches!(keep, Keep::SharedTables | Keep::ZeroSharedTables),
            shard_optimizer: keep == Keep::Sharded,
            overlap_backward: matches!(keep, Keep::Overlapped | Keep::ZeroOverlapped),
            zero: match keep {
                Keep::Zero | Keep::ZeroSharedTables | Keep::ZeroOverlapped => 1,
                Keep::Zero2 => 2,
                _ => 0,
            },
            units: Vec::new(),
            offload: false,
        };
        let mut ddp = Ddp::new(Box::new(ring), &vs, config).unwrap();
        let exchanged = if sparse && world > 1 { 2 } else { 0 };
        assert_eq!(ddp.sparse.len(), exchanged);
        let one_host = matches!(ranks, Ranks::Ring(..));
        let tables_kept_once = matches!(keep, Keep::SharedTables | Keep::ZeroSharedTables);
        let shared = exchanged > 0 && tables_kept_once && options.shared_memory && one_host;
        assert_eq!(ddp.shared_tables().len(), if shared { 2 } else { 0 });
        let sharded = keep == Keep::Sharded && world > 1 && options.shared_memory && one_host;
        assert_eq!(ddp.sharded(), sharded);
        let zero = match keep {
            Keep::Zero | Keep::ZeroSharedTables | Keep::ZeroOverlapped => 1,
            Keep::Zero2 => 2,
            _ => 0,
        };
        assert_eq!(ddp.zero_stage(), if world > 1 { zero } else { 0 });
        assert_eq!(
            ddp.overlaps_backward(),
            matches!(keep, Keep::Overlapped | Keep::ZeroOverlapped | Keep::Zero2) && world > 1
        );
        // The sparse runs also carry a probe (which moves the masks in the summary) and
        // must still train as the dense ones do.
        let top = world as usize - 1;
        let probed = |r: usize| r as f64 * 1.5 + 1.0;
        if sparse {
            ddp.set_probe(Box::new(move || probed(rank)));
        }
        // The last rank raises its stop flag before step 3: every rank is told at that step.
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        ddp.set_stop_flag(stop.clone());
        let mut adam = ddp.optimizer(0.9, 0.999, 1e-8, 0.01);
        if ddp.zero_stage() >= 1 {
            // Each rank keeps the moments of about 1/world of the dense parameters.
            let kept = |i: usize| adam.elements_kept(i).map(|e| e.end - e.start);
            let dense: i64 = (ddp.params().iter().enumerate())
                .filter(|(i, _)| kept(*i).is_some())
                .map(|(_, p)| p.numel() as i64)
                .sum();
            let mine: i64 = (0..ddp.params().len()).filter_map(kept).sum();
            let share = (dense + world as i64 - 1) / world as i64;
            assert!(mine <= share + 1, "rank {rank} keeps {mine} of {dense}");
        }
        let sampler =
            crate::sampler::DistributedSampler::new(400, world as usize, rank, 9).unwrap();
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        'train: for epoch in 0.. {
            for window in sampler.batches(epoch, 4, 0, true).chunks_exact(2) {
                let window: Vec<Vec<i64>> = window
                    .iter()
                    .map(|m| m.iter().map(|&i| i as i64).collect())
                    .collect();
                let step = losses.len() as u64;
                if rank == top && step == 3 {
                    stop.store(true, std::sync::atomic::Ordering::Relaxed);
                }
                let stats = match ddp.step(&window, &mut model, &mut adam, 0.05, step) {
                    Ok(stats) => stats,
                    // Rows left out are not exchanged: the ranks drift apart, and the
                    // parameter check must say so.
                    Err(DdpError::Diverged { detail, .. }) if hint == Hint::Short => {
                        assert!(detail.contains("`items.weight"), "{detail}");
                        if sharded {
                            assert!(detail.contains("did not report as used"), "{detail}");
                        }
                        break 'train;
                    }
                    Err(e) => panic!("step {step}: {e}"),
                };
                losses.push(stats.loss);
                norms.push(stats.grad_norm);
                assert_eq!(stats.probed_max, sparse.then(|| (top, probed(top))));
                assert_eq!(stats.stop_requested, step >= 3, "rank {rank} step {step}");
                if losses.len() as u64 == steps {
                    break 'train;
                }
            }
        }
        let params = ddp
            .params()
            .iter()
            .map(|t| Vec::<f32>::try_from(t.flatten(0, -1)).unwrap())
            .collect();
        let ctx = ddp.ctx(0);
        let state = (ddp.optimizer_state(&adam, ctx).unwrap().into_iter())
            .map(|(name, t)| {
                (
                    name,
                    Vec::<f32>::try_from(t.to_kind(tch::Kind::Float).flatten(0, -1)).unwrap(),
                )
            })
            .collect();
        (losses, params, norms, state)
    };
    let results = match ranks {
        Ranks::Ring(world, options) => with_ring_owned_opts(world, options, body),
        Ranks::Hosts(hosts, per_host) => {
            with_hosts_owned(hosts, per_host, Default::default(), body)
        }
    };
    results.into_iter().next().unwrap()
}

/// ZeRO stages 1 and 2 on every backend (`zero = 1`, `2`): the tcp ring (its own
/// reduce-scatter and all-gather), the ring with shared memory (its own too) and two hosts of
/// two (a whole all-reduce and a gathering copy); stage 1 after backward and during it
/// (`overlap_backward`), stage 2 during it with only the gradients' shards kept;
/// world 1 to 4, a bucket that no world divides
/// with rows crossing the shards' edges, gradient accumulation, clipping at work on some
/// steps, dense and row-sparse tables: loss, norms, parameters and both moments (gathered)
/// are DDP's, bit for bit.
#[test]
fn zero_stages_1_and_2_train_exactly_as_ddp_on_every_backend() {
    use crate::collective::tcp::TcpOptions;
    let bits32 = |v: &[Vec<f32>]| -> Vec<Vec<u32>> {
        v.iter()
            .map(|p| p.iter().map(|x| x.to_bits()).collect())
            .collect()
    };
    let bits64 = |v: &[f64]| -> Vec<u64> { v.iter().map(|x| x.to_bits()).collect() };
    let mut setups: Vec<Ranks> = (1..=4)
        .flat_map(|w| {
            [false, true].map(|shared_memory| Ranks::Ring(w, TcpOptions { shared_memory }))
        })
        .collect();
    setups.push(Ranks::Hosts(2, 2));
    for ranks in setups {
        for (sparse, hint) in [(false, Hint::None), (true, Hint::Exact)] {
            let run = |keep| train_embeddings_on(ranks, sparse, hint, 20, keep);
            let (loss, params, norms, state) = run(Keep::Private);
            let (z_loss, z_params, z_norms, z_state) = run(Keep::Zero);
            let at = format!("{ranks:?}, sparse {sparse}");
            assert!(
                norms.iter().any(|n| *n > 1.0),
                "{at}: no step clipped: {norms:?}"
            );
            assert_eq!(bits64(&z_norms), bits64(&norms), "{at}: norms");
            assert_eq!(bits64(&z_loss), bits64(&loss), "{at}: loss");
            assert_eq!(bits32(&z_params), bits32(&params), "{at}: parameters");
            let names =
                |s: &[(String, Vec<f32>)]| s.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
            let values = |s: &[(String, Vec<f32>)]| {
                bits32(&s.iter().map(|(_, v)| v.clone()).collect::<Vec<_>>())
            };
            assert_eq!(names(&z_state), names(&state), "{at}: state names");
            assert_eq!(values(&z_state), values(&state), "{at}: moments");
            // The same bits too: with the row-sparse tables kept once per host, as by default
            // (each rank updates its rows of them); with the buckets reduce-scattered during
            // backward by the communication thread (before the summary and the row-sparse
            // exchange); and under stage 2, only this rank's shard of each bucket's gradients
            // kept.
            for (keep, what) in [
                (Keep::ZeroSharedTables, "shared tables"),
                (Keep::ZeroOverlapped, "overlapped"),
                (Keep::Zero2, "stage 2"),
            ] {
                let (k_loss, k_params, k_norms, k_state) = run(keep);
                assert_eq!(bits64(&k_norms), bits64(&norms), "{at}, {what}: norms");
                assert_eq!(bits64(&k_loss), bits64(&loss), "{at}, {what}: loss");
                assert_eq!(
                    bits32(&k_params),
                    bits32(&params),
                    "{at}, {what}: parameters"
                );
                assert_eq!(values(&k_state), values(&state), "{at}, {what}: moments");
            }
        }
    }
}

/// ZeRO stage 1 on one host: every parameter once in shared memory, gradients produced
/// into it, each rank reducing, clipping and updating its rows. The same bits as the
/// unsharded step over many steps, with clipping at work on some of them and not on others, dense tables and row-sparse ones, 2 and 3 ranks (uneven rows).
#[test]
fn a_sharded_step_trains_exactly_as_the_unsharded_one() {
    use crate::collective::tcp::TcpOptions;
    let shm = TcpOptions::default();
    for (world, sparse, hint) in [
        (2, false, Hint::None),
        (2, true, Hint::None),
        (3, true, Hint::Exact),
        (3, false, Hint::None),
    ] {
        let run = |keep| train_embeddings_kept(world, shm, sparse, hint, 40, keep);
        let (loss, params, norms) = run(Keep::Private);
        assert!(loss[39] < loss[0], "{loss:?}");
        let clipped = norms.iter().filter(|n| **n > 1.0).count();
        assert!(
            clipped > 0 && clipped < 40,
            "clipping at work on some steps: {norms:?}"
        );
        let (sharded_loss, sharded_params, sharded_norms) = run(Keep::Sharded);
        let at = format!("{world} ranks, sparse {sparse}");
        assert_eq!(sharded_norms, norms, "{at}");
        assert_eq!(sharded_loss, loss, "{at}");
        assert_eq!(sharded_params, params, "{at}");
        // The buckets all-reduced during backward (before the summary and the row-sparse
        // exchange): the same bits too.
        let overlapped = run(Keep::Overlapped);
        assert_eq!(overlapped, (loss, params, norms), "{at}, overlapped");
    }
    // A model that leaves rows out: shared parameters cannot drift apart, so the check
    // counts the rows each rank's gradient touched outside the exchange.
    let (short, _, _) = train_embeddings_kept(2, shm, true, Hint::Short, 50, Keep::Sharded);
    assert_eq!(short.len(), 24, "stopped at the first check");
}

/// Row-sparse exchange of the embedding gradients (and their sparse backward) gives the
/// dense all-reduce's numbers: bit for bit through shared memory (each element is summed in
/// rank order either way), and
/// within float tolerance through the socket ring of three ranks (whose summation order
/// depends on where an element lies in the buffer).
#[test]
fn sparse_embedding_gradients_train_exactly_as_dense_ones() {
    use crate::collective::tcp::TcpOptions;
    let shm = TcpOptions::default();
    let (dense_loss, dense_params) = train_embeddings(2, shm, false, 50);
    let (sparse_loss, sparse_params) = train_embeddings(2, shm, true, 50);
    assert_eq!(dense_loss.len(), 50);
    assert!(dense_loss[49] < dense_loss[0], "{dense_loss:?}");
    assert_eq!(sparse_loss, dense_loss);
    assert_eq!(sparse_params, dense_params);
    // Tables kept by each rank (not shared) train alike too.
    let private = train_embeddings_hinted(2, shm, true, Hint::None, 50, false);
    assert_eq!(private, (dense_loss.clone(), dense_params.clone()));
    // The rows the model says it used replace the scan of the gradients: the same bits
    // when it says them all.
    let hinted = |hint, shared| train_embeddings_hinted(2, shm, true, hint, 50, shared);
    assert_eq!(
        hinted(Hint::Exact, true),
        (dense_loss.clone(), dense_params)
    );
    // A model that leaves rows out makes private tables drift apart (so the hint is what
    // is used), which the parameter check (every 25 steps) catches.
    let (short_loss, _) = hinted(Hint::Short, false);
    assert_eq!(short_loss.len(), 24, "stopped at the first check");
    // Kept once per host, the table is the same for every rank however wrong: the check
    // compares the averaged gradient each rank updated its rows from instead.
    let (short_loss, _) = hinted(Hint::Short, true);
    assert_eq!(
        short_loss.len(),
        24,
        "a shared table stopped at the first check too"
    );
    // Three ranks split the tables' rows unevenly (200 and 300 rows): still the same bits.
    let (dense3, dense3_params) = train_embeddings(3, shm, false, 30);
    assert_eq!(train_embeddings(3, shm, true, 30), (dense3, dense3_params));
    // Alone: only the backward is sparse.
    assert_eq!(
        train_embeddings(1, shm, true, 50),
        train_embeddings(1, shm, false, 50)
    );

    let sockets = TcpOptions {
        shared_memory: false,
    };
    let (dense_loss, _) = train_embeddings(3, sockets, false, 50);
    let (sparse_loss, _) = train_embeddings(3, sockets, true, 50);
    for (step, (d, s)) in dense_loss.iter().zip(&sparse_loss).enumerate() {
        assert!(
            (d - s).abs() <= 1e-5 * d.abs().max(1.0),
            "step {step}: {d} vs {s}"
        );
    }
}

/// A rank whose parameter no longer is the host's copy of a shared table (it would train
/// its own, unseen) fails the check at once, even while the values still agree.
#[test]
fn the_check_sees_a_rank_off_the_shared_table() {
    use crate::collective::tcp::test_ring::with_ring_owned_opts;
    let options = crate::collective::tcp::TcpOptions::default();
    let results = with_ring_owned_opts(2, options, |rank, ring| {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let table = vs.root().randn_standard("items", &[6, 4]);
        let config = DdpConfig {
            grad_accum: 1,
            bucket_bytes: 1 << 20,
            max_grad_norm: 1.0,
            check_params_every: 0,
            timeout: Duration::from_secs(20),
            sparse: vec!["items".into()],
            shared_tables: true,
            shard_optimizer: false,
            overlap_backward: false,
            zero: 0,
            units: Vec::new(),
            offload: false,
        };
        let mut ddp = Ddp::new(Box::new(ring), &vs, config).unwrap();
        assert_eq!(ddp.shared_tables(), vec!["items"]);
        ddp.check_params(1).unwrap();
        if rank == 1 {
            let private = tch::no_grad(|| table.copy());
            ddp.params[0].shallow_clone().set_data(&private);
        }
        ddp.check_params(2).map_err(|e| e.to_string())
    });
    for result in results {
        let message = result.unwrap_err();
        assert!(
            message.contains("at step 2: `items` is not the host's shared copy on rank(s) 1;"),
            "{message}"
        );
    }
}

/// The one-pass mask and the tensor-op one (for a transposed, non-contiguous view) agree:
/// a row counts when any element is non-zero, NaN included (so a NaN is exchanged and seen
/// by clipping), and -0.0 does not.
#[test]
fn touched_rows_marks_rows_with_any_non_zero() {
    let grad = Tensor::zeros([5, 3], (tch::Kind::Float, tch::Device::Cpu));
    let _ = grad.get(1).get(2).fill_(-2.5);
    let _ = grad.get(3).get(0).fill_(f64::NAN);
    let _ = grad.get(4).get(1).fill_(-0.0);
    let want = vec![0.0, 1.0, 0.0, 1.0, 0.0];
    let got = |t: &Tensor| touched_rows(t).unwrap();
    assert_eq!(got(&grad), want);
    let transposed = grad.tr().contiguous().tr();
    assert!(!transposed.is_contiguous());
    assert_eq!(got(&transposed), want);
}

#[test]
fn buckets_respect_the_size_and_cover_every_parameter_once() {
    let params: Vec<Tensor> = [10, 300, 5, 5, 1000, 1]
        .iter()
        .map(|&n| Tensor::zeros([n], (tch::Kind::Float, tch::Device::Cpu)))
        .collect();
    let buckets = make_buckets(&params, &[0, 1, 2, 3, 4, 5], 1024);
    let mut seen: Vec<usize> = buckets.iter().flatten().copied().collect();
    seen.sort();
    assert_eq!(seen, vec![0, 1, 2, 3, 4, 5]);
    for b in &buckets {
        let bytes: usize = b.iter().map(|&i| params[i].numel() * 4).sum();
        assert!(bytes <= 1024 || b.len() == 1, "{b:?} holds {bytes} bytes");
    }
    // Reverse order: the last parameter is in the first bucket.
    assert_eq!(buckets[0][0], 5);
    assert_eq!(buckets.len(), 5);
}

/// A one-rank group whose every collective counts itself (and does nothing: one rank's
/// average is itself).
struct Alone {
    calls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl crate::collective::Collective for Alone {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn name(&self) -> &'static str {
        "alone"
    }
    fn all_reduce(
        &mut self,
        _: &mut [Tensor],
        _: ReduceOp,
        _: OpContext,
    ) -> Result<(), CollectiveError> {
        self.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
    fn broadcast(
        &mut self,
        _: &mut [Tensor],
        _: usize,
        _: OpContext,
    ) -> Result<(), CollectiveError> {
        self.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
    fn all_gather(&mut self, t: &Tensor, _: OpContext) -> Result<Vec<Tensor>, CollectiveError> {
        self.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(vec![t.shallow_clone()])
    }
    fn barrier(&mut self, _: OpContext) -> Result<(), CollectiveError> {
        self.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

/// A linear model of 40 parameters in 4 tensors, its loss the mean square of its output.
struct Linear(tch::nn::Linear, tch::nn::Linear);

impl MicroBatchLoss<Vec<f32>> for Linear {
    fn loss(&mut self, micro: &Vec<f32>) -> Result<Tensor, tch::TchError> {
        use tch::nn::Module;
        let x = Tensor::from_slice(micro).view([-1, 4]);
        Ok(self
            .1
            .forward(&self.0.forward(&x))
            .square()
            .mean(tch::Kind::Float))
    }
}

fn linear_engine(
    comm: Box<dyn crate::collective::Collective>,
    grad_accum: usize,
) -> (Ddp, AdamW, Linear, tch::nn::VarStore) {
    tch::manual_seed(3);
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let model = Linear(
        tch::nn::linear(vs.root() / "a", 4, 6, Default::default()),
        tch::nn::linear(vs.root() / "b", 6, 2, Default::default()),
    );
    let config = DdpConfig {
        grad_accum,
        bucket_bytes: 64,
        max_grad_norm: 0.01,
        check_params_every: 0,
        timeout: Duration::from_secs(20),
        sparse: Vec::new(),
        shared_tables: false,
        shard_optimizer: false,
        overlap_backward: true,
        zero: 0,
        units: Vec::new(),
        offload: false,
    };
    let ddp = Ddp::new(comm, &vs, config).unwrap();
    let adam = AdamW::new(ddp.params(), 0.9, 0.999, 1e-8, 0.0);
    (ddp, adam, model, vs)
}

#[test]
fn a_one_rank_group_makes_no_collective_in_a_step() {
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let comm = Box::new(Alone {
        calls: calls.clone(),
    });
    let (mut ddp, mut adam, mut model, _vs) = linear_engine(comm, 2);
    let before = calls.load(std::sync::atomic::Ordering::Relaxed);
    let window = vec![vec![1.0f32; 8], vec![-2.0f32; 8]];
    for step in 0..3 {
        let stats = ddp
            .step(&window, &mut model, &mut adam, 0.01, step)
            .unwrap();
        assert!(stats.loss.is_finite() && stats.grad_norm > 0.0);
    }
    assert_eq!(
        calls.load(std::sync::atomic::Ordering::Relaxed),
        before,
        "collectives called"
    );
}

#[test]
fn a_step_reads_the_device_once_whatever_its_micro_batches() {
    // The counted reads of a step (host waits on a GPU): the summary, read once. On the CPU the
    // clipping norm is summed in place (no read); where gradients live on a device it is one
    // read more (`clip`'s own test).
    for grad_accum in [1, 3] {
        use crate::collective::tcp::test_ring::with_ring_owned;
        let reads = with_ring_owned(2, move |_, ring| {
            let (mut ddp, mut adam, mut model, _vs) = linear_engine(Box::new(ring), grad_accum);
            let window: Vec<Vec<f32>> = (0..grad_accum).map(|k| vec![k as f32 + 0.5; 8]).collect();
            (0..4)
                .map(|step| {
                    let before = crate::host_read::reads();
                    ddp.step(&window, &mut model, &mut adam, 0.01, step)
                        .unwrap();
                    crate::host_read::reads() - before
                })
                .collect::<Vec<u64>>()
        });
        assert_eq!(reads, vec![vec![1; 4]; 2], "grad_accum {grad_accum}");
    }
}

/// ZeRO stage 2 makes the zeros of its gradient shards positive by adding `0.0` (DDP's
/// gradients start from zeros, so theirs are): libtorch must not skip that addition.
#[test]
fn adding_zero_makes_negative_zeros_positive_and_keeps_every_other_value() {
    let values = [-0.0f32, 0.0, -1.5, 2.25, f32::MIN_POSITIVE, -f32::MAX];
    let t = Tensor::from_slice(&values);
    let _ = t.shallow_clone().f_add_scalar_(0.0).unwrap();
    let bits: Vec<u32> = Vec::<f32>::try_from(&t)
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect();
    let want: Vec<u32> = values.iter().map(|x| (x + 0.0).to_bits()).collect();
    assert_eq!(bits, want);
    assert_eq!(bits[0], 0, "-0.0 + 0.0 is 0.0");
}
