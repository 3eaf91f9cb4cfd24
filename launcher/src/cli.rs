//! The command line of `launch`. It owns the spelling of flags (ours and torchrun's aliases) and
//! their syntactic checks; it must not resolve anything (ports, GPUs, configs): that is the plan's.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;

pub mod abbrev;
mod deepspeed_flags;
mod fsdp_flags;
pub use deepspeed_flags::DeepSpeedFlags;
pub use fsdp_flags::FsdpFlags;

/// Start one worker per GPU (or CPU slot) with torchrun's environment, supervise them, and tear
/// the group down as one when any of them fails.
#[derive(Debug, Parser)]
#[command(
    name = "launch",
    version,
    about,
    args_override_self = true,
    // torchrun's argparse takes unambiguous prefixes (`--nproc-per 2`): see `abbrev`.
    infer_long_args = true,
    // `--num-processes -1` is a bad value of that flag, not an unknown flag `-1`.
    allow_negative_numbers = true,
    after_help = "Examples:\n  launch --num-processes 2 configs/default.toml\n  launch --num-processes auto configs/train.toml\n  launch --dry-run --num-processes 8 configs/train.toml\n  launch --num-processes 2 -- python my_script.py"
)]
pub struct Cli {
    /// Workers on this node: a number up to 1024, `auto` (= visible GPUs, 1 without GPUs), `gpu`
    /// (same) or `cpu` (= CPU cores). Default: the GPUs Slurm gave the step,
    /// `PET_NPROC_PER_NODE`, or 1. A job has at most 1,048,576 workers in all.
    #[arg(
        long = "num-processes",
        visible_alias = "nproc-per-node",
        alias = "nproc_per_node",
        alias = "num_processes",
        value_name = "N|auto",
        value_parser = parse_num_processes
    )]
    pub num_processes: Option<NumProcesses>,

    /// One worker per listed GPU, e.g. `0,2,5` (as nvidia-smi numbers them; indices into
    /// CUDA_VISIBLE_DEVICES when that is set), or `all`.
    #[arg(long = "gpu-ids", alias = "gpu_ids", value_name = "IDS", value_parser = parse_gpu_ids)]
    pub gpu_ids: Option<GpuIds>,

    /// Number of nodes in the job: `N`, or `MIN:MAX` for an elastic job (nodes may leave and
    /// join; the group re-forms at each change, keeping the global batch); at most 65,536.
    /// Default: Slurm's step, `PET_NNODES`, or 1.
    #[arg(long, value_name = "N|MIN:MAX", value_parser = parse_node_range)]
    pub nnodes: Option<NodeRange>,

    /// Elastic jobs: `HOST[:PORT]` of the rendezvous store (port default 29400). The launcher
    /// on HOST that binds it first hosts the store and must outlive the job. Default:
    /// `PET_RDZV_ENDPOINT`, or the master address and port.
    #[arg(
        long = "rdzv-endpoint",
        alias = "rdzv_endpoint",
        value_name = "HOST[:PORT]"
    )]
    pub rdzv_endpoint: Option<String>,

    /// Elastic jobs: seconds a rendezvous waits for MIN nodes before giving up (torchrun's
    /// `join_timeout`). Default: `PET_RDZV_TIMEOUT`, or 900.
    #[arg(long = "rdzv-timeout", alias = "rdzv_timeout", value_name = "SECS", value_parser = parse_secs)]
    pub rdzv_timeout: Option<Duration>,

    /// Elastic jobs: `join_timeout=SECS,last_call_timeout=SECS` (last call: once MIN nodes are
    /// there, how long the first rendezvous waits for more; default 30).
    #[arg(long = "rdzv-conf", alias = "rdzv_conf", value_name = "KEY=VALUE,...", value_parser = parse_conf)]
    pub rdzv_conf: Option<RdzvConf>,

    /// torchrun's rendezvous backend: `c10d` (or `static`); ours is chosen by `--nnodes`.
    #[arg(long = "rdzv-backend", alias = "rdzv_backend", value_name = "NAME", value_parser = ["c10d", "static"])]
    pub rdzv_backend: Option<String>,

    /// Elastic jobs: the address other nodes reach this one at (default: 127.0.0.1 when the
    /// endpoint is a loopback address, else this host's name).
    #[arg(long = "local-addr", alias = "local_addr", value_name = "HOST")]
    pub local_addr: Option<String>,

    /// This node's rank among the nodes (0-based). Default: `SLURM_NODEID`, `PET_NODE_RANK`, or 0.
    #[arg(long = "node-rank", alias = "node_rank")]
    pub node_rank: Option<u32>,

    /// Address of the node that hosts rank 0 (the rendezvous store). Default: the first host of
    /// the Slurm step, `PET_MASTER_ADDR`, or 127.0.0.1.
    #[arg(long = "master-addr", alias = "master_addr")]
    pub master_addr: Option<String>,

    /// Port of the rendezvous store on the master node; 0 picks a free one. A port that is
    /// taken is refused, naming the process that holds it. Default: on a single node a free
    /// port (held by `launch` from before the workers start); on several, `PET_MASTER_PORT`, a
    /// port derived from the Slurm job id, or 29500.
    #[arg(long = "master-port", alias = "master_port")]
    pub master_port: Option<u16>,

    /// Single-node run on a free port (torchrun's `--standalone`).
    #[arg(long)]
    pub standalone: bool,

    /// Restart the whole worker group up to N times after a failure. Default: `PET_MAX_RESTARTS`
    /// or 0.
    #[arg(long = "max-restarts", alias = "max_restarts")]
    pub max_restarts: Option<u32>,

    /// Seconds between SIGTERM and SIGKILL when tearing workers down; on a SIGTERM to `launch`
    /// (preemption), the time our worker has to finish its step and write its checkpoint.
    #[arg(
        long = "grace-period",
        visible_alias = "term-timeout",
        value_name = "SECS",
        default_value = "10",
        value_parser = parse_seconds
    )]
    pub grace_period: Duration,

    /// torchrun's `--log-dir`: also write each worker's streams in torchrun's layout,
    /// `DIR/<run>_<random>/attempt_<restart>/<local rank>/{stdout,stderr}.log`, beside its
    /// `error.json` (`TORCHELASTIC_ERROR_FILE`). `<run>` is the run id's fingerprint (`none`
    /// as itself). Default: error files only, in a temporary directory removed at the end.
    #[arg(long = "log-dir", alias = "log_dir", value_name = "DIR")]
    pub log_dir: Option<PathBuf>,

    /// Also append each rank's lines, both streams in the order written, to
    /// `DIR/rank-N.log` (N the global rank), across restarts and requeues: one file per rank
    /// for a job's whole history (our Slurm and GPU-box scripts use it).
    #[arg(long = "rank-logs", value_name = "DIR")]
    pub rank_logs: Option<PathBuf>,

    /// Show only these local ranks' output on the console, e.g. `0` or `0,3` (torchrun's
    /// spelling); every rank still goes to --log-dir and --rank-logs. A hidden rank that fails is shown again,
    /// with the last lines it wrote.
    #[arg(
        long = "local-ranks-filter",
        alias = "local_ranks_filter",
        value_name = "RANKS",
        value_parser = crate::console::parse_ranks
    )]
    pub local_ranks_filter: Option<crate::console::LocalRanks>,

    /// torchrun's `--tee`: these streams go to the console and to --log-dir (0 none, 1 stdout,
    /// 2 stderr, 3 both; or per local rank, `0:3,1:2`). With --log-dir every stream does
    /// already; without it, as torchrun, a temporary directory is made, kept and named.
    #[arg(long, short = 't', value_name = "STREAMS", value_parser = crate::console::parse_streams)]
    pub tee: Option<crate::console::Streams>,

    /// torchrun's `--redirects`: these streams go to --log-dir only, not to the console (same
    /// values as --tee); without --log-dir, as torchrun, to a temporary directory, kept and
    /// named at the start.
    #[arg(long, short = 'r', value_name = "STREAMS", value_parser = crate::console::parse_streams)]
    pub redirects: Option<crate::console::Streams>,

    /// Validate the config and print the plan (world, batch derivation, each rank's environment);
    /// start nothing.
    #[arg(long = "dry-run")]
    pub dry_run: bool,

    /// Override a config value, e.g. `--set batch.micro=8` (repeatable; passed on to workers).
    #[arg(long = "set", value_name = "KEY.PATH=VALUE")]
    pub overrides: Vec<String>,

    /// Job id shared by every worker (TORCHELASTIC_RUN_ID); the rendezvous store checks it, so
    /// it is a secret. Default: `LAUNCH_RUN_ID`, `--run-id-file`, the Slurm job id,
    /// `PET_RDZV_ID`; a fresh random id on a single node; on several nodes torchrun's `none`,
    /// with a warning that the run is unauthenticated (see --require-secret).
    #[arg(
        long = "run-id",
        alias = "rdzv-id",
        alias = "rdzv_id",
        alias = "run_id"
    )]
    pub run_id: Option<String>,

    /// Refuse to start when the run id is no secret (several nodes given none, so torchrun's
    /// `none`, or one derived from the Slurm job) instead of warning that the run's traffic is
    /// unauthenticated. Also `LAUNCH_REQUIRE_SECRET=1` or `dist.require_secret = true`.
    #[arg(long = "require-secret")]
    pub require_secret: bool,

    /// A file holding the run id, on a filesystem every node shares: node 0 writes a fresh
    /// secret there (mode 0600) when it does not exist, the other nodes wait for it. Also
    /// `LAUNCH_RUN_ID_FILE`.
    #[arg(long = "run-id-file", value_name = "PATH")]
    pub run_id_file: Option<PathBuf>,

    /// DeepSpeed's hostfile (`HOST slots=N` per line): start one `launch` per host over
    /// `ssh`, node 0 on the first host (the master address), N processes on each; the run id
    /// and the environment travel on ssh's stdin. Exit code: the worst of the failed hosts.
    #[arg(
        long,
        short = 'H',
        value_name = "FILE",
        conflicts_with_all = ["nnodes", "node_rank", "num_processes", "gpu_ids", "run_id_file", "standalone", "rdzv_endpoint"]
    )]
    pub hostfile: Option<PathBuf>,

    /// With --hostfile: only these hosts and slots, e.g. `h1:0,2@h2` (`@` between hosts, `:`
    /// before slots; a host alone means all its slots).
    #[arg(
        long,
        value_name = "HOST[:SLOTS]@...",
        requires = "hostfile",
        conflicts_with = "exclude"
    )]
    pub include: Option<String>,

    /// With --hostfile: all hosts and slots but these (same spelling as --include).
    #[arg(long, value_name = "HOST[:SLOTS]@...", requires = "hostfile")]
    pub exclude: Option<String>,

    /// With --hostfile: the path of `launch` on the hosts. Default: `LAUNCH_REMOTE_PATH`, or
    /// this launch's own path.
    #[arg(long = "launch-path", value_name = "PATH", requires = "hostfile")]
    pub launch_path: Option<PathBuf>,

    /// With --hostfile: the port of the hosts' ssh servers (`ssh -p`).
    #[arg(
        long = "ssh-port",
        alias = "ssh_port",
        value_name = "PORT",
        requires = "hostfile"
    )]
    pub ssh_port: Option<u16>,

    /// With --hostfile: an ssh config file (`ssh -F`), e.g. for the key, user and port.
    #[arg(long = "ssh-config", value_name = "FILE", requires = "hostfile")]
    pub ssh_config: Option<PathBuf>,

    /// The worker binary to run with CONFIG (default: `worker` next to `launch`).
    #[arg(long, value_name = "PATH")]
    pub worker: Option<PathBuf>,

    /// Start even when a GPU's free memory, taken by other processes, does not hold the memory
    /// estimate (by default `launch` refuses, naming those processes).
    #[arg(long)]
    pub force: bool,

    /// torchrun's `--numa-binding`: pin each worker to CPUs (from before it starts, so its
    /// threads and the processes it starts, DataLoader workers included, stay there).
    /// `exclusive` or `core-complex`: its own disjoint share of the CPUs `launch` may use, in
    /// NUMA order; `node` or `socket`: every CPU of the NUMA node(s) its share lies on. Default:
    /// not pinned, as torchrun.
    #[arg(
        long = "numa-binding",
        alias = "numa_binding",
        value_name = "MODE",
        value_parser = ["node", "socket", "exclusive", "core-complex"]
    )]
    pub numa_binding: Option<String>,

    /// Pin each worker to its own CPUs (`--numa-binding exclusive`).
    #[arg(long, conflicts_with = "numa_binding")]
    pub pin: bool,

    /// Do not pin workers to CPUs: the default (kept for command lines written when `launch`
    /// pinned by default).
    #[arg(long = "no-pin", conflicts_with_all = ["pin", "numa_binding"])]
    pub no_pin: bool,

    /// torchrun's `--role`: the workers' `ROLE_NAME`. Default: `default`.
    #[arg(long, value_name = "NAME")]
    pub role: Option<String>,

    /// torchrun's `--signals-to-handle`: passed on as `TORCHELASTIC_SIGNALS_TO_HANDLE`. `launch`
    /// itself handles SIGINT, SIGTERM and SIGHUP (the workers are stopped as one group, SIGTERM
    /// then SIGKILL), whatever the list. Default: `SIGTERM,SIGINT,SIGHUP,SIGQUIT`.
    #[arg(
        long = "signals-to-handle",
        alias = "signals_to_handle",
        value_name = "SIGNALS",
        value_parser = parse_signals
    )]
    pub signals_to_handle: Option<String>,

    /// torchrun's `--virtual-local-rank`: every worker of a program (not our worker, which
    /// picks its GPU by LOCAL_RANK) gets `LOCAL_RANK=0` and only its own GPU in
    /// `CUDA_VISIBLE_DEVICES`.
    #[arg(long = "virtual-local-rank", alias = "virtual_local_rank")]
    pub virtual_local_rank: bool,

    /// torchrun's `--monitor-interval`: accepted, no effect (`launch` learns of a worker's end
    /// at once, from the kernel, instead of polling).
    #[arg(long = "monitor-interval", alias = "monitor_interval", value_name = "SECS", value_parser = parse_seconds)]
    pub monitor_interval: Option<Duration>,

    /// torchrun's `--start-method` (`spawn`, `fork`, `forkserver`): accepted, no effect (each
    /// worker is a process of its own, started directly).
    #[arg(long = "start-method", alias = "start_method", value_name = "METHOD", value_parser = ["spawn", "fork", "forkserver"])]
    pub start_method: Option<String>,

    /// torchrun's `--event-log-handler`: accepted, no effect (torchrun's event handlers are
    /// Python objects; `launch` reports through its summary and exit code).
    #[arg(
        long = "event-log-handler",
        alias = "event_log_handler",
        value_name = "NAME"
    )]
    pub event_log_handler: Option<String>,

    /// torchrun's `--logs-specs`: accepted; `launch` writes torchrun's default layout (a
    /// Python entry point of another name cannot be loaded here, and a line says so).
    #[arg(long = "logs-specs", alias = "logs_specs", value_name = "NAME")]
    pub logs_specs: Option<String>,

    /// torchrun's `--duplicate-stdout-filters`: accepted, not applied (a line says so); every
    /// line is in --log-dir's stdout.log.
    #[arg(
        long = "duplicate-stdout-filters",
        alias = "duplicate_stdout_filters",
        value_name = "FILTERS"
    )]
    pub duplicate_stdout_filters: Option<String>,

    /// torchrun's `--duplicate-stderr-filters`: as `--duplicate-stdout-filters`, for stderr.
    #[arg(
        long = "duplicate-stderr-filters",
        alias = "duplicate_stderr_filters",
        value_name = "FILTERS"
    )]
    pub duplicate_stderr_filters: Option<String>,

    /// torchrun's `--run-path`: run the script with `python3` (torchrun runs it in its own
    /// interpreter; the script sees the same).
    #[arg(long = "run-path", alias = "run_path")]
    pub run_path: bool,

    /// accelerate's `--config_file`: its config (YAML or JSON, as `accelerate config` writes it)
    /// fills what the flags leave. With any accelerate flag and no `--config_file`, accelerate's
    /// default file is read when it exists (`$HF_HOME/accelerate/default_config.yaml`).
    #[arg(long = "config_file", alias = "config-file", value_name = "PATH")]
    pub config_file: Option<PathBuf>,

    /// accelerate's `--num_machines`: nodes; `--num_processes` then counts every process of
    /// the job, as in accelerate (each machine runs num_processes / num_machines).
    #[arg(long = "num_machines", alias = "num-machines", value_name = "N")]
    pub num_machines: Option<u32>,

    /// accelerate's `--machine_rank`: this node's rank (`--node-rank`).
    #[arg(long = "machine_rank", alias = "machine-rank", value_name = "R")]
    pub machine_rank: Option<u32>,

    /// accelerate's `--main_process_ip`: the master address (`--master-addr`).
    #[arg(
        long = "main_process_ip",
        alias = "main-process-ip",
        value_name = "HOST"
    )]
    pub main_process_ip: Option<String>,

    /// accelerate's `--main_process_port`: the master port (`--master-port`).
    #[arg(
        long = "main_process_port",
        alias = "main-process-port",
        value_name = "PORT"
    )]
    pub main_process_port: Option<u16>,

    /// accelerate's `--mixed_precision` (`no`, `fp16`, `bf16`, `fp8`): `ACCELERATE_MIXED_PRECISION`
    /// for a script; for our worker `bf16` is `--set train.bf16=true` (the others: a line says
    /// they are not applied).
    #[arg(long = "mixed_precision", alias = "mixed-precision", value_name = "MODE", value_parser = ["no", "fp16", "bf16", "fp8"])]
    pub mixed_precision: Option<String>,

    /// accelerate's `--multi_gpu`: accepted, no effect (the process count decides).
    #[arg(long = "multi_gpu", alias = "multi-gpu")]
    pub multi_gpu: bool,

    /// accelerate's `--same_network`: accepted, no effect (the master address is dialled
    /// directly).
    #[arg(long = "same_network", alias = "same-network")]
    pub same_network: bool,

    /// accelerate's `--cpu`: `ACCELERATE_USE_CPU=True` for a script.
    #[arg(long)]
    pub cpu: bool,

    /// accelerate's `--num_cpu_threads_per_process`: `OMP_NUM_THREADS` of every worker.
    #[arg(
        long = "num_cpu_threads_per_process",
        alias = "num-cpu-threads-per-process",
        value_name = "N"
    )]
    pub num_cpu_threads_per_process: Option<u32>,

    /// accelerate's `--dynamo_backend`: `ACCELERATE_DYNAMO_BACKEND` for a script.
    #[arg(long = "dynamo_backend", alias = "dynamo-backend", value_name = "NAME")]
    pub dynamo_backend: Option<String>,

    /// accelerate's `--debug`: `ACCELERATE_DEBUG_MODE=true` for a script.
    #[arg(long = "debug")]
    pub accelerate_debug: bool,

    /// accelerate's `--quiet`, `-q`: accepted, no effect.
    #[arg(long, short = 'q')]
    pub quiet: bool,

    /// accelerate's `--main_training_function`: accepted, no effect (for its notebook
    /// launcher).
    #[arg(
        long = "main_training_function",
        alias = "main-training-function",
        value_name = "NAME"
    )]
    pub main_training_function: Option<String>,

    /// accelerate's DeepSpeed flags (`--zero_stage`, `--offload_optimizer_device`, ...).
    #[command(flatten)]
    pub deepspeed: DeepSpeedFlags,

    /// accelerate's FSDP flags (`--fsdp_sharding_strategy`, ...).
    #[command(flatten)]
    pub fsdp: FsdpFlags,

    /// What accelerate's flags and config file set for the workers (`ACCELERATE_*`).
    #[arg(skip)]
    pub accelerate_env: Vec<(String, String)>,

    /// torchrun's `-m`: run the script as a Python module (`python3 -m SCRIPT ARGS...`).
    #[arg(short = 'm', long = "module")]
    pub module: bool,

    /// torchrun's `--no-python`: run the script directly, not with `python3`.
    #[arg(long = "no-python", alias = "no_python")]
    pub no_python: bool,

    /// Training config (TOML) given to each worker; or, torchrun's way, a script and its
    /// arguments (`train.py --lr 3e-4`: run with `python3` unless --no-python; with -m a module).
    #[arg(value_name = "CONFIG|SCRIPT")]
    pub config: Option<PathBuf>,

    /// Run this program instead of the worker (everything after `--`).
    #[arg(last = true, value_name = "PROGRAM ARGS")]
    pub program: Vec<OsString>,

    /// The script given torchrun's way and its arguments (the first word that is not an option
    /// and not a `.toml` config, and every word after it).
    #[arg(skip)]
    pub script: Vec<OsString>,
}

