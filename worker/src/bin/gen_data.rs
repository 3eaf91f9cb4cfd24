//! `gen-data`: writes a synthetic data set in MovieLens-1M's format (`users.dat`, `movies.dat` in
//! latin-1, `ratings.dat`, `::`-separated, the same codes), deterministic for a seed, then reads
//! it back with the real ML-1M reader and prints what it holds.
//!
//! Usage: gen-data [--size tiny|small|full] [--seed N] [--min-rating R] DIR

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Parser, ValueEnum};
use common::config::SyntheticSize;

/// Write a synthetic data set in MovieLens-1M's format (users.dat, movies.dat, ratings.dat) and
/// print what it holds.
#[derive(Debug, Parser)]
#[command(name = "gen-data", version)]
struct Cli {
    /// Size: tiny (~200 users), small (~1000), full (6040 users, ~1M ratings).
    #[arg(long, value_enum, default_value = "tiny")]
    size: Size,
    /// Seed: the same seed writes the same bytes.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Lowest rating kept as a positive when summarising the result.
    #[arg(long = "min-rating", default_value_t = 3, value_parser = clap::value_parser!(u8).range(1..=5))]
    min_rating: u8,
    /// Directory to write into (created if missing).
    dir: PathBuf,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Size {
    Tiny,
    Small,
    Full,
}

fn main() -> ExitCode {
    worker::run_report::exit_code("gen-data", run())
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    let size = match cli.size {
        Size::Tiny => SyntheticSize::Tiny,
        Size::Small => SyntheticSize::Small,
        Size::Full => SyntheticSize::Full,
    };
    std::fs::create_dir_all(&cli.dir).with_context(|| format!("creating {}", cli.dir.display()))?;
    let start = Instant::now();
    recommender::data::generate_ml1m(&cli.dir, size, cli.seed).context("generating the data")?;
    let generated = start.elapsed();
    let start = Instant::now();
    let raw = recommender::data::read_ml1m(&cli.dir).context("reading the data back")?;
    let read = start.elapsed();
    let dataset = recommender::data::build_dataset(
        &raw,
        cli.min_rating,
        cli.seed,
        recommender::data::ColdShares::default(),
    );
    let count = |parts: &[Vec<u32>]| parts.iter().map(Vec::len).sum::<usize>();
    println!(
        "{}: {} users, {} movies, {} ratings (written in {:.2} s, read in {:.3} s)",
        cli.dir.display(),
        raw.users.len(),
        raw.movies.len(),
        raw.ratings.len(),
        generated.as_secs_f64(),
        read.as_secs_f64()
    );
    println!(
        "implicit (rating >= {}): {} users x {} items, train {} / valid {} / test {}",
        cli.min_rating,
        dataset.n_users,
        dataset.n_items,
        count(&dataset.train),
        count(&dataset.valid),
        count(&dataset.test)
    );
    Ok(())
}
