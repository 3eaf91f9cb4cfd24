//! Where the job's shape comes from: nodes, this node's rank, the rendezvous address and port,
//! the run id, processes per node and the restart budget, each resolved with the precedence
//! an explicit flag > Slurm's variables (inside an `srun` step) > torchrun's `PET_*` variables
//! (Kubeflow's PyTorchJob, TorchX) > the default, and each carrying its [`Source`] so that a dry
//! run can say where it came from.
//!
//! Pure logic over an environment map (no `std::env`, no I/O): the launcher passes the real
//! environment, tests pass their own. It must not look at devices or bind ports; choosing which
//! GPUs exist is the launcher's.

use std::collections::BTreeMap;
use std::fmt;

use crate::hostlist;

mod elastic;
mod limits;
mod secret;
pub use elastic::{
    parse_endpoint, parse_node_range, parse_rdzv_conf, parse_secs, Elastic, NodeRange,
    DEFAULT_LAST_CALL, DEFAULT_RDZV_PORT,
};
pub use limits::{check_world, Count, CountError, MAX_NODES, MAX_PROCESSES, MAX_WORLD};
pub use secret::require_secret_from_env;

/// `--num-processes` as written (or as an environment gave it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NumProcesses {
    /// One per visible GPU (1 when there is none).
    Auto,
    /// One per CPU core.
    Cpu,
    Count(u32),
}

/// torchrun's default rendezvous port.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Our own variable for the run id, read like `--run-id`: a secret shared by every node through
/// the environment, which (unlike a command line) other users cannot read in `ps`.
pub const RUN_ID_VAR: &str = "LAUNCH_RUN_ID";
/// Our variable naming a file that holds the run id (see `--run-id-file`).
pub const RUN_ID_FILE_VAR: &str = "LAUNCH_RUN_ID_FILE";
/// Our variable that makes a run without a secret run id an error (see `--require-secret`).
pub const REQUIRE_SECRET_VAR: &str = "LAUNCH_REQUIRE_SECRET";
/// torchrun's default run id, which several nodes given no secret use too: anyone can present
/// it, so it keeps nobody out.
pub const PUBLIC_RUN_ID: &str = "none";

/// Parses `N`, `auto`, `gpu` or `cpu`.
pub fn parse_num_processes(text: &str) -> Result<NumProcesses, String> {
    match text.trim() {
        "auto" | "gpu" => Ok(NumProcesses::Auto),
        "cpu" => Ok(NumProcesses::Cpu),
        other => match Count::Processes.parse(other) {
            Ok(0) => Err("must be at least 1".to_string()),
            Ok(n) => Ok(NumProcesses::Count(n)),
            Err(CountError::TooMany(why)) => Err(why),
            Err(CountError::NotANumber) => Err(format!(
                "expected a positive number, `auto`, `gpu` or `cpu`, got {other:?}"
            )),
        },
    }
}

/// Where one value of the job shape came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A command-line flag, e.g. `--nnodes`.
    Flag(&'static str),
    /// One of our own variables (`LAUNCH_RUN_ID`).
    Env(String),
    /// Slurm's variables, e.g. `SLURM_NNODES=2`, or how a value was derived from them.
    Slurm(String),
    /// torchrun's `PET_*` variables as Kubernetes operators and TorchX set them.
    Pet(String),
    /// A file holding the value (`--run-id-file`, `LAUNCH_RUN_ID_FILE`).
    File(String),
    /// The default, with why when it depends on something (`single node`).
    Default(&'static str),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Flag(flag) => write!(f, "flag {flag}"),
            Source::Env(what) => write!(f, "environment {what}"),
            Source::Slurm(what) => write!(f, "Slurm {what}"),
            Source::Pet(what) => write!(f, "Kubernetes/TorchX {what}"),
            Source::File(path) => write!(f, "file {path}"),
            Source::Default("") => write!(f, "default"),
            Source::Default(why) => write!(f, "default ({why})"),
        }
    }
}

/// A resolved value and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sourced<T> {
    pub value: T,
    pub source: Source,
}

impl<T> Sourced<T> {
    fn new(value: T, source: Source) -> Self {
        Sourced { value, source }
    }
}