use common::job_shape::{
    parse_node_range, parse_num_processes, parse_rdzv_conf, parse_secs, Count, NodeRange,
};
pub use common::job_shape::{NumProcesses, MAX_PROCESSES};

/// The command line, or the process's end: a bad value is one line, `launch: error: ...`,
/// exit 2; `--help`, `--version` and other usage errors print as clap prints them.
pub fn parse() -> Cli {
    let error = match parse_from(std::env::args_os().collect()) {
        Ok(cli) => return cli,
        Err(error) => error,
    };
    if error.kind() != clap::error::ErrorKind::ValueValidation {
        error.exit();
    }
    eprintln!("launch: {}", one_line(&error.render().to_string()));
    std::process::exit(2);
}

/// The command line `args` (program name first), a script given torchrun's way included.
pub fn parse_from(args: Vec<OsString>) -> Result<Cli, clap::Error> {
    use clap::FromArgMatches;
    // Built once, for the split and the parse: it is most of the parsing's time.
    let mut command = abbrev::built_command();
    let (options, script) = split_script(&command, args);
    let mut matches = command
        .try_get_matches_from_mut(options)
        .map_err(|e| abbrev::name_ambiguity(&mut command, e))?;
    let mut cli = Cli::from_arg_matches_mut(&mut matches).map_err(|e| e.format(&mut command))?;
    cli.script = script;
    Ok(cli)
}

