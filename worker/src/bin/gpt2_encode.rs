//! `gpt2-encode MODEL_DIR --ids 1,2,3` (or `--text "..."`, tokenised with our GPT-2 tokenizer):
//! the last hidden state of our GPT-2 for a Hugging Face model directory (`config.json` +
//! `model.safetensors`), printed as JSON (`{"ids": [...], "last_hidden_state": [[...], ...]}`,
//! one row per token), so that anyone can compare it with what `transformers` gives for their
//! own model. Exit code 2 for a bad directory or arguments, one line each: `config.json` is
//! checked field by field and the weights' header against it before the model is built (a
//! hostile size allocates nothing), and neither file may be a FIFO, a device or a directory.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context as _};
use clap::Parser;
use recommender::model::gpt2::{load_hf_safetensors, Gpt2, HfDir, Tokenizer};
use tch::{nn, Device, Kind, Tensor};

#[derive(Debug, Parser)]
#[command(
    name = "gpt2-encode",
    about = "Last hidden state of a Hugging Face GPT-2 directory, as JSON"
)]
struct Cli {
    /// A directory with `config.json` and `model.safetensors` (as `save_pretrained` writes).
    #[arg(value_name = "MODEL_DIR")]
    model_dir: PathBuf,
    /// Token ids, separated by commas.
    #[arg(
        long,
        value_name = "IDS",
        conflicts_with = "text",
        required_unless_present = "text"
    )]
    ids: Option<String>,
    /// A text, tokenised with GPT-2's tokenizer (r50k_base, built in).
    #[arg(long, value_name = "TEXT")]
    text: Option<String>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(json) => {
            println!("{json}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gpt2-encode: error: {}", worker::error_line::one_line(&e));
            ExitCode::from(2)
        }
    }
}

fn run(cli: &Cli) -> anyhow::Result<String> {
    let hf = HfDir::open(&cli.model_dir)?;
    let ids: Vec<i64> = match (&cli.ids, &cli.text) {
        (Some(ids), _) => ids
            .split(',')
            .map(|i| i.trim().parse::<i64>())
            .collect::<Result<_, _>>()
            .with_context(|| format!("--ids {ids:?}: expected numbers separated by commas"))?,
        (None, Some(text)) => Tokenizer::new()?.encode(text),
        (None, None) => bail!("give --ids or --text"),
    };
    let vocab = hf.config.vocab_size;
    if ids.is_empty() {
        bail!("no tokens to encode");
    }
    if let Some(bad) = ids.iter().find(|&&i| i < 0 || i >= vocab) {
        bail!("token id {bad} is outside the model's vocabulary (0..{vocab})");
    }
    if ids.len() as i64 > hf.config.n_positions {
        bail!(
            "{} tokens are more than the model's {} positions",
            ids.len(),
            hf.config.n_positions
        );
    }
    let vs = nn::VarStore::new(Device::Cpu);
    let model = Gpt2::new(&vs.root(), &hf.config);
    load_hf_safetensors(&vs, None, &hf.weights)
        .with_context(|| format!("{}", hf.weights.display()))?;
    let input = Tensor::from_slice(&ids).view([1, -1]);
    let mask = Tensor::ones_like(&input);
    let hidden = tch::no_grad(|| model.forward(&input, &mask, false))
        .squeeze_dim(0)
        .to_kind(Kind::Float);
    let rows: Vec<Vec<f32>> = Vec::<Vec<f32>>::try_from(&hidden)?;
    Ok(serde_json::json!({ "ids": ids, "last_hidden_state": rows }).to_string())
}
