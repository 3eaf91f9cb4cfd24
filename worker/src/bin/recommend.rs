//! `recommend RUN_DIR --user 42 --new-user F,25,12 --top 10 --export DIR`: the best model of a
//! finished run (`RUN_DIR/best/`), rebuilt from `RUN_DIR/config.resolved.toml` on the same data
//! and split, turned into recommendations: the top-K items with titles for ML-1M users (what
//! they interacted with left out) and for new users known only by gender, age and occupation
//! (through the text tower); and, with `--export`, the final user and item vectors for serving
//! from any language. One process on the CPU.
//!
//! It may run from anywhere: the config's relative paths (the data's included) are taken from
//! the directory the run was started in, found from where RUN_DIR is (`<run.output_dir>/
//! <run.name>`), and the run's synthetic data from `RUN_DIR/../data`. Data that is not there is
//! refused, never generated; a best model trained on other data (another seed, split or data
//! files) is refused by its fingerprint.
//!
//! Exit codes: 0; 2 for bad arguments or a run it cannot use, each a one-line error.

use std::path::{Component, Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::Parser;
use common::config::Config;
use recommender::data::user_text;
use recommender::serve::{export_vectors, parse_new_user_of, top_items};
use recommender::{RecData, RecTask};
use runtime::collective::OpContext;
use tch::{nn, Device, Tensor};

#[derive(Debug, Parser)]
#[command(
    name = "recommend",
    about = "Top-K recommendations and exported vectors from a trained run's best model"
)]
struct Cli {
    /// The run's directory (`<run.output_dir>/<run.name>`), with `best/` and
    /// `config.resolved.toml`.
    #[arg(value_name = "RUN_DIR")]
    run_dir: PathBuf,
    /// An ML-1M user id (`users.dat`) to recommend for; repeat for more.
    #[arg(long = "user", value_name = "ID")]
    users: Vec<u32>,
    /// A new user described by `GENDER,AGE,OCCUPATION`: in ML-1M's codes (`F,25,12`: female,
    /// 25-34, programmer), or for a run on ML-100k in years and its occupation names
    /// (`F,31,librarian`); repeat for more.
    #[arg(long = "new-user", value_name = "G,AGE,OCC")]
    new_users: Vec<String>,
    /// Items per user.
    #[arg(long, default_value_t = 10, value_name = "K")]
    top: usize,
    /// Write `vectors.safetensors` and `ids.json` into this directory (both or neither).
    #[arg(long, value_name = "DIR")]
    export: Option<PathBuf>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tch::set_num_threads(1);
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("recommend: error: {}", worker::error_line::one_line(&e));
            ExitCode::from(2)
        }
    }
}

const CTX: OpContext = OpContext {
    step: 0,
    timeout: Duration::from_secs(600),
};

