//! `fetch`: downloads the named data sets (MovieLens) and GPT-2 models into the cache, checked
//! (size, SHA-256) and placed atomically, so a training run can name them (`data.dir = "ml-1m"`).
//!
//! Owns: the command line, `--list`, the choice of manifest, and the edge where errors become
//! one line on stderr and an exit code (2: bad usage or unknown name; 1: a download or check
//! failed).
//!
//! Must not: download, check or place anything itself (`install` and the modules it uses do).

mod download;
mod error;
mod http;
mod input;
mod install;
mod manifest;
mod marker;
mod model;
mod place;
mod progress;
mod unpack;

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use common::assets;

use crate::error::UsageError;
use crate::install::{Ctx, Outcome};
use crate::manifest::{Entry, Manifest};
use crate::marker::{Depth, State};

/// Exit code for bad usage: unknown names, a bad manifest, wrong arguments (as clap's).
const EXIT_USAGE: i32 = 2;
/// Exit code for a failed download, check or placement.
const EXIT_FAILED: i32 = 1;

#[derive(Debug, Parser)]
#[command(
    name = "fetch",
    version,
    about = "Download MovieLens data sets and GPT-2 models into the gptrec cache, checked and placed atomically.",
    after_help = "Examples:\n  fetch ml-1m gpt2            download into the cache\n  fetch --list                what can be fetched, and what is there\n  fetch --verify ml-1m        re-hash what is there; fetch again what differs\n  fetch --from ml-1m.zip ml-1m  install a zip downloaded by hand (no network)\n\n\
The cache is --cache, else $GPTREC_CACHE, else $XDG_CACHE_HOME/gptrec, else ~/.cache/gptrec.\n\
Mirrors: GPTREC_GROUPLENS_URL replaces https://files.grouplens.org/datasets/movielens;\n\
HF_ENDPOINT replaces https://huggingface.co. HTTPS_PROXY / HTTP_PROXY / NO_PROXY are honoured.\n\
An interrupted download resumes when fetch is run again.\n\
What is in the cache counts while its files have the sizes its .complete marker records\n\
(with --verify, the SHA-256s); a file that differs is named and the NAME fetched again."
)]
struct Cli {
    /// Names to fetch: ml-1m, ml-100k, gpt2, distilgpt2, gpt2-medium, gpt2-large, gpt2-xl.
    #[arg(value_name = "NAME", required_unless_present = "list")]
    names: Vec<String>,

    /// List the names, what they are, and whether (and where) the cache has them.
    #[arg(long, conflicts_with = "from")]
    list: bool,

    /// Re-hash every file of each placement (each NAME, or each listed with --list) against
    /// the SHA-256 its .complete marker records, instead of checking only that each file is
    /// there with its recorded size; a file that differs is named, and the NAME placed again.
    #[arg(long)]
    verify: bool,

    /// Install from a file downloaded by hand (a data set's zip; for a model, a directory
    /// with config.json and model.safetensors): the same checks, no network. One NAME.
    #[arg(long, value_name = "FILE")]
    from: Option<PathBuf>,

    /// The cache root (default: $GPTREC_CACHE, else $XDG_CACHE_HOME/gptrec, else
    /// ~/.cache/gptrec).
    #[arg(long, value_name = "DIR")]
    cache: Option<PathBuf>,

    /// No progress bar and no summary lines.
    #[arg(long, short)]
    quiet: bool,

    /// A manifest (TOML or JSON: entries with name, url or urls, size, sha256; models with
    /// repo and revision) that replaces the built-in one, for mirrors and tests.
    #[arg(long, value_name = "FILE")]
    manifest: Option<PathBuf>,

    /// Seconds without data before a transfer counts as stalled.
    #[arg(
        long,
        hide = true,
        env = "GPTREC_FETCH_STALL_SECS",
        default_value_t = 30
    )]
    stall_secs: u64,

    /// Seconds to wait for a connection.
    #[arg(
        long,
        hide = true,
        env = "GPTREC_FETCH_CONNECT_SECS",
        default_value_t = 30
    )]
    connect_secs: u64,

    /// How often a cut or stalled transfer is resumed within one run.
    #[arg(long, hide = true, env = "GPTREC_FETCH_RETRIES", default_value_t = 3)]
    retries: u32,
}

fn main() {
    let cli = Cli::parse();
    if let Err(err) = run(&cli) {
        eprintln!("fetch: {err:#}");
        let code = if err.downcast_ref::<UsageError>().is_some() {
            EXIT_USAGE
        } else {
            EXIT_FAILED
        };
        std::process::exit(code);
    }
}