/// Splits `args` at the script given torchrun's way (`launch --nproc-per-node 2 train.py --lr
/// 3e-4`): the first word that is neither an option, an option's value, nor a `.toml` config.
/// It and every word after it are the script's (torchrun's `training_script_args`), so its own
/// options are never read as `launch`'s. Nothing is split before `--` or without such a word.
fn split_script(command: &clap::Command, args: Vec<OsString>) -> (Vec<OsString>, Vec<OsString>) {
    let takes_value =
        |word: &str| -> bool { abbrev::flag(command, word).is_some_and(|f| f.value_follows()) };
    let mut i = 1;
    while let Some(word) = args.get(i).and_then(|w| w.to_str()) {
        if word == "--" {
            break;
        }
        if word.starts_with('-') && word.len() > 1 {
            i += if takes_value(word) { 2 } else { 1 };
            continue;
        }
        let toml = Path::new(word)
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("toml"));
        if toml {
            break;
        }
        let mut options = args;
        let script = options.split_off(i);
        return (options, script);
    }
    (args, Vec::new())
}

/// clap's rendering of a bad value without its hint, on one line (a value may hold newlines).
fn one_line(rendered: &str) -> String {
    let error = rendered.split("\n\nFor more information").next();
    error.unwrap_or_default().trim_end().replace('\n', "\\n")
}

