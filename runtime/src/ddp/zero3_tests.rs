//! ZeRO stages 1-3 against DDP: a model of six declared units run twice a micro-batch (each layer gathered around its
//! forward and its backward) and an embedding table gathered for each whole window, trained
//! with gradient accumulation and clipping on sizes no world divides, over the tcp ring, the
//! ring with shared memory and two hosts of two: the same loss, norms, parameters and moments,
//! bit for bit, and between steps no declared parameter holds its values.

use std::time::Duration;

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use super::param_storage::storage_bytes;
use super::{Ddp, DdpConfig, MicroBatchLoss, ParamGate};
use crate::collective::tcp::{TcpCollective, TcpOptions};
use crate::collective::Collective;

/// An embedding table, then three layers, each a declared unit; a frozen layer declared too.
struct Tower {
    table: nn::Embedding,
    layers: Vec<(String, nn::Linear)>,
    frozen: nn::Linear,
    targets: Tensor,
    gate: Option<ParamGate>,
}

impl Tower {
    fn new(vs: &nn::VarStore) -> Tower {
        let root = vs.root();
        let table = nn::embedding(&root / "table", 37, 6, Default::default());
        let sizes = [(6, 7), (7, 5), (5, 5), (5, 6), (6, 5), (5, 5)];
        let layers = (sizes.iter().enumerate())
            .map(|(k, &(i, o))| {
                let name = format!("layer{k}");
                let layer = nn::linear(&root / name.as_str(), i, o, Default::default());
                (format!("{name}."), layer)
            })
            .collect();
        let mut frozen = nn::linear(&root / "frozen", 5, 1, Default::default());
        frozen.ws = frozen.ws.set_requires_grad(false);
        if let Some(bs) = frozen.bs.as_mut() {
            *bs = bs.set_requires_grad(false);
        }
        // The values too: the rank threads draw from one global generator in no fixed order.
        tch::no_grad(|| {
            let mut variables: Vec<_> = vs.variables().into_iter().collect();
            variables.sort_by(|a, b| a.0.cmp(&b.0));
            for (k, (_, mut v)) in variables.into_iter().enumerate() {
                let n = v.numel() as i64;
                let values = (Tensor::arange(n, (Kind::Float, tch::Device::Cpu)) * 0.7 + k as f64)
                    .sin()
                    * 0.5;
                v.copy_(&values.view(v.size().as_slice()));
            }
        });
        let targets = Tensor::arange(37, (Kind::Float, tch::Device::Cpu)).sin() * 2.0;
        Tower {
            table,
            layers,
            frozen,
            targets,
            gate: None,
        }
    }

    fn unit<T>(
        &self,
        name: &str,
        input: &Tensor,
        run: impl FnOnce() -> T,
        outputs: impl Fn(&T) -> Vec<&Tensor>,
    ) -> T {
        if let Some(gate) = &self.gate {
            gate.enter(name).unwrap();
        }
        let out = run();
        if let Some(gate) = &self.gate {
            gate.leave(name, &[input], &outputs(&out)).unwrap();
        }
        out
    }
}

impl MicroBatchLoss<Vec<i64>> for Tower {
    /// Two passes through the layers (the ids, then the ids shifted), as the recommender runs
    /// GPT-2 on users' and items' texts.
    fn loss(&mut self, micro: &Vec<i64>) -> Result<Tensor, tch::TchError> {
        let ids = Tensor::from_slice(micro);
        let mut passes = Vec::new();
        for shift in [0, 5] {
            let ids = (&ids + shift).remainder(37);
            let mut x = self.table.forward(&ids);
            for (name, layer) in &self.layers {
                x = self.unit(name, &x, || layer.forward(&x).tanh(), |y| vec![y]);
            }
            let out = self.unit("frozen.", &x, || self.frozen.forward(&x), |y| vec![y]);
            let y = self.targets.index_select(0, &ids).unsqueeze(1);
            passes.push((out - y).square().mean(Kind::Float));
        }
        Ok(&passes[0] + &passes[1])
    }
}

/// The clipping threshold: about the middle of the norms at `world` (they shrink as the
/// average takes more samples), so that some steps clip and others do not.
fn clip_at(world: usize) -> f64 {
    0.9 / (world as f64).sqrt()
}

/// (losses, norms, parameters, moments) of 12 steps at `zero`, rank 0's.
type Run = (Vec<f64>, Vec<f64>, Vec<Vec<f32>>, Vec<Vec<f32>>);

