//! Overlap's tests: the hooks themselves, and an MLP trained through real rings on threads with
//! and without overlap.

use std::sync::Arc;
use std::time::Duration;

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use super::Overlap;
use crate::collective::tcp::test_ring::with_ring_owned_opts;
use crate::collective::tcp::TcpOptions;
use crate::ddp::{Ddp, DdpConfig, MicroBatchLoss};
use crate::optim::AdamW;

const CPU: (Kind, tch::Device) = (Kind::Float, tch::Device::Cpu);

/// How the test MLP departs from a plain one.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Twist {
    None,
    /// Rank 1's loss is NaN at this micro-batch (counted over the run from 0).
    NanOnRank1(usize),
    /// `finish_backward` adds to the last layer's weight gradient; `says_whole`: the model
    /// claims it does not (`backward_is_whole`).
    LateGradient {
        says_whole: bool,
    },
}

/// Three linear layers over fixed data; the first two wide enough that their backward takes a
/// while after the last layer's gradients are ready.
struct Mlp {
    net: nn::Sequential,
    last: Tensor,
    x: Tensor,
    y: Tensor,
    rank: usize,
    calls: usize,
    twist: Twist,
}

impl MicroBatchLoss<Vec<usize>> for Mlp {
    fn loss(&mut self, micro: &Vec<usize>) -> Result<Tensor, tch::TchError> {
        let idx = Tensor::from_slice(&micro.iter().map(|&i| i as i64).collect::<Vec<_>>());
        let (x, y) = (self.x.index_select(0, &idx), self.y.index_select(0, &idx));
        let loss = (self.net.forward(&x) - y).square().mean(Kind::Float);
        let call = self.calls;
        self.calls += 1;
        Ok(match self.twist {
            Twist::NanOnRank1(at) if self.rank == 1 && call == at => loss * f64::NAN,
            _ => loss,
        })
    }

    fn finish_backward(&mut self) -> Result<(), tch::TchError> {
        if let Twist::LateGradient { .. } = self.twist {
            (self.last.f_sum(Kind::Float)? * 1e-3).f_backward()?;
        }
        Ok(())
    }

    fn backward_is_whole(&self) -> bool {
        self.twist != Twist::LateGradient { says_whole: false }
    }
}

/// What one rank's run gives.
#[derive(Debug)]
struct Run {
    losses: Vec<f64>,
    params: Vec<Vec<f32>>,
    /// Buckets started before backward had ended, over all steps.
    early: usize,
    /// The hooks' calls per parameter and the last armed pass's order, by name.
    calls: Option<(Vec<u64>, Vec<String>)>,
}

/// The same numbers on every rank, whatever the order the rank threads draw in.
fn deterministic(t: &mut Tensor, phase: f64) {
    tch::no_grad(|| {
        let n = t.numel() as i64;
        let values = (Tensor::arange(n, CPU) * 0.37 + phase).sin() * 0.05;
        t.copy_(&values.view(t.size().as_slice()));
    });
}

fn mlp(vs: &nn::VarStore, rank: usize, twist: Twist) -> Mlp {
    let root = vs.root();
    let net = nn::seq()
        .add(nn::linear(&root / "l1", 128, 512, Default::default()))
        .add_fn(|t| t.tanh())
        .add(nn::linear(&root / "l2", 512, 512, Default::default()))
        .add_fn(|t| t.tanh())
        .add(nn::linear(&root / "l3", 512, 1, Default::default()));
    let mut variables: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    variables.sort_by(|a, b| a.0.cmp(&b.0));
    for (k, (_, t)) in variables.iter_mut().enumerate() {
        deterministic(t, k as f64);
    }
    let mut x = Tensor::zeros([256, 128], CPU);
    deterministic(&mut x, 0.5);
    let x = x * 20.0;
    let y = (x.narrow(1, 0, 1) - x.narrow(1, 1, 1) * 2.0).tanh();
    let last = vs.variables()["l3.weight"].shallow_clone();
    Mlp {
        net,
        last,
        x,
        y,
        rank,
        calls: 0,
        twist,
    }
}