fn run(cli: &Cli) -> anyhow::Result<()> {
    if cli.users.is_empty() && cli.new_users.is_empty() && cli.export.is_none() {
        bail!("nothing to do: give --user ID, --new-user G,AGE,OCC or --export DIR");
    }
    if cli.top == 0 {
        bail!("--top must be at least 1");
    }
    let config_path = cli.run_dir.join("config.resolved.toml");
    let mut config = Config::load(&config_path, &[])
        .with_context(|| format!("{}: not a finished run's config", config_path.display()))?;
    // Before the working directory moves to where the run was started.
    let export = cli.export.as_deref().map(std::path::absolute).transpose()?;
    let run_dir = std::fs::canonicalize(&cli.run_dir)
        .with_context(|| format!("{}", cli.run_dir.display()))?;
    locate_run_files(&mut config, &run_dir)?;
    let (_server, mut comm) = worker::single_process::single_process("recommend")?;
    let data = recommender::load_data(&config, comm.as_mut(), CTX).context("loading the data")?;
    let new_users = (cli.new_users.iter())
        .map(|spec| parse_new_user_of(spec, data.format.ages_in_years(), &data.user_texts))
        .collect::<Result<Vec<_>, String>>()
        .map_err(anyhow::Error::msg)?;
    let vs = nn::VarStore::new(Device::Cpu);
    let task = RecTask::new(&config, &data, &vs, Device::Cpu, comm.as_mut(), CTX, &())
        .context("building the model")?;
    let params: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    let best = run_dir.join("best");
    worker::trainer::load_best(&params, &best, Some(&task.model_hash()))
        .with_context(|| format!("loading the best model of {}", cli.run_dir.display()))?;
    let ds = &data.dataset;
    let rows = (cli.users.iter())
        .map(|&id| match ds.user_ids.iter().position(|&u| u == id) {
            Some(row) => Ok((id, row)),
            None => Err(anyhow::anyhow!(
                "--user {id}: no such user (with a positive rating) in {}",
                data.source.display()
            )),
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let (user_table, item_table) = task.tables();
    for (id, row) in rows {
        let seen = data.rated[row].clone();
        let user = user_table.narrow(0, row as i64, 1);
        let cold = if row as u32 >= ds.n_warm_users {
            ", cold start"
        } else {
            ""
        };
        let title = format!(
            "user {id} ({}; {} movies rated{cold})",
            describe(&data.user_texts[row]),
            seen.len()
        );
        print_top(&task, &data, &title, &user, &item_table, seen, cli.top)?;
    }
    if !new_users.is_empty() {
        let texts: Vec<String> = new_users.iter().map(user_text).collect();
        let reprs = task
            .new_users(&config, &data, &texts, comm.as_mut(), CTX)
            .context("placing the new users")?;
        for (i, text) in texts.iter().enumerate() {
            let title = format!("new user ({})", describe(text));
            let user = reprs.narrow(0, i as i64, 1);
            print_top(
                &task,
                &data,
                &title,
                &user,
                &item_table,
                Vec::new(),
                cli.top,
            )?;
        }
    }
    if let Some(dir) = &export {
        export_vectors(dir, &task, &data.dataset, &data.item_titles)
            .with_context(|| format!("exporting to {}", dir.display()))?;
        println!(
            "exported {} user and {} item vectors of dimension {} to {}/vectors.safetensors (ids in ids.json)",
            data.dataset.n_users,
            data.dataset.n_items,
            config.model.embedding_dim
                + if config.model.item_item { data.dataset.n_items as usize } else { 0 },
            dir.display()
        );
    }
    Ok(())
}

/// Points `config` at the files of the run in `run_dir` (canonical), wherever this command runs:
/// the working directory becomes the one the run was started in (when RUN_DIR tells it: its
/// parent ends in the recorded relative `run.output_dir`), so the config's relative paths mean
/// what they meant to the run (the model's fingerprint covers them as written);
/// `run.output_dir` becomes RUN_DIR's parent. The data must be there: a missing `data.dir` is
/// refused, and synthetic data is read from where the run generated it, never generated here.
fn locate_run_files(config: &mut Config, run_dir: &Path) -> anyhow::Result<()> {
    let output_dir = run_dir
        .parent()
        .ok_or_else(|| anyhow::anyhow!("{}: not a run directory", run_dir.display()))?;
    if let Some(base) = started_in(output_dir, &config.run.output_dir) {
        std::env::set_current_dir(&base).with_context(|| format!("{}", base.display()))?;
    }
    let base = std::env::current_dir()?;
    config.run.output_dir = output_dir.to_path_buf();
    match &config.data.dir {
        Some(dir) if !base.join(dir).is_dir() => bail!(
            "data.dir = {:?} in the run's config.resolved.toml: {} is not a directory (relative paths are taken from {}, where the run was started)",
            dir.display().to_string(),
            base.join(dir).display(),
            base.display()
        ),
        Some(_) => {}
        None => {
            let synthetic = recommender::input::synthetic_dir(config);
            if !synthetic.join("ratings.dat").is_file() {
                bail!(
                    "{}: the run's synthetic data is not there (training generates it under the run's output directory; recommend reads it and generates nothing)",
                    synthetic.display()
                );
            }
            config.data.dir = Some(synthetic);
        }
    }
    Ok(())
}

/// The directory a run was started in: `output_dir` (where its directory is, canonical) less
/// the recorded relative `run.output_dir`; `None` when that cannot be told (an absolute or
/// `..` output_dir, or a run directory moved elsewhere).
fn started_in(output_dir: &Path, recorded: &Path) -> Option<PathBuf> {
    let mut tail = PathBuf::new();
    for part in recorded.components() {
        match part {
            Component::CurDir => {}
            Component::Normal(name) => tail.push(name),
            _ => return None,
        }
    }
    if !output_dir.ends_with(&tail) {
        return None;
    }
    output_dir
        .ancestors()
        .nth(tail.components().count())
        .map(Path::to_path_buf)
}

/// `User: female, aged 25-34, works as programmer.` -> `female, aged 25-34, works as programmer`.
fn describe(text: &str) -> &str {
    text.trim_start_matches("User: ").trim_end_matches('.')
}

fn print_top(
    task: &RecTask,
    data: &RecData,
    title: &str,
    user: &Tensor,
    items: &Tensor,
    seen: Vec<u32>,
    k: usize,
) -> anyhow::Result<()> {
    let top = top_items(task, user, items, &[seen], k)?;
    println!("{title}:");
    for (rank, (item, score)) in top.into_iter().flatten().enumerate() {
        let i = item as usize;
        let cold = if item >= data.dataset.n_warm_items {
            "  (cold start)"
        } else {
            ""
        };
        println!(
            "  {:>2}. {score:>8.4}  [movie {}] {}{cold}",
            rank + 1,
            data.dataset.item_ids[i],
            data.item_titles[i]
        );
    }
    Ok(())
}