fn train(rank: usize, ring: TcpCollective, zero: u8, offload: bool) -> Run {
    let world = ring.world_size();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let mut model = Tower::new(&vs);
    let config = DdpConfig {
        grad_accum: 2,
        bucket_bytes: 64,
        max_grad_norm: clip_at(world),
        check_params_every: 5,
        timeout: Duration::from_secs(20),
        sparse: Vec::new(),
        shared_tables: false,
        shard_optimizer: false,
        overlap_backward: false,
        zero,
        units: (0..6)
            .map(|k| format!("layer{k}."))
            .chain(["frozen.".to_string()])
            .collect(),
        offload,
    };
    let mut ddp = Ddp::new(Box::new(ring), &vs, config).unwrap();
    model.gate = ddp.param_gate();
    assert_eq!(model.gate.is_some(), zero == 3 && world > 1);
    if let Some(gate) = &model.gate {
        let e = gate.enter("layer9.").unwrap_err().to_string();
        assert!(e.contains("did not declare"), "{e}");
    }
    let mut adam = ddp.optimizer(0.9, 0.999, 1e-8, 0.01);
    let sampler = crate::sampler::DistributedSampler::new(37, world, rank, 5).unwrap();
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    'train: for epoch in 0.. {
        for window in sampler.batches(epoch, 3, 0, true).chunks_exact(2) {
            let window: Vec<Vec<i64>> = (window.iter())
                .map(|m| m.iter().map(|&i| i as i64).collect())
                .collect();
            let step = losses.len() as u64;
            let stats = ddp
                .step(&window, &mut model, &mut adam, 0.05, step)
                .unwrap();
            losses.push(stats.loss);
            norms.push(stats.grad_norm);
            // Offloaded, every step copies each kept value out and back and its gradient out
            // (the layers' kept shards, the table whole): the path a GPU run takes.
            assert_eq!(adam.offloaded(), offload);
            let kept: u64 = (ddp.params().iter().enumerate())
                .map(|(i, p)| adam.elements_kept(i).map_or(p.numel(), |e| e.count()) as u64)
                .sum();
            assert_eq!(adam.offload_bytes(), if offload { 3 * 4 * kept } else { 0 });
            if model.gate.is_some() {
                // Between steps the layers keep their shards only; the table too.
                for (name, p) in vs.variables() {
                    let held = storage_bytes(&p).unwrap();
                    let sharded = !name.starts_with("frozen");
                    assert_eq!(held == 0, sharded, "{name} holds {held} bytes");
                }
            }
            if let Some(gate) = &model.gate {
                // Each pass's backward releases a layer once it is done: at most the one that
                // just ran and the next of the six, never all of them.
                let most = gate.most_units_held();
                assert!((1..=2).contains(&most), "{most} of 6 layers held at once");
            }
            if losses.len() == 12 {
                break 'train;
            }
        }
    }
    ddp.gather_params().unwrap();
    let flat = |t: &Tensor| Vec::<f32>::try_from(t.flatten(0, -1).to_kind(Kind::Float)).unwrap();
    let params = ddp.params().iter().map(flat).collect();
    let ctx = ddp.ctx(0);
    let state = ddp.optimizer_state(&adam, ctx).unwrap();
    let moments = state.iter().map(|(_, t)| flat(t)).collect();
    (losses, norms, params, moments)
}

/// A [`Run`]'s numbers as their bits.
type Bits = (Vec<u64>, Vec<u64>, Vec<Vec<u32>>, Vec<Vec<u32>>);

fn bits(run: &Run) -> Bits {
    let b64 = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect();
    let b32 = |v: &[Vec<f32>]| {
        v.iter()
            .map(|p| p.iter().map(|x| x.to_bits()).collect())
            .collect()
    };
    (b64(&run.0), b64(&run.1), b32(&run.2), b32(&run.3))
}

/// (hosts x ranks per host, or one host), world size, shared memory.
type Setup = (Option<(u32, u32)>, u32, bool);

#[test]
fn zero_stages_1_to_3_with_units_train_exactly_as_ddp_on_every_backend() {
    use crate::collective::tcp::test_ring::{with_hosts_owned, with_ring_owned_opts};
    let on = |hosts: Option<(u32, u32)>, world: u32, shared_memory: bool, (zero, offload)| {
        let body = move |rank, ring| train(rank, ring, zero, offload);
        let runs = match hosts {
            Some((hosts, per_host)) => with_hosts_owned(hosts, per_host, Default::default(), body),
            None => with_ring_owned_opts(world, TcpOptions { shared_memory }, body),
        };
        runs.into_iter().next().unwrap()
    };
    let mut setups: Vec<Setup> = (1..=4)
        .flat_map(|w| [(None, w, false), (None, w, true)])
        .collect();
    setups.push((Some((2, 2)), 4, false));
    for (hosts, world, shm) in setups {
        let at = format!("hosts {hosts:?}, world {world}, shared memory {shm}");
        let ddp = on(hosts, world, shm, (0, false));
        let clip = clip_at(world as usize);
        assert!(
            ddp.1.iter().any(|n| *n > clip),
            "{at}: no step clipped: {:?}",
            ddp.1
        );
        assert!(
            ddp.1.iter().any(|n| *n < clip),
            "{at}: every step clipped: {:?}",
            ddp.1
        );
        // Every stage reduces the same buckets (one per unit): the same bits at each, with the
        // optimizer offloaded to the host (moments and update) too.
        let stages = [1, 2, 3].map(|z| (z, false)).into_iter();
        for (zero, offload) in stages.chain([0, 1, 2, 3].map(|z| (z, true))) {
            assert_eq!(
                bits(&on(hosts, world, shm, (zero, offload))),
                bits(&ddp),
                "{at}, stage {zero} (offload {offload})"
            );
        }
    }
}