/// Trains the MLP `steps` steps over `world` ranks (2 micro-batches a step, 64 KiB buckets:
/// five of them), with or without overlap; each rank's run, or its error.
fn train_mlp(
    world: u32,
    options: TcpOptions,
    overlap: bool,
    twist: Twist,
    steps: usize,
) -> Vec<Result<Run, String>> {
    with_ring_owned_opts(world, options, move |rank, ring| -> Result<Run, String> {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let mut model = mlp(&vs, rank, twist);
        let config = DdpConfig {
            grad_accum: 2,
            bucket_bytes: 64 << 10,
            max_grad_norm: 1.0,
            check_params_every: 5,
            timeout: Duration::from_secs(20),
            sparse: Vec::new(),
            shared_tables: false,
            shard_optimizer: false,
            overlap_backward: overlap,
            zero: 0,
            units: Vec::new(),
            offload: false,
        };
        let mut ddp = Ddp::new(Box::new(ring), &vs, config).map_err(|e| e.to_string())?;
        assert_eq!(ddp.overlaps_backward(), overlap);
        assert_eq!(ddp.bucket_count(), 5);
        let mut adam = AdamW::new(ddp.params(), 0.9, 0.999, 1e-8, 0.01);
        let sampler =
            crate::sampler::DistributedSampler::new(256, world as usize, rank, 3).unwrap();
        let (mut losses, mut early) = (Vec::new(), 0);
        'train: for epoch in 0.. {
            for window in sampler.batches(epoch, 32, 0, true).chunks_exact(2) {
                let step = losses.len() as u64;
                let stats = (ddp.step(window, &mut model, &mut adam, 0.01, step))
                    .map_err(|e| e.to_string())?;
                losses.push(stats.loss);
                early += ddp.overlap.as_ref().map_or(0, |o| o.early);
                if losses.len() == steps {
                    break 'train;
                }
            }
        }
        let params = (ddp.params().iter())
            .map(|t| Vec::<f32>::try_from(t.flatten(0, -1)).unwrap())
            .collect();
        let calls = ddp.overlap.as_ref().map(|o| {
            let (calls, order) = o.calls();
            let names = order.iter().map(|&i| ddp.param_names[i].clone()).collect();
            (calls, names)
        });
        Ok(Run {
            losses,
            params,
            early,
            calls,
        })
    })
}

fn all_ok(runs: Vec<Result<Run, String>>) -> Vec<Run> {
    runs.into_iter()
        .enumerate()
        .map(|(rank, run)| run.unwrap_or_else(|e| panic!("rank {rank}: {e}")))
        .collect()
}

/// The buckets all-reduced during backward, as each becomes ready, give the numbers of the
/// buckets all-reduced after it, bit for bit: through shared memory (2 ranks) and through the
/// socket ring (3 ranks, where the summation order depends on the buffer's layout: the same
/// buckets keep it). And some buckets did start before backward had ended.
#[test]
fn overlapped_buckets_train_exactly_as_buckets_after_backward() {
    let sockets = TcpOptions {
        shared_memory: false,
    };
    for (world, options) in [(2, TcpOptions::default()), (3, sockets)] {
        let plain = all_ok(train_mlp(world, options, false, Twist::None, 12));
        let overlapped = all_ok(train_mlp(world, options, true, Twist::None, 12));
        let losses = &plain[0].losses;
        assert!(losses[11] < losses[0], "{losses:?}");
        for (p, o) in plain.iter().zip(&overlapped) {
            assert_eq!(o.losses, p.losses, "{world} ranks");
            assert_eq!(o.params, p.params, "{world} ranks");
            assert_eq!(p.early, 0);
        }
        assert_eq!(overlapped[0].params, overlapped[1].params);
        let early: usize = overlapped.iter().map(|r| r.early).sum();
        assert!(
            early > 0,
            "{world} ranks: no bucket started during backward"
        );
    }
}

