//! `gpt2-step-bench`: memory and time of GPT-2 training steps with and without activation
//! checkpointing, for `scripts/bench/checkpointing.sh`. Run one process per setting: peak RSS is
//! a process's high-water mark.
//!
//! It builds the preset on the CPU (random initialisation, every weight trains, dropout on) and
//! runs `--steps` forward + backward passes shaped like the recommender's micro-batch in dynamic
//! mode: `micro` user texts and `2 x micro` item texts of `--tokens` tokens each, two GPT-2
//! passes. It prints one JSON line: RSS after the build, peak RSS, what the steps added, seconds
//! per step (after the first), and the memory estimate's terms for the same shape (GPT-2's
//! gradients and activations), so the two can be compared.
//!
//! `--bf16` runs the passes under the CPU's bf16 autocast (`train.bf16`), as
//! `scripts/bench/cpu_bf16.sh` compares with f32 and with PyTorch's.
//!
//! Usage: gpt2-step-bench [--preset gpt2|tiny] [--micro N] [--tokens T] [--steps S] [--checkpointing] [--bf16]

use std::time::Instant;

use anyhow::{bail, Result};
use clap::Parser;
use common::config::{Config, Gpt2Preset, TextMode};
use common::memory::{estimate, DataShape, DeviceKind, Gpt2Dims};
use recommender::model::autocast::{autocast_on, use_bf16_autocast_on};
use recommender::model::gpt2::Gpt2;
use tch::{nn, Device, Kind, Tensor};
use worker::memory::{peak_rss_bytes, rss_bytes};

#[derive(Debug, Parser)]
#[command(name = "gpt2-step-bench")]
struct Cli {
    /// GPT-2 size: "gpt2" (124M) or "tiny".
    #[arg(long, default_value = "gpt2")]
    preset: String,
    /// Samples per micro-batch (users; items are twice as many: positives and negatives).
    #[arg(long, default_value_t = 8)]
    micro: u64,
    /// Tokens per text.
    #[arg(long, default_value_t = 32)]
    tokens: i64,
    /// Training steps to run (at least 2: the first is not timed).
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Turn activation checkpointing on.
    #[arg(long)]
    checkpointing: bool,
    /// Run the passes under bf16 autocast on the CPU (`train.bf16`).
    #[arg(long)]
    bf16: bool,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let preset = match cli.preset.as_str() {
        "gpt2" => Gpt2Preset::Gpt2,
        "tiny" => Gpt2Preset::Tiny,
        other => bail!("--preset {other:?}: expected \"gpt2\" or \"tiny\""),
    };
    if cli.steps < 2 || cli.micro < 1 || cli.tokens < 1 {
        bail!("--steps must be >= 2, --micro and --tokens >= 1");
    }
    let gpt2_config = recommender::text::gpt2_config(preset);
    if cli.tokens > gpt2_config.n_positions {
        bail!(
            "--tokens {} exceeds the preset's {} positions",
            cli.tokens,
            gpt2_config.n_positions
        );
    }

    tch::manual_seed(0);
    use_bf16_autocast_on(Device::Cpu);
    let vs = nn::VarStore::new(Device::Cpu);
    let mut gpt2 = Gpt2::new(&vs.root(), &gpt2_config);
    gpt2.set_activation_checkpointing(cli.checkpointing);
    let micro = cli.micro as i64;
    let texts = |rows: i64| {
        let ids = Tensor::randint(50_000, [rows, cli.tokens], (Kind::Int64, Device::Cpu));
        let mask = Tensor::ones([rows, cli.tokens], (Kind::Int64, Device::Cpu));
        (ids, mask)
    };
    let (users, user_mask) = texts(micro);
    let (items, item_mask) = texts(2 * micro);
    let after_build = rss_bytes();

    let mut seconds = Vec::new();
    for _ in 0..cli.steps {
        let t0 = Instant::now();
        let loss = autocast_on(Device::Cpu, cli.bf16, || {
            let u = Gpt2::mean_pool(&gpt2.forward(&users, &user_mask, true), &user_mask);
            let i = Gpt2::mean_pool(&gpt2.forward(&items, &item_mask, true), &item_mask);
            let (p, n) = (i.narrow(0, 0, micro), i.narrow(0, micro, micro));
            let diff = (&u * p).sum_dim_intlist(-1, false, Kind::Float)
                - (&u * n).sum_dim_intlist(-1, false, Kind::Float);
            -(diff.sigmoid() + 1e-10).log().mean(Kind::Float)
        });
        loss.f_backward()?;
        autocast_on(Device::Cpu, cli.bf16, || gpt2.finish_backward())?;
        for mut v in vs.trainable_variables() {
            v.zero_grad();
        }
        seconds.push(t0.elapsed().as_secs_f64());
    }
    let peak = peak_rss_bytes();

    let mut config = Config::default();
    config.model.preset = preset;
    config.model.text_mode = TextMode::Dynamic;
    config.model.activation_checkpointing = cli.checkpointing;
    config.train.bf16 = cli.bf16;
    let plan = common::batch::BatchPlan::new(cli.micro, cli.micro, 1, 1);
    let shape = DataShape {
        users: 1,
        items: 1,
        interactions: 1,
        user_tokens: cli.tokens as u64,
        item_tokens: cli.tokens as u64,
        source: "gpt2-step-bench".into(),
    };
    let e = estimate(&config, &plan, &shape, DeviceKind::Cpu);
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let timed = &seconds[1..];
    println!(
        "{}",
        serde_json::json!({
            "preset": cli.preset,
            "checkpointing": cli.checkpointing,
            "bf16": cli.bf16,
            "micro": cli.micro,
            "tokens": cli.tokens,
            "rss_after_build_mib": mib(after_build),
            "peak_rss_mib": mib(peak),
            "steps_added_mib": mib(peak.saturating_sub(after_build)),
            "seconds_per_step": timed.iter().sum::<f64>() / timed.len() as f64,
            "estimate_gradients_mib": mib(Gpt2Dims::of(preset).params() * 4),
            "estimate_activations_mib": mib(e.term("activations (GPT-2)")),
            "estimate_bf16_copies_mib": mib(e.term("bf16 weight copies")),
        })
    );
    Ok(())
}