/// What the command line said explicitly (`None`: not given).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Flags {
    pub nnodes: Option<u32>,
    pub node_rank: Option<u32>,
    pub master_addr: Option<String>,
    pub master_port: Option<u16>,
    pub run_id: Option<String>,
    /// `--run-id-file`: the run id is read from (or, on node 0, written into) this file.
    pub run_id_file: Option<String>,
    pub num_processes: Option<NumProcesses>,
    /// `--gpu-ids`: one worker per listed GPU.
    pub gpu_ids: Option<Vec<u32>>,
    pub max_restarts: Option<u32>,
    pub standalone: bool,
    /// `--nnodes MIN:MAX` with `MIN < MAX` (then `nnodes` is `None`).
    pub elastic_nnodes: Option<NodeRange>,
    /// `--rdzv-endpoint HOST[:PORT]` as written.
    pub rdzv_endpoint: Option<String>,
    /// `--rdzv-timeout SECS`.
    pub rdzv_timeout: Option<std::time::Duration>,
    /// `--rdzv-conf key=value,...`, parsed.
    pub rdzv_conf: Vec<(String, std::time::Duration)>,
}

/// The job shape for this node, each value with its source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobShape {
    pub nnodes: Sourced<u32>,
    pub node_rank: Sourced<u32>,
    pub master_addr: Sourced<String>,
    /// `0`: pick a free port at launch (single node only).
    pub master_port: Sourced<u16>,
    /// `None`: a fresh secret per run (single node), the file's content ([`Source::File`]), or,
    /// on several nodes with nothing given, none ([`JobShape::needs_run_id`]).
    pub run_id: Sourced<Option<String>>,
    pub num_processes: Sourced<NumProcesses>,
    pub max_restarts: Sourced<u32>,
    /// The Slurm step this launch runs in, when it does.
    pub slurm: Option<SlurmStep>,
    /// `--nnodes MIN:MAX` (or `PET_NNODES`) with `MIN < MAX`: the rendezvous decides the node
    /// count and this node's rank at every (re)start; `nnodes` is then `MAX`.
    pub elastic: Option<Elastic>,
}

/// A bad value in the command line or the environment: one line naming the flag or variable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ShapeError(pub String);

/// The environment as a map (tests build their own).
pub type Env = BTreeMap<String, String>;

/// The process environment as an [`Env`] (variables that are not UTF-8 are left out).
pub fn process_env() -> Env {
    std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect()
}

/// Resolves the job shape from the flags and the environment.
pub fn resolve(flags: &Flags, env: &Env) -> Result<JobShape, ShapeError> {
    let slurm = SlurmStep::from_env(env)?;
    let pet = Pet { env };
    let (nnodes, range) = resolve_nnodes(flags, &slurm, &pet)?;
    let node_rank = resolve_node_rank(flags, &slurm, &pet, &nnodes)?;
    let multi = nnodes.value > 1;
    let (master_addr, master_port) = resolve_master(flags, &slurm, &pet, &nnodes)?;
    let by_rendezvous = rendezvous_assigns_ranks(flags, &pet, &range, &node_rank)?;
    let master = (&master_addr, &master_port);
    let elastic = elastic::resolve(flags, &pet, range, master, by_rendezvous)?;
    let run_id = resolve_run_id(flags, env, &slurm, &pet, multi)?;
    let num_processes = resolve_num_processes(flags, &slurm, &pet)?;
    let max_restarts = match flags.max_restarts {
        Some(n) => Sourced::new(n, Source::Flag("--max-restarts")),
        None => pet
            .get("MAX_RESTARTS", parse_u32)?
            .unwrap_or_else(|| Sourced::new(0, Source::Default(""))),
    };
    Ok(JobShape {
        nnodes,
        node_rank,
        master_addr,
        master_port,
        run_id,
        num_processes,
        max_restarts,
        slurm,
        elastic,
    })
}