/// `--gpu-ids` as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuIds {
    /// `all`: every visible GPU (as `--num-processes auto`).
    All,
    /// These GPUs, in this order: local rank i runs on the i-th.
    List(Vec<u32>),
}

pub(crate) fn parse_gpu_ids(text: &str) -> Result<GpuIds, String> {
    let text = text.trim();
    if text == "all" {
        return Ok(GpuIds::All);
    }
    let listed = text.split(',').count() as u64;
    Count::Processes
        .at_most(listed)
        .map_err(|why| format!("{listed} GPUs listed: {why}"))?;
    let mut ids = Vec::new();
    for item in text.split(',').map(str::trim) {
        let id: u32 = item.parse().map_err(|_| {
            format!("expected GPU indices separated by commas (e.g. 0,2,5) or `all`, got {text:?}")
        })?;
        if ids.contains(&id) {
            return Err(format!("GPU {id} is listed twice in {text:?}"));
        }
        ids.push(id);
    }
    Ok(GpuIds::List(ids))
}

/// `--rdzv-conf`, parsed: (key, seconds) pairs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdzvConf(pub Vec<(String, Duration)>);

fn parse_conf(text: &str) -> Result<RdzvConf, String> {
    parse_rdzv_conf(text).map(RdzvConf)
}

/// `--signals-to-handle`: signal names separated by commas, as torchrun takes them.
fn parse_signals(text: &str) -> Result<String, String> {
    let known = [
        "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2",
    ];
    for name in text.split(',').map(str::trim) {
        if !known.contains(&name) {
            return Err(format!(
                "unknown signal {name:?}: expected some of {} separated by commas",
                known.join(", ")
            ));
        }
    }
    Ok(text.split(',').map(str::trim).collect::<Vec<_>>().join(","))
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
        parse_from(
            std::iter::once("launch")
                .chain(args.iter().copied())
                .map(OsString::from)
                .collect(),
        )
    }

    #[test]
    fn negative_numbers_are_named_as_bad_values_of_their_flag() {
        for (flag, why) in [
            ("--num-processes", "expected a positive number"),
            ("--grace-period", "must be between 0 and 86400 seconds"),
            ("--max-restarts", "-1 is not in 0..="),
            ("--master-port", "-1 is not in 0..="),
        ] {
            let text = parse(&[flag, "-1", "c.toml"]).unwrap_err().to_string();
            assert!(
                text.contains(&format!("invalid value '-1' for '{flag}")),
                "{text}"
            );
            assert!(text.contains(why), "{text}");
        }
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
        assert_eq!(cli.num_processes, Some(NumProcesses::Count(3)));
        assert_eq!(cli.master_addr.as_deref(), Some("10.1.1.1"));
        assert_eq!(cli.master_port, Some(1234));
        assert_eq!(cli.max_restarts, Some(2));
        assert_eq!(cli.run_id.as_deref(), Some("abc"));
        assert_eq!(cli.program, vec![OsString::from("python"), "x.py".into()]);
        let cli = parse(&["--nproc-per-node", "auto", "c.toml"]).unwrap();
        assert_eq!(cli.num_processes, Some(NumProcesses::Auto));
        let cli = parse(&["--gpu_ids", "0,2,5", "c.toml"]).unwrap();
        assert_eq!(cli.gpu_ids, Some(GpuIds::List(vec![0, 2, 5])));
        let cli = parse(&["--gpu-ids", "all", "c.toml"]).unwrap();
        assert_eq!(cli.gpu_ids, Some(GpuIds::All));
        let cli = parse(&[
            "--nnodes",
            "1:4",
            "--rdzv_endpoint",
            "h:5",
            "--rdzv-backend",
            "c10d",
            "--rdzv-conf",
            "last_call_timeout=2",
            "c.toml",
        ])
        .unwrap();
        assert_eq!(cli.nnodes, Some(NodeRange { min: 1, max: 4 }));
        assert_eq!(cli.rdzv_endpoint.as_deref(), Some("h:5"));
        assert_eq!(
            cli.rdzv_conf,
            Some(RdzvConf(vec![(
                "last_call_timeout".into(),
                Duration::from_secs(2)
            )]))
        );
        // Nothing given: the job shape decides (Slurm, PET_*, defaults).
        let cli = parse(&["c.toml"]).unwrap();
        assert_eq!(
            (cli.num_processes, cli.nnodes, cli.master_port),
            (None, None, None)
        );
    }

    #[test]
    fn bad_values_are_rejected() {
        for args in [
            &["--num-processes", "0", "c.toml"][..],
            &["--num-processes", "two", "c.toml"],
            &["--num-processes", "5000", "c.toml"],
            &["--nnodes", "4:1", "c.toml"],
            &["--rdzv-conf", "bogus=1", "c.toml"],
            &["--rdzv-timeout", "0", "c.toml"],
            &["--rdzv-backend", "etcd", "c.toml"],
            &["--grace-period", "-1", "c.toml"],
            &["--master-port", "70000", "c.toml"],
            &["--gpu-ids", "0,,1", "c.toml"],
            &["--gpu-ids", "0,1,0", "c.toml"],
            &["--gpu-ids", "", "c.toml"],
            &["--gpu-ids", "-1", "c.toml"],
            &["--bogus", "c.toml"],
        ] {
            assert!(parse(args).is_err(), "{args:?} should fail");
        }
    }

    /// Counts past the limits name the value and the limit, however many digits they have;
    /// clap's rendering becomes one line.
    #[test]
    fn huge_counts_are_refused_with_the_limit() {
        for (args, why) in [
            (
                &["--nnodes", "1:4000000000"][..],
                "4000000000 nodes is more than launch supports (at most 65536)",
            ),
            (
                &["--nnodes", "65537"],
                "65537 nodes is more than launch supports (at most 65536)",
            ),
            (
                &["--nnodes", "99999999999999999999999"],
                "99999999999999999999999 nodes",
            ),
            (
                &["--num-processes", "1025"],
                "1025 processes on one node is more than launch supports (at most 1024)",
            ),
            (
                &[
                    "--gpu-ids",
                    &(0..1025)
                        .map(|i| i.to_string())
                        .collect::<Vec<_>>()
                        .join(","),
                ],
                "1025 GPUs listed: 1025 processes on one node",
            ),
        ] {
            let error = parse(&[args, &["c.toml"]].concat()).unwrap_err();
            let line = one_line(&error.render().to_string());
            assert!(line.starts_with("error: invalid value '"), "{line}");
            assert!(line.contains(why), "{line}");
            assert!(!line.contains('\n'), "{line}");
        }
        let cli = parse(&["--nnodes", "1:65536", "--num-processes", "1024", "c.toml"]).unwrap();
        assert_eq!(cli.nnodes, Some(NodeRange { min: 1, max: 65536 }));
        assert_eq!(
            one_line("error: invalid value 'a\nb' for '--x': bad\n\nFor more information, try '--help'.\n"),
            "error: invalid value 'a\\nb' for '--x': bad"
        );
    }

    /// Every flag of torchrun 2.11 is accepted, in both spellings, before the script.
    #[test]
    fn every_torchrun_flag_is_accepted() {
        let cli = parse(&[
            "--monitor-interval",
            "0.5",
            "--start_method",
            "fork",
            "--event-log-handler",
            "null",
            "--role",
            "trainer",
            "--run-path",
            "--logs_specs",
            "default",
            "--numa-binding",
            "node",
            "--signals-to-handle",
            "SIGTERM,SIGUSR1",
            "--virtual-local-rank",
            "--duplicate-stdout-filters",
            "loss",
            "--duplicate_stderr_filters",
            "error",
            "--local-addr",
            "10.0.0.2",
            "--redirects",
            "3",
            "--tee",
            "1",
            "train.py",
            "--lr",
            "1",
        ])
        .unwrap();
        assert_eq!(cli.role.as_deref(), Some("trainer"));
        assert_eq!(cli.signals_to_handle.as_deref(), Some("SIGTERM,SIGUSR1"));
        assert!(cli.virtual_local_rank && cli.run_path);
        assert_eq!(cli.script, ["train.py", "--lr", "1"].map(OsString::from));
        assert!(parse(&["--signals-to-handle", "SIGKILL", "x.py"]).is_err());
        assert!(parse(&["--start-method", "thread", "x.py"]).is_err());
    }

    #[test]
    fn grace_period_takes_fractions() {
        let cli = parse(&["--grace-period", "0.5", "c.toml"]).unwrap();
        assert_eq!(cli.grace_period, Duration::from_millis(500));
    }
}