fn run(cli: &Cli) -> anyhow::Result<()> {
    let manifest = load_manifest(cli.manifest.as_deref())?;
    let root = cli.cache.clone().unwrap_or_else(assets::cache_root);
    let depth = match cli.verify {
        true => Depth::Digests,
        false => Depth::Sizes,
    };
    if cli.list {
        print_list(&root, &manifest, depth);
        return Ok(());
    }
    let entries = pick(&cli.names, &manifest)?;
    let ctx = Ctx {
        root,
        client: http::Client::new(http::Timeouts {
            connect: Duration::from_secs(cli.connect_secs.max(1)),
            stall: Duration::from_secs(cli.stall_secs.max(1)),
        }),
        opts: download::Options {
            quiet: cli.quiet,
            retries: cli.retries,
        },
        depth,
    };
    match &cli.from {
        Some(from) => from_file(&ctx, &entries, from),
        None => entries.iter().try_for_each(|entry| {
            let outcome = install::fetch(&ctx, entry)?;
            report(entry, &outcome);
            Ok(())
        }),
    }
}

fn from_file(ctx: &Ctx, entries: &[&Entry], from: &Path) -> anyhow::Result<()> {
    let [entry] = entries else {
        return Err(UsageError("--from takes exactly one NAME".into()).into());
    };
    if !from.exists() {
        return Err(UsageError(format!("--from {}: no such file", from.display())).into());
    }
    let outcome = install::install_from(ctx, entry, from)?;
    report(entry, &outcome);
    Ok(())
}

fn report(entry: &Entry, outcome: &Outcome) {
    match outcome {
        Outcome::Already(dir) => {
            eprintln!("fetch: {} already in {}", entry.asset.name, dir.display())
        }
        Outcome::Placed(dir) => eprintln!("fetch: {} ready in {}", entry.asset.name, dir.display()),
    }
}

fn load_manifest(path: Option<&Path>) -> anyhow::Result<Manifest> {
    match path {
        Some(path) => Ok(Manifest::from_file(path)?),
        None => Ok(Manifest::builtin(&manifest::grouplens_base())),
    }
}

/// The entries for `names` (each once, in order); an unknown name is a usage error.
fn pick<'m>(names: &[String], manifest: &'m Manifest) -> anyhow::Result<Vec<&'m Entry>> {
    let mut picked: Vec<&Entry> = Vec::new();
    for name in names {
        let entry = match (assets::find(name), manifest.get(name)) {
            (None, _) => {
                let known = manifest::known_names();
                return Err(
                    UsageError(format!("unknown name {name:?}; known names: {known}")).into(),
                );
            }
            (Some(_), None) => {
                let why = format!("{name} is not in {}", manifest.origin);
                return Err(UsageError(why).into());
            }
            (Some(_), Some(entry)) => entry,
        };
        if !picked.iter().any(|e| e.asset.name == entry.asset.name) {
            picked.push(entry);
        }
    }
    Ok(picked)
}

/// `--list`: each name, whether the cache has it and where, and what it is. A placement whose
/// files differ from its marker is listed `modified`, the file named on stderr.
fn print_list(root: &Path, manifest: &Manifest, depth: Depth) {
    println!("cache: {}", root.display());
    for asset in assets::ASSETS.iter() {
        let dir = install::final_dir(root, asset);
        let state = match marker::state(&dir, depth) {
            State::Complete(_) => "present",
            State::Differs(_, detail) => {
                eprintln!("fetch: {detail}");
                "modified"
            }
            State::Unmarked if install::placed_by_hand(&dir, asset.name) => "by hand",
            State::Unmarked if dir.exists() => "incomplete",
            State::Unmarked => "missing",
        };
        let note = match manifest.get(asset.name) {
            Some(_) => String::new(),
            None => format!(" (not in {})", manifest.origin),
        };
        println!("{:<12} {:<10} {}{note}", asset.name, state, dir.display());
        println!("{:<12} {}", "", asset.about);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn unknown_names_are_usage_errors_listing_the_known_ones() {
        let m = Manifest::builtin(manifest::GROUPLENS_BASE);
        let err = pick(&["ml-2m".into()], &m).unwrap_err();
        assert!(err.downcast_ref::<UsageError>().is_some());
        assert!(
            err.to_string()
                .contains("known names: ml-1m, ml-100k, gpt2"),
            "{err}"
        );
        let twice = pick(&["gpt2".into(), "gpt2".into()], &m).unwrap();
        assert_eq!(twice.len(), 1);
    }
}