/// A hook runs once per parameter and backward pass (every micro-batch's, and the one that
/// gives every parameter its dense gradient at the first step); in the armed pass the last
/// layer's gradients are ready first and the first layer's last, which is what lets bucket 0
/// (the last parameters by name) start early.
#[test]
fn hooks_fire_once_per_parameter_per_backward_last_layer_first() {
    let runs = all_ok(train_mlp(2, TcpOptions::default(), true, Twist::None, 3));
    for run in &runs {
        let (calls, order) = run.calls.clone().unwrap();
        assert_eq!(calls, vec![1 + 3 * 2; 6]);
        let layers: Vec<&str> = order.iter().map(|name| &name[..2]).collect();
        assert_eq!(layers, ["l3", "l3", "l2", "l2", "l1", "l1"], "{order:?}");
    }
}

/// A rank whose loss is not finite still takes part in every bucket's all-reduce (armed or
/// not: at the last micro-batch or before it), and the summary then stops every rank with the
/// usual message instead of leaving the others waiting.
#[test]
fn a_non_finite_loss_with_overlap_stops_every_rank() {
    // Step 3's micro-batches are the run's 5th and 6th.
    for at in [4, 5] {
        let runs = train_mlp(2, TcpOptions::default(), true, Twist::NanOnRank1(at), 10);
        let message = |rank: usize| runs[rank].as_ref().map(|_| ()).unwrap_err().clone();
        assert_eq!(
            message(1),
            "step 3: the loss is NaN on rank 1; lower train.lr or check the data"
        );
        assert_eq!(
            message(0),
            "step 3: the loss is not finite on another rank (see its message)"
        );
    }
}

/// A model whose `finish_backward` adds to gradients: when it says so, its buckets wait for
/// the end and it trains as without overlap; when it does not, every rank stops at once naming
/// the gradient that grew after its bucket could start.
#[test]
fn a_gradient_that_grows_after_backward_is_waited_for_or_caught() {
    let shm = TcpOptions::default();
    let said = Twist::LateGradient { says_whole: false };
    let plain = all_ok(train_mlp(2, shm, false, said, 6));
    let overlapped = all_ok(train_mlp(2, shm, true, said, 6));
    for (p, o) in plain.iter().zip(&overlapped) {
        assert_eq!((&o.losses, &o.params), (&p.losses, &p.params));
        assert_eq!(o.early, 0);
    }
    let unsaid = Twist::LateGradient { says_whole: true };
    for run in train_mlp(2, shm, true, unsaid, 6) {
        let message = run.map(|_| ()).unwrap_err();
        assert!(
            message.starts_with("step 1: the gradient of `l3.weight` was accumulated into again"),
            "{message}"
        );
    }
}

/// One hook per parameter: a second engine cannot hook it while the first lives, and the
/// first's hooks (and their references to the shared state) are gone once it is dropped.
#[test]
fn hooks_come_off_with_their_engine() {
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let w = vs.root().zeros("w", &[3]);
    let (params, names, buckets) = (vec![w.shallow_clone()], vec!["w".to_string()], [vec![0]]);
    let first = Overlap::new(&params, &names, &buckets).unwrap();
    let state = Arc::clone(&first.readiness);
    assert_eq!(
        Arc::strong_count(&state),
        3,
        "ours, the engine's, the hook's"
    );
    let refused = Overlap::new(&params, &names, &buckets).err().unwrap();
    assert_eq!(
        refused.to_string(),
        "cannot hook the gradient of `w` (for dist.overlap_backward or dist.zero = 2): it already has a post-accumulate-grad hook (another engine's?)"
    );
    w.sum(Kind::Float).backward();
    assert_eq!(first.calls().0, vec![1]);
    drop(first);
    assert_eq!(Arc::strong_count(&state), 1);
    let second = Overlap::new(&params, &names, &buckets).unwrap();
    w.sum(Kind::Float).backward();
    assert_eq!(second.calls().0, vec![1]);
    assert_eq!(state.calls[0].load(std::sync::atomic::Ordering::Relaxed), 1);
    let frozen = [Tensor::zeros([2], CPU)];
    let refused = Overlap::new(&frozen, &names, &buckets).err().unwrap();
    assert!(
        refused
            .to_string()
            .ends_with("not a leaf tensor that requires grad"),
        "{refused}"
    );
}