/// Nodes: `--standalone`, `--nnodes`, the Slurm step, `PET_NNODES`, else 1; a Slurm batch
/// script of a multi-node job is refused (it runs on the first node only).
fn resolve_nnodes(
    flags: &Flags,
    slurm: &Option<SlurmStep>,
    pet: &Pet<'_>,
) -> Result<(Sourced<u32>, Sourced<NodeRange>), ShapeError> {
    let as_range = |n: &Sourced<u32>| {
        Sourced::new(
            NodeRange {
                min: n.value,
                max: n.value,
            },
            n.source.clone(),
        )
    };
    let range = if flags.standalone {
        let more = flags.nnodes.is_some_and(|n| n > 1) || flags.elastic_nnodes.is_some();
        if more {
            return Err(ShapeError(
                "--standalone is a single-node run; it cannot be combined with --nnodes > 1".into(),
            ));
        }
        as_range(&Sourced::new(1, Source::Flag("--standalone")))
    } else if let Some(r) = flags.elastic_nnodes {
        Sourced::new(r, Source::Flag("--nnodes"))
    } else if let Some(n) = flags.nnodes {
        as_range(&Sourced::new(n, Source::Flag("--nnodes")))
    } else if let Some(s) = slurm {
        as_range(&s.nnodes)
    } else if let Some(r) = pet.get("NNODES", parse_node_range)? {
        r
    } else {
        as_range(&Sourced::new(1, Source::Default("")))
    };
    // An elastic job counts as its largest size wherever a node count is checked.
    let nnodes = Sourced::new(range.value.max, range.source.clone());
    if let Some(s) = slurm {
        s.check_one_task_per_node(nnodes.value)?;
        if s.step_id.is_none() && nnodes.value > 1 && matches!(nnodes.source, Source::Slurm(_)) {
            return Err(ShapeError(format!(
                "launch runs in the batch script of a {}-node Slurm job ({}), which runs on the first node only: start one launch per node with `srun --ntasks-per-node=1 launch ...` (as scripts/slurm/train.sbatch does)",
                nnodes.value, nnodes.source
            )));
        }
    }
    Ok((nnodes, range))
}

/// This node's rank: `--node-rank`, the Slurm step, `PET_NODE_RANK`, else 0; below `nnodes`.
fn resolve_node_rank(
    flags: &Flags,
    slurm: &Option<SlurmStep>,
    pet: &Pet<'_>,
    nnodes: &Sourced<u32>,
) -> Result<Sourced<u32>, ShapeError> {
    let node_rank = if let Some(r) = flags.node_rank {
        Sourced::new(r, Source::Flag("--node-rank"))
    } else if let (Some(s), false) = (slurm, flags.standalone) {
        s.node_rank.clone()
    } else if let Some(r) = pet.get("NODE_RANK", parse_u32)? {
        r
    } else {
        Sourced::new(0, Source::Default(""))
    };
    if node_rank.value >= nnodes.value {
        return Err(ShapeError(format!(
            "node rank {} ({}) is out of range for {} node(s) ({}); ranks are 0..{}",
            node_rank.value,
            node_rank.source,
            nnodes.value,
            nnodes.source,
            nnodes.value - 1
        )));
    }
    Ok(node_rank)
}

/// Whether the node ranks of a fixed multi-node job come from the rendezvous, as torchrun's
/// `--nnodes N --rdzv-endpoint HOST:PORT --rdzv-id J` (no node rank anywhere) has them: the job
/// is then formed like an elastic one of exactly N nodes. A multi-node job with neither a node
/// rank nor an endpoint is refused: every node would believe it is node 0.
fn rendezvous_assigns_ranks(
    flags: &Flags,
    pet: &Pet<'_>,
    range: &Sourced<NodeRange>,
    node_rank: &Sourced<u32>,
) -> Result<bool, ShapeError> {
    let Some(n) = range.value.fixed().filter(|&n| n > 1) else {
        return Ok(false);
    };
    if !matches!(node_rank.source, Source::Default(_)) {
        return Ok(false);
    }
    if flags.rdzv_endpoint.is_some() || pet.rdzv_endpoint()?.is_some() {
        return Ok(true);
    }
    Err(ShapeError(format!(
        "{n} nodes ({}) but no node rank: give each node its own --node-rank (0..{}), or the same --rdzv-endpoint HOST:PORT and --rdzv-id on every node to have the ranks assigned there",
        range.source,
        n - 1
    )))
}

