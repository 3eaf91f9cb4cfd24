//! Times DDP steps with and without `overlap_backward` on a model whose dense buckets are of
//! real size (the recommender's are not: a few hundred KiB), for `scripts/bench/overlap.sh`:
//! an MLP of `layers` square `hidden`-wide layers, 2 ranks on threads of this process over a
//! real ring (shared memory, or the socket ring with `sockets=1`), 2 micro-batches a step.
//! Runs of the two settings alternate, `repeat` times; each prints nothing until the end, then
//! one line per setting with the medians over the runs of the mean step time and of its
//! compute and collective parts (per rank, averaged), and the buckets started during backward.
//!
//! Usage: cargo run --release -p gptrec-runtime --features test-support --example overlap_bench
//!        -- [hidden=1024] [layers=4] [micro=64] [bucket_mb=5] [steps=20] [repeat=5] [sockets=0]

use std::time::{Duration, Instant};

use runtime::collective::tcp::{test_ring::with_ring_owned_opts, TcpOptions};
use runtime::ddp::{Ddp, DdpConfig, MicroBatchLoss};
use runtime::optim::AdamW;
use tch::nn::{self, Module};
use tch::{Kind, Tensor};

/// Settings from `key=value` arguments.
#[derive(Clone, Copy, Debug)]
struct Bench {
    hidden: i64,
    layers: usize,
    micro: i64,
    bucket_mb: f64,
    steps: usize,
    repeat: usize,
    sockets: bool,
}

/// One rank's means over a run's timed steps (the first, warm-up, excluded), in ms.
#[derive(Clone, Copy, Default)]
struct Times {
    step: f64,
    compute: f64,
    collective: f64,
    early: f64,
}

struct Mlp {
    net: nn::Sequential,
    x: Tensor,
    y: Tensor,
}

/// Every micro-batch is the same rows: only the time matters here.
impl MicroBatchLoss<()> for Mlp {
    fn loss(&mut self, _micro: &()) -> Result<Tensor, tch::TchError> {
        (self.net.forward(&self.x) - &self.y)
            .square()
            .f_mean(Kind::Float)
    }
}

fn parse(args: impl Iterator<Item = String>) -> Result<Bench, String> {
    let mut b = Bench {
        hidden: 1024,
        layers: 4,
        micro: 64,
        bucket_mb: 5.0,
        steps: 20,
        repeat: 5,
        sockets: false,
    };
    for arg in args {
        let (key, value) = arg
            .split_once('=')
            .ok_or(format!("{arg}: expected KEY=VALUE"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{arg}: {e}");
        match key {
            "hidden" => b.hidden = value.parse().map_err(|e| bad(&e))?,
            "layers" => b.layers = value.parse().map_err(|e| bad(&e))?,
            "micro" => b.micro = value.parse().map_err(|e| bad(&e))?,
            "bucket_mb" => b.bucket_mb = value.parse().map_err(|e| bad(&e))?,
            "steps" => b.steps = value.parse().map_err(|e| bad(&e))?,
            "repeat" => b.repeat = value.parse().map_err(|e| bad(&e))?,
            "sockets" => b.sockets = value == "1",
            _ => return Err(format!("{arg}: unknown key")),
        }
    }
    if b.steps < 2 || b.layers < 1 || b.hidden < 1 || b.micro < 1 {
        return Err("steps >= 2, layers, hidden and micro >= 1".into());
    }
    Ok(b)
}

/// One run of `b.steps` steps on 2 ranks; each rank's means.
fn run(b: Bench, overlap: bool) -> Vec<Times> {
    let options = TcpOptions {
        shared_memory: !b.sockets,
    };
    with_ring_owned_opts(2, options, move |_rank, ring| {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let mut net = nn::seq();
        for l in 0..b.layers {
            let layer = nn::linear(
                vs.root() / format!("l{l}"),
                b.hidden,
                b.hidden,
                Default::default(),
            );
            net = net.add(layer).add_fn(|t| t.tanh());
        }
        let x = Tensor::randn([b.micro, b.hidden], (Kind::Float, tch::Device::Cpu));
        let y = x.tanh();
        let mut model = Mlp { net, x, y };
        let config = DdpConfig {
            grad_accum: 2,
            bucket_bytes: (b.bucket_mb * 1024.0 * 1024.0) as usize,
            max_grad_norm: 1.0,
            check_params_every: 0,
            timeout: Duration::from_secs(60),
            sparse: Vec::new(),
            shared_tables: false,
            shard_optimizer: false,
            overlap_backward: overlap,
            zero: 0,
            units: Vec::new(),
            offload: false,
        };
        let mut ddp = Ddp::new(Box::new(ring), &vs, config).expect("engine");
        assert_eq!(ddp.overlaps_backward(), overlap);
        let mut adam = AdamW::new(ddp.params(), 0.9, 0.999, 1e-8, 0.0);
        let mut times = Times::default();
        for step in 0..b.steps as u64 {
            let started = Instant::now();
            let stats = ddp
                .step(&[(), ()], &mut model, &mut adam, 1e-4, step)
                .expect("step");
            if step == 0 {
                continue;
            }
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            times.step += ms(started.elapsed());
            times.compute += ms(stats.time.compute);
            times.collective += ms(stats.time.collective);
            times.early += ddp.buckets_during_backward() as f64;
        }
        let n = (b.steps - 1) as f64;
        Times {
            step: times.step / n,
            compute: times.compute / n,
            collective: times.collective / n,
            early: times.early / n,
        }
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn main() {
    // One intra-op thread per rank: the ranks are threads of one process here.
    tch::set_num_threads(1);
    let b = match parse(std::env::args().skip(1)) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("overlap_bench: {e}");
            std::process::exit(2);
        }
    };
    let grads_mib = (b.layers as f64) * ((b.hidden * b.hidden + b.hidden) * 4) as f64 / 1048576.0;
    println!("{b:?}: {grads_mib:.1} MiB of dense gradients");
    let mut runs: [Vec<Times>; 2] = [Vec::new(), Vec::new()];
    for _ in 0..b.repeat {
        for (overlap, into) in [false, true].into_iter().zip(runs.iter_mut()) {
            let ranks = run(b, overlap);
            let mean = |f: fn(&Times) -> f64| ranks.iter().map(f).sum::<f64>() / ranks.len() as f64;
            into.push(Times {
                step: mean(|t| t.step),
                compute: mean(|t| t.compute),
                collective: mean(|t| t.collective),
                early: mean(|t| t.early),
            });
        }
    }
    println!(
        "| overlap | step ms | compute ms | collective ms | buckets started in backward | runs |"
    );
    println!("|---|---|---|---|---|---|");
    for (overlap, times) in [false, true].into_iter().zip(&runs) {
        let m = |f: fn(&Times) -> f64| median(times.iter().map(f).collect());
        println!(
            "| {overlap} | {:.2} | {:.2} | {:.2} | {:.1} | {} |",
            m(|t| t.step),
            m(|t| t.compute),
            m(|t| t.collective),
            m(|t| t.early),
            times.len()
        );
    }
}
