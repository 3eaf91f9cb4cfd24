//! `export-split CONFIG [--set k=v ...] --out DIR [--name NAME]`: the exact train/valid/test
//! split a training run with this config uses, written as RecBole's atomic benchmark files
//! `DIR/NAME.train.inter`, `NAME.valid.inter` and `NAME.test.inter` (header
//! `user_id:token<TAB>item_id:token`, one interaction a line, original MovieLens ids as tokens),
//! so that RecBole (`benchmark_filename: [train, valid, test]`) trains and tests on the very
//! interactions our trainer does (scripts/bench/vs_recbole.sh).
//!
//! The data is loaded as training loads it (`recommender::load_data`: same files, seed,
//! `min_rating` and split), on one process. Our full ranking scores every item that has at
//! least one positive interaction; without cold start each of those is in some user's train,
//! valid or test list, so the union of the three files has exactly that item set, which is the
//! set RecBole builds from them (checked here; a gap is an error). Cold-start configs are
//! refused: cold interactions have no place in these three files, and RecBole has no cold
//! start to compare with.
//!
//! Owns: turning a loaded split into those files, each written to a unique temporary file and
//! renamed. Must not: change the split, train, or write anywhere but `DIR`.
//!
//! Exit codes: 0; 2 for bad arguments, a cold-start config or data it cannot load (one line).

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::Parser;
use common::config::Config;
use recommender::data::Dataset;
use runtime::collective::OpContext;

#[derive(Debug, Parser)]
#[command(
    name = "export-split",
    about = "Write a config's train/valid/test split as RecBole atomic benchmark files"
)]
struct Cli {
    /// Training config (TOML), as given to `launch`.
    #[arg(value_name = "CONFIG")]
    config: PathBuf,
    /// Override a config value, e.g. `--set data.dir=ml-100k` (repeatable), as for `launch`.
    #[arg(long = "set", value_name = "KEY.PATH=VALUE")]
    overrides: Vec<String>,
    /// Directory to write the files into (created if missing).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// RecBole's dataset name, the files' stem; default: DIR's last component.
    #[arg(long, value_name = "NAME")]
    name: Option<String>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("export-split: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

const CTX: OpContext = OpContext {
    step: 0,
    timeout: Duration::from_secs(600),
};

/// The three parts, in RecBole's `benchmark_filename` order.
const PARTS: [&str; 3] = ["train", "valid", "test"];

fn run(cli: &Cli) -> anyhow::Result<()> {
    let name = dataset_name(cli)?;
    // The error's text already names its cause; `{:#}` would repeat the source.
    let config = Config::load(&cli.config, &cli.overrides).map_err(|e| anyhow::anyhow!("{e}"))?;
    refuse_cold_start(&config)?;
    let (_server, mut comm) = worker::single_process::single_process("export-split")?;
    let data = recommender::load_data(&config, comm.as_mut(), CTX).context("loading the data")?;
    let ds = &data.dataset;
    check_item_universe(ds)?;
    std::fs::create_dir_all(&cli.out).with_context(|| format!("creating {}", cli.out.display()))?;
    let lists = [&ds.train, &ds.valid, &ds.test];
    let mut counts = [0usize; 3];
    for ((part, list), count) in PARTS.iter().zip(lists).zip(&mut counts) {
        let path = cli.out.join(format!("{name}.{part}.inter"));
        let (text, n) = inter_file(ds, list);
        write_atomic(&path, text.as_bytes())?;
        *count = n;
    }
    println!(
        "{}: {} users, {} items; wrote {} train, {} valid, {} test interactions to {}/{name}.{{train,valid,test}}.inter",
        data.source.display(),
        ds.n_users,
        ds.n_items,
        counts[0],
        counts[1],
        counts[2],
        cli.out.display()
    );
    Ok(())
}

/// `--name`, or DIR's last component; a plain file name either way.
fn dataset_name(cli: &Cli) -> anyhow::Result<String> {
    let name = match &cli.name {
        Some(name) => name.clone(),
        None => (cli.out.file_name())
            .and_then(|n| n.to_str())
            .map(str::to_string)
            .with_context(|| {
                format!(
                    "--out {}: no last component to name the data set by; give --name NAME",
                    cli.out.display()
                )
            })?,
    };
    let plain = !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains(['/', '\\', '\0'])
        && !name.starts_with('-');
    if !plain {
        bail!("--name {name:?}: must be a plain file name (no path separator, not empty)");
    }
    Ok(name)
}

/// Cold-start items and users are in none of the three files, and RecBole has nothing to
/// compare them with: such a config is refused rather than exported partially.
fn refuse_cold_start(config: &Config) -> anyhow::Result<()> {
    let (items, users) = (config.data.cold_items, config.data.cold_users);
    if items > 0.0 || users > 0.0 {
        bail!(
            "data.cold_items = {items}, data.cold_users = {users}: cold-start interactions have no place in RecBole's train/valid/test files; add --set data.cold_items=0 --set data.cold_users=0"
        );
    }
    Ok(())
}

/// Every item our evaluation ranks must appear in some file, so that RecBole's item set (the
/// items of the three files) is ours. Without cold start it holds by construction.
fn check_item_universe(ds: &Dataset) -> anyhow::Result<()> {
    let mut seen = vec![false; ds.n_items as usize];
    for list in [&ds.train, &ds.valid, &ds.test] {
        for &item in list.iter().flatten() {
            seen[item as usize] = true;
        }
    }
    let missing = seen.iter().filter(|&&s| !s).count();
    if missing > 0 {
        bail!(
            "{missing} of {} items are in no train/valid/test list, so RecBole's item set would differ from the one our evaluation ranks",
            ds.n_items
        );
    }
    Ok(())
}

/// One atomic file's text: the header, then `user<TAB>item` per interaction in original ids
/// (users and each user's items in increasing id order). Returns it and its line count.
fn inter_file(ds: &Dataset, lists: &[Vec<u32>]) -> (String, usize) {
    let mut text = String::from("user_id:token\titem_id:token\n");
    let mut n = 0;
    for (user, items) in lists.iter().enumerate() {
        let uid = ds.user_ids[user];
        for &item in items {
            // Writing into a String cannot fail.
            let _ = writeln!(text, "{uid}\t{}", ds.item_ids[item as usize]);
            n += 1;
        }
    }
    (text, n)
}

/// Writes `bytes` to a temporary file unique to this process next to `path`, syncs it and
/// renames it over `path`; the temporary file is removed if any step fails.
fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let file_name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let tmp = dir.join(format!(
        ".{}.tmp-{}-{nanos}",
        file_name.unwrap_or_default(),
        std::process::id()
    ));
    let result = (|| -> std::io::Result<()> {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("writing {}", path.display()));
    }
    Ok(())
}
