//! The command line of `launch`. It owns the spelling of flags (ours and torchrun's aliases) and
//! their syntactic checks; it must not resolve anything (ports, GPUs, configs): that is the plan's.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

/// Start one worker per GPU (or CPU slot) with torchrun's environment, supervise them, and tear
/// the group down as one when any of them fails.
#[derive(Debug, Parser)]
#[command(
    name = "launch",
    version,
    about,
    args_override_self = true,
    after_help = "Examples:\n  launch --num-processes 2 configs/default.toml\n  launch --num-processes auto configs/train.toml\n  launch --dry-run --num-processes 8 configs/train.toml\n  launch --num-processes 2 -- python my_script.py"
)]
pub struct Cli {
    /// Workers on this node: a number, `auto` (= visible GPUs, 1 without GPUs), `gpu` (same) or
    /// `cpu` (= CPU cores).
    #[arg(
        long = "num-processes",
        visible_alias = "nproc-per-node",
        alias = "nproc_per_node",
        alias = "num_processes",
        value_name = "N|auto",
        default_value = "1",
        value_parser = parse_num_processes
    )]
    pub num_processes: NumProcesses,

    /// Number of nodes in the job.
    #[arg(long, default_value_t = 1, value_parser = parse_positive)]
    pub nnodes: u32,

    /// This node's rank among the nodes (0-based).
    #[arg(long = "node-rank", alias = "node_rank", default_value_t = 0)]
    pub node_rank: u32,

    /// Address of the node that hosts rank 0 (the rendezvous store).
    #[arg(
        long = "master-addr",
        alias = "master_addr",
        default_value = "127.0.0.1"
    )]
    pub master_addr: String,

    /// Port of the rendezvous store on the master node; 0 picks a free one. On a single-node run
    /// a port that is taken is replaced by a free one, with a notice.
    #[arg(long = "master-port", alias = "master_port", default_value_t = 29500)]
    pub master_port: u16,

    /// Single-node run on a free port (torchrun's `--standalone`).
    #[arg(long)]
    pub standalone: bool,

    /// Restart the whole worker group up to N times after a failure.
    #[arg(long = "max-restarts", alias = "max_restarts", default_value_t = 0)]
    pub max_restarts: u32,

    /// Seconds between SIGTERM and SIGKILL when tearing workers down.
    #[arg(long = "grace-period", value_name = "SECS", default_value = "10", value_parser = parse_seconds)]
    pub grace_period: Duration,

    /// Also write each rank's output to DIR/rank-N.log.
    #[arg(long = "log-dir", alias = "log_dir", value_name = "DIR")]
    pub log_dir: Option<PathBuf>,

    /// Validate the config and print the plan (world, batch derivation, each rank's environment);
    /// start nothing.
    #[arg(long = "dry-run")]
    pub dry_run: bool,

    /// Override a config value, e.g. `--set batch.micro=8` (repeatable; passed on to workers).
    #[arg(long = "set", value_name = "KEY.PATH=VALUE")]
    pub overrides: Vec<String>,

    /// Job id shared by every worker (TORCHELASTIC_RUN_ID); the rendezvous store checks it.
    /// Default: a fresh id on a single node; derived from the master address on several nodes.
    #[arg(
        long = "run-id",
        alias = "rdzv-id",
        alias = "rdzv_id",
        alias = "run_id"
    )]
    pub run_id: Option<String>,

    /// The worker binary to run with CONFIG (default: `worker` next to `launch`).
    #[arg(long, value_name = "PATH")]
    pub worker: Option<PathBuf>,

    /// Training config (TOML) given to each worker.
    #[arg(value_name = "CONFIG")]
    pub config: Option<PathBuf>,

    /// Run this program instead of the worker (everything after `--`).
    #[arg(last = true, value_name = "PROGRAM ARGS")]
    pub program: Vec<OsString>,
}

/// `--num-processes` as written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NumProcesses {
    /// One per visible GPU (1 when there is none).
    Auto,
    /// One per CPU core.
    Cpu,
    Count(u32),
}

/// More workers than this on one node is a typo, not a plan.
pub const MAX_PROCESSES: u32 = 1024;

fn parse_num_processes(text: &str) -> Result<NumProcesses, String> {
    match text.trim() {
        "auto" | "gpu" => Ok(NumProcesses::Auto),
        "cpu" => Ok(NumProcesses::Cpu),
        other => match other.parse::<u32>() {
            Ok(0) => Err("must be at least 1".to_string()),
            Ok(n) if n > MAX_PROCESSES => Err(format!(
                "{n} processes on one node is more than the {MAX_PROCESSES} `launch` supports"
            )),
            Ok(n) => Ok(NumProcesses::Count(n)),
            Err(_) => Err(format!(
                "expected a positive number, `auto`, `gpu` or `cpu`, got {other:?}"
            )),
        },
    }
}

fn parse_positive(text: &str) -> Result<u32, String> {
    if text.contains(':') {
        return Err(format!(
            "elastic node ranges such as {text:?} are not supported; give a fixed node count"
        ));
    }
    match text.trim().parse::<u32>() {
        Ok(0) => Err("must be at least 1".to_string()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("expected a positive number, got {text:?}")),
    }
}

fn parse_seconds(text: &str) -> Result<Duration, String> {
    let secs: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("expected seconds (e.g. 10 or 2.5), got {text:?}"))?;
    if !secs.is_finite() || !(0.0..=86_400.0).contains(&secs) {
        return Err(format!("must be between 0 and 86400 seconds, got {text:?}"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("launch").chain(args.iter().copied()))
    }

    #[test]
    fn torchrun_spellings_are_accepted() {
        let cli = parse(&[
            "--nproc_per_node",
            "3",
            "--node_rank",
            "0",
            "--master_addr",
            "10.1.1.1",
            "--master_port",
            "1234",
            "--max_restarts",
            "2",
            "--rdzv_id",
            "abc",
            "--",
            "python",
            "x.py",
        ])
        .unwrap();
        assert_eq!(cli.num_processes, NumProcesses::Count(3));
        assert_eq!(cli.master_addr, "10.1.1.1");
        assert_eq!(cli.master_port, 1234);
        assert_eq!(cli.max_restarts, 2);
        assert_eq!(cli.run_id.as_deref(), Some("abc"));
        assert_eq!(cli.program, vec![OsString::from("python"), "x.py".into()]);
        let cli = parse(&["--nproc-per-node", "auto", "c.toml"]).unwrap();
        assert_eq!(cli.num_processes, NumProcesses::Auto);
    }

    #[test]
    fn bad_values_are_rejected() {
        for args in [
            &["--num-processes", "0", "c.toml"][..],
            &["--num-processes", "two", "c.toml"],
            &["--num-processes", "5000", "c.toml"],
            &["--nnodes", "1:4", "c.toml"],
            &["--grace-period", "-1", "c.toml"],
            &["--master-port", "70000", "c.toml"],
            &["--bogus", "c.toml"],
        ] {
            assert!(parse(args).is_err(), "{args:?} should fail");
        }
    }

    #[test]
    fn grace_period_takes_fractions() {
        let cli = parse(&["--grace-period", "0.5", "c.toml"]).unwrap();
        assert_eq!(cli.grace_period, Duration::from_millis(500));
    }
}