/// The rendezvous address and port: flags, the Slurm step, `PET_MASTER_*`, then
/// `PET_RDZV_ENDPOINT`, else the defaults; several nodes need a fixed port.
fn resolve_master(
    flags: &Flags,
    slurm: &Option<SlurmStep>,
    pet: &Pet<'_>,
    nnodes: &Sourced<u32>,
) -> Result<(Sourced<String>, Sourced<u16>), ShapeError> {
    let multi = nnodes.value > 1;
    let (endpoint_host, endpoint_port) = match pet.rdzv_endpoint()? {
        Some((host, port)) => (Some(host), port),
        None => (None, None),
    };
    let master_addr = if let Some(a) = &flags.master_addr {
        Sourced::new(a.clone(), Source::Flag("--master-addr"))
    } else if let (Some(s), true) = (slurm, multi) {
        s.master_addr.clone()
    } else if let Some(a) = pet.get("MASTER_ADDR", parse_host)? {
        a
    } else if let Some(a) = endpoint_host {
        a
    } else {
        Sourced::new(
            "127.0.0.1".to_string(),
            Source::Default(if multi { "" } else { "single node" }),
        )
    };
    let master_port = if flags.standalone {
        Sourced::new(0, Source::Flag("--standalone"))
    } else if let Some(p) = flags.master_port {
        Sourced::new(p, Source::Flag("--master-port"))
    } else if let (Some(s), true) = (slurm, multi) {
        s.master_port.clone()
    } else if let Some(p) = pet.get("MASTER_PORT", parse_port)? {
        p
    } else if let Some(p) = endpoint_port {
        p
    } else if multi {
        Sourced::new(DEFAULT_MASTER_PORT, Source::Default(""))
    } else {
        // No other node dials it: a free port from the OS, so jobs side by side never clash.
        Sourced::new(0, Source::Default("single node: a free port"))
    };
    if multi && master_port.value == 0 {
        return Err(ShapeError(format!(
            "master port 0 ({}) picks a port on this node only; with {} nodes every node needs the same fixed port",
            master_port.source, nnodes.value
        )));
    }
    Ok((master_addr, master_port))
}

fn resolve_run_id(
    flags: &Flags,
    env: &Env,
    slurm: &Option<SlurmStep>,
    pet: &Pet<'_>,
    multi: bool,
) -> Result<Sourced<Option<String>>, ShapeError> {
    let nonempty = |id: &str, what: &str| {
        if id.trim().is_empty() {
            Err(ShapeError(format!("{what} must not be empty")))
        } else {
            Ok(Some(id.to_string()))
        }
    };
    if let Some(id) = &flags.run_id {
        return Ok(Sourced::new(
            nonempty(id, "--run-id")?,
            Source::Flag("--run-id"),
        ));
    }
    if let Some(id) = env.get(RUN_ID_VAR) {
        return Ok(Sourced::new(
            nonempty(id, RUN_ID_VAR)?,
            Source::Env(RUN_ID_VAR.to_string()),
        ));
    }
    let file = match (&flags.run_id_file, env.get(RUN_ID_FILE_VAR)) {
        (Some(path), _) => Some((path.clone(), "--run-id-file")),
        (None, Some(path)) => Some((path.clone(), RUN_ID_FILE_VAR)),
        (None, None) => None,
    };
    if let Some((path, what)) = file {
        nonempty(&path, what)?;
        return Ok(Sourced::new(None, Source::File(path)));
    }
    if let (Some(s), false) = (slurm, flags.standalone) {
        return Ok(s.run_id.clone());
    }
    if let Some(id) = pet.get("RDZV_ID", |t| nonempty(t, "PET_RDZV_ID").map_err(|e| e.0))? {
        return Ok(id);
    }
    let why = if multi {
        "none given"
    } else {
        "fresh secret per run"
    };
    Ok(Sourced::new(None, Source::Default(why)))
}

fn resolve_num_processes(
    flags: &Flags,
    slurm: &Option<SlurmStep>,
    pet: &Pet<'_>,
) -> Result<Sourced<NumProcesses>, ShapeError> {
    if let Some(ids) = &flags.gpu_ids {
        let n = ids.len() as u32;
        return match flags.num_processes {
            None | Some(NumProcesses::Auto) => {
                Ok(Sourced::new(NumProcesses::Count(n), Source::Flag("--gpu-ids")))
            }
            Some(NumProcesses::Count(m)) if m == n => Ok(Sourced::new(
                NumProcesses::Count(n),
                Source::Flag("--num-processes"),
            )),
            Some(other) => Err(ShapeError(format!(
                "--num-processes {} does not match --gpu-ids {} ({n} GPU(s)); give one worker per listed GPU or drop --num-processes",
                match other {
                    NumProcesses::Count(m) => m.to_string(),
                    NumProcesses::Cpu => "cpu".into(),
                    NumProcesses::Auto => "auto".into(),
                },
                ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
            ))),
        };
    }
    if let Some(n) = flags.num_processes {
        return Ok(Sourced::new(n, Source::Flag("--num-processes")));
    }
    if let Some(gpus) = slurm.as_ref().and_then(|s| s.gpus.as_ref()) {
        return Ok(Sourced::new(
            NumProcesses::Count(gpus.count),
            Source::Slurm(format!("{} (GPUs of this step)", gpus.count_var)),
        ));
    }
    if let Some(n) = pet.get("NPROC_PER_NODE", parse_num_processes)? {
        return Ok(n);
    }
    Ok(Sourced::new(NumProcesses::Count(1), Source::Default("")))
}

/// torchrun's `PET_<OPTION>` variables.
struct Pet<'a> {
    env: &'a Env,
}

impl Pet<'_> {
    /// `PET_<name>` parsed, or `None` when it is unset or empty.
    fn get<T>(
        &self,
        name: &str,
        parse: impl Fn(&str) -> Result<T, String>,
    ) -> Result<Option<Sourced<T>>, ShapeError> {
        let var = format!("PET_{name}");
        match self.env.get(&var).filter(|v| !v.trim().is_empty()) {
            None => Ok(None),
            Some(text) => parse(text)
                .map(|v| Some(Sourced::new(v, Source::Pet(format!("{var}={text}")))))
                .map_err(|e| ShapeError(format!("environment variable {var}={text:?}: {e}"))),
        }
    }

    /// `PET_RDZV_ENDPOINT=host[:port]` (elastic PyTorchJobs set it instead of the master pair).
    #[allow(clippy::type_complexity)]
    fn rdzv_endpoint(&self) -> Result<Option<(Sourced<String>, Option<Sourced<u16>>)>, ShapeError> {
        let Some(ep) = self.get("RDZV_ENDPOINT", |t| Ok(t.trim().to_string()))? else {
            return Ok(None);
        };
        let text = ep.value.clone();
        let (host, port) = match text.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(':') && !p.contains(']') => (h, Some(p)),
            _ => (text.as_str(), None),
        };
        let bad = |e: String| {
            ShapeError(format!(
                "environment variable PET_RDZV_ENDPOINT={text:?}: {e}"
            ))
        };
        let host = parse_host(host).map_err(bad)?;
        let port = port.map(parse_port).transpose().map_err(bad)?;
        Ok(Some((
            Sourced::new(host, ep.source.clone()),
            port.map(|p| Sourced::new(p, ep.source)),
        )))
    }
}

fn parse_u32(text: &str) -> Result<u32, String> {
    text.trim()
        .parse()
        .map_err(|_| "expected a non-negative number".to_string())
}

fn parse_port(text: &str) -> Result<u16, String> {
    text.trim()
        .parse()
        .map_err(|_| "expected a port number (0-65535)".to_string())
}

fn parse_host(text: &str) -> Result<String, String> {
    let host = text.trim();
    if host.is_empty() || host.chars().any(char::is_whitespace) {
        return Err("expected a host name or address".into());
    }
    Ok(host.to_string())
}

/// What Slurm says about the step `launch` runs in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmStep {
    pub job_id: u64,
    /// `None` in a batch script or an `salloc` shell (no `srun` step).
    pub step_id: Option<u64>,
    pub nnodes: Sourced<u32>,
    pub node_rank: Sourced<u32>,
    /// Tasks in the step (or the job, outside a step) and the variable that said so.
    pub ntasks: Option<(u32, String)>,
    pub master_addr: Sourced<String>,
    pub master_port: Sourced<u16>,
    pub run_id: Sourced<Option<String>>,
    /// The GPUs Slurm gave this node's part of the step, when it gave any.
    pub gpus: Option<SlurmGpus>,
}

/// The GPUs Slurm gave the step on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmGpus {
    pub count: u32,
    /// The variable the count came from, with its value (`SLURM_GPUS_ON_NODE=2`).
    pub count_var: String,
    /// The node's own GPU ids (`SLURM_STEP_GPUS`, or `SLURM_JOB_GPUS` outside a step), in the
    /// order of CUDA's visible devices 0, 1, ...: what `nvidia-smi` on the node calls them.
    pub physical: Option<Vec<String>>,
}

impl SlurmGpus {
    /// The node's id of the GPU that local rank `local_rank` uses (`cuda:local_rank`).
    pub fn physical_of(&self, local_rank: u32) -> Option<&str> {
        self.physical
            .as_ref()?
            .get(local_rank as usize)
            .map(String::as_str)
    }
}

/// Lowest port a Slurm job's rendezvous may get; below the kernel's ephemeral range
/// (32768-60999), so outgoing connections never take it first.
pub const SLURM_PORT_BASE: u16 = 12000;
/// Ports handed out to Slurm jobs: `SLURM_PORT_BASE .. SLURM_PORT_BASE + SLURM_PORT_SPAN`.
pub const SLURM_PORT_SPAN: u64 = 20000;
/// Steps of one job that get distinct ports (steps running at the same time, e.g. a sweep).
const SLURM_STEPS_PER_JOB: u64 = 4;

/// The rendezvous port of a Slurm job step: distinct for jobs whose ids differ by less than
/// 5,000, and for the first 4 steps of a job.
pub fn slurm_port(job_id: u64, step_id: Option<u64>) -> u16 {
    let slots = SLURM_PORT_SPAN / SLURM_STEPS_PER_JOB;
    let offset =
        (job_id % slots) * SLURM_STEPS_PER_JOB + step_id.unwrap_or(0) % SLURM_STEPS_PER_JOB;
    SLURM_PORT_BASE + offset as u16
}

impl SlurmStep {
    /// `None` outside Slurm (no `SLURM_JOB_ID`).
    pub fn from_env(env: &Env) -> Result<Option<SlurmStep>, ShapeError> {
        let Some(job_text) = env.get("SLURM_JOB_ID").or_else(|| env.get("SLURM_JOBID")) else {
            return Ok(None);
        };
        let job_id: u64 = slurm_number(job_text, "SLURM_JOB_ID")?;
        // Outside a step (batch script, salloc shell) SLURM_STEP_ID is absent.
        let step_id = match first_var(env, &["SLURM_STEP_ID", "SLURM_STEPID"]) {
            Some((name, text)) => Some(slurm_number::<u64>(text, name)?),
            None => None,
        };
        let in_step = step_id.is_some();
        let nnodes = match first_step_var(
            env,
            in_step,
            "SLURM_STEP_NUM_NODES",
            &["SLURM_NNODES", "SLURM_JOB_NUM_NODES"],
        ) {
            Some((name, text)) => Sourced::new(
                slurm_count(text, name, Count::Nodes)?.max(1),
                Source::Slurm(format!("{name}={text}")),
            ),
            None => Sourced::new(1, Source::Slurm("(no node count: 1 node)".into())),
        };
        let node_rank = match env.get("SLURM_NODEID") {
            Some(text) => Sourced::new(
                slurm_number(text, "SLURM_NODEID")?,
                Source::Slurm(format!("SLURM_NODEID={text}")),
            ),
            None => Sourced::new(0, Source::Slurm("(no SLURM_NODEID: node 0)".into())),
        };
        let master_addr = match first_step_var(
            env,
            in_step,
            "SLURM_STEP_NODELIST",
            &["SLURM_JOB_NODELIST", "SLURM_NODELIST"],
        ) {
            Some((name, text)) => {
                let host = hostlist::first_host(text)
                    .map_err(|e| ShapeError(format!("environment variable {name}: {e}")))?;
                Sourced::new(host, Source::Slurm(format!("first host of {name}={text}")))
            }
            None => Sourced::new(
                "127.0.0.1".to_string(),
                Source::Slurm("(no node list: this host)".into()),
            ),
        };
        let step_text = step_id.map_or(String::new(), |s| format!(", SLURM_STEP_ID={s}"));
        let master_port = Sourced::new(
            slurm_port(job_id, step_id),
            Source::Slurm(format!("derived from SLURM_JOB_ID={job_id}{step_text}")),
        );
        let run_id = Sourced::new(
            Some(match step_id {
                Some(s) => format!("slurm-{job_id}.{s}"),
                None => format!("slurm-{job_id}"),
            }),
            Source::Slurm(format!("SLURM_JOB_ID={job_id}{step_text}")),
        );
        let ntasks = match first_step_var(
            env,
            in_step,
            "SLURM_STEP_NUM_TASKS",
            &["SLURM_NTASKS", "SLURM_NPROCS"],
        ) {
            Some((name, text)) => Some((
                slurm_count(text, name, Count::World)?,
                format!("{name}={text}"),
            )),
            None => None,
        };
        Ok(Some(SlurmStep {
            job_id,
            step_id,
            nnodes,
            node_rank,
            ntasks,
            master_addr,
            master_port,
            run_id,
            gpus: slurm_gpus(env, in_step)?,
        }))
    }

    /// `launch` starts the workers itself: one `launch` per node, never one per GPU.
    fn check_one_task_per_node(&self, nnodes: u32) -> Result<(), ShapeError> {
        // Outside a step only the batch script runs launch, once, whatever the task count.
        let (Some((ntasks, var)), Some(_)) = (&self.ntasks, self.step_id) else {
            return Ok(());
        };
        if *ntasks <= nnodes.max(self.nnodes.value) {
            return Ok(());
        }
        Err(ShapeError(format!(
            "this Slurm step runs {ntasks} tasks on {} node(s) ({var}), but launch starts the workers itself: run one launch per node with `srun --ntasks-per-node=1 launch --num-processes N ...` (or sbatch scripts/slurm/train.sbatch)",
            self.nnodes.value
        )))
    }
}

/// The GPUs this task may use. In a step, `SLURM_STEP_GPUS` is this task's own list (with
/// `--gpus-per-task` each task gets its own, while `SLURM_GPUS_ON_NODE` stays the node's count);
/// in a batch script, `SLURM_JOB_GPUS`. `SLURM_GPUS_ON_NODE` counts them when no list is given.
fn slurm_gpus(env: &Env, in_step: bool) -> Result<Option<SlurmGpus>, ShapeError> {
    let list_var = if in_step {
        "SLURM_STEP_GPUS"
    } else {
        "SLURM_JOB_GPUS"
    };
    if let Some((name, text)) = first_var(env, &[list_var]) {
        // Counted before any is kept: the list's length is bounded like every GPU count.
        let listed = text.split(',').filter(|s| !s.trim().is_empty()).count() as u64;
        Count::Processes.at_most(listed).map_err(|why| {
            ShapeError(format!(
                "environment variable {name} (set by Slurm) lists {listed} GPUs: {why}"
            ))
        })?;
        let ids = split_ids(text);
        if !ids.is_empty() {
            return Ok(Some(SlurmGpus {
                count: ids.len() as u32,
                count_var: format!("{name}={text}"),
                physical: Some(ids),
            }));
        }
    }
    Ok(match first_var(env, &["SLURM_GPUS_ON_NODE"]) {
        Some((name, text)) => match slurm_count(text, name, Count::Processes)? {
            0 => None,
            count => Some(SlurmGpus {
                count,
                count_var: format!("{name}={text}"),
                physical: None,
            }),
        },
        None => None,
    })
}

fn split_ids(text: &str) -> Vec<String> {
    text.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

fn first_var<'e>(env: &'e Env, names: &[&'static str]) -> Option<(&'static str, &'e str)> {
    names.iter().find_map(|name| {
        env.get(*name)
            .filter(|v| !v.trim().is_empty())
            .map(|v| (*name, v.as_str()))
    })
}

/// Like [`first_var`] over `job_vars`, but in a step the step's own `step_var` comes first.
fn first_step_var<'e>(
    env: &'e Env,
    in_step: bool,
    step_var: &'static str,
    job_vars: &[&'static str],
) -> Option<(&'static str, &'e str)> {
    let from_step = if in_step {
        first_var(env, &[step_var])
    } else {
        None
    };
    from_step.or_else(|| first_var(env, job_vars))
}

/// A count Slurm gave in `name`, within `count`'s limit.
fn slurm_count(text: &str, name: &str, count: Count) -> Result<u32, ShapeError> {
    count.parse(text).map_err(|e| match e {
        CountError::NotANumber => not_a_slurm_number(text, name),
        CountError::TooMany(why) => ShapeError(format!(
            "environment variable {name}={text:?} (set by Slurm): {why}"
        )),
    })
}

fn not_a_slurm_number(text: &str, name: &str) -> ShapeError {
    ShapeError(format!(
        "environment variable {name}={text:?} (set by Slurm) is not a number"
    ))
}

fn slurm_number<T: std::str::FromStr>(text: &str, name: &str) -> Result<T, ShapeError> {
    text.trim()
        .parse()
        .map_err(|_| not_a_slurm_number(text, name))
}

#[cfg(test)]
mod tests;
