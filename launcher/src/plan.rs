//! The plan: what to start, resolved from the command line, the config and the machine — world
//! size, ranks, the rendezvous address and port, each worker's command and environment, and the
//! batch derivation. Building a plan starts no process; only `resolve_port` binds (briefly), and
//! a dry run never calls it.

use std::ffi::OsString;
use std::net::{IpAddr, SocketAddr, TcpListener, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

mod command;
mod describe;
mod elastic;
mod memory;

pub use elastic::{feasible, feasible_world, list_counts};

use command::command_and_config;
use common::batch::BatchPlan;
use common::config::Config;
use common::env_contract::WorkerEnv;
use common::memory::{
    change_text, estimate, largest_fitting_plan, mib_text, other_levers, usable, DataShape,
    DeviceKind, Placement, SAFETY_MARGIN,
};

use common::job_shape::{self, Flags, JobShape, NumProcesses};
use common::train_plan::TrainPlan;

use crate::cli::{Cli, GpuIds};
use crate::gpu::{self, Gpu};

/// A bad command line, config or environment: reported in one line, exit code 2.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error(transparent)]
    Config(#[from] common::train_plan::TrainPlanError),
    #[error("{0}")]
    Usage(String),
}

/// Everything needed to start (or describe) the worker group on this node.
#[derive(Debug, Clone)]
pub struct Plan {
    pub nnodes: u32,
    pub node_rank: u32,
    /// Workers on this node.
    pub nproc: u32,
    /// Global rank of this node's local rank 0: `node_rank x nproc` when every node runs as
    /// many processes (static jobs), the sum over the nodes before it in an elastic round.
    pub first_rank: u32,
    pub world_size: u32,
    pub master_addr: String,
    pub master_port: u16,
    pub run_id: String,
    pub max_restarts: u32,
    pub grace_period: Duration,
    pub log_dir: Option<PathBuf>,
    /// `--rank-logs`: each rank's lines appended to `DIR/rank-N.log`.
    pub rank_logs: Option<PathBuf>,
    /// Whether the workers' streams go to files of torchrun's layout (`--log-dir`, `--tee`,
    /// `--redirects`).
    pub log_streams: bool,
    /// torchrun's log layout (error files, and logs when asked), made at the start
    /// ([`Plan::prepare_logs`]; `None` in a dry run).
    pub layout: Option<Arc<crate::logs::Layout>>,
    /// Which workers' output reaches the console (`--local-ranks-filter`, `--redirects`).
    pub console: crate::console::Policy,
    /// Program and arguments every worker runs.
    pub command: Vec<OsString>,
    /// `OMP_NUM_THREADS` we set because the user did not (value, cores it was derived from).
    pub omp_threads: Option<(usize, usize)>,
    /// The CPUs each local rank is pinned to (`None`: not pinned, not asked or too few CPUs).
    pub cpu_map: Option<crate::cpus::CpuMap>,
    /// The flag that asked for pinning, as written (`--numa-binding node`, `--pin`).
    pub pinning: Option<String>,
    /// The config and its batch derivation, when running the worker on a config.
    pub config: Option<TrainPlan>,
    /// Visible GPUs, when they were looked up (`auto` or a dry run).
    pub gpus: Option<Vec<Gpu>>,
    /// `CUDA_VISIBLE_DEVICES` for the workers when `--gpu-ids` chose their GPUs.
    pub cuda_visible_devices: Option<String>,
    /// Where each value of the job shape came from (for the dry run).
    pub shape: JobShape,
    /// One-line notices to show before starting (e.g. "no GPU found, using 1 process").
    pub notices: Vec<String>,
    /// The warning that the run id keeps nobody out (several nodes, no secret), said once.
    pub secret_warning: Option<String>,
    /// `--role`: the workers' `ROLE_NAME` (default `default`).
    pub role: Option<String>,
    /// `TORCHELASTIC_SIGNALS_TO_HANDLE` (`--signals-to-handle`, or torchrun's default list).
    pub signals_to_handle: String,
    /// `--virtual-local-rank` for a program: each worker sees `LOCAL_RANK=0` and its own GPU only.
    pub virtual_local_rank: bool,
    /// What accelerate's flags and config file set for every worker (`ACCELERATE_*`).
    pub accelerate_env: Vec<(String, String)>,
    /// Elastic jobs: the address other nodes reach this one at (`--local-addr`).
    pub local_addr: String,
    /// The rendezvous port's listening socket ([`Plan::resolve_port`]), held from before anything
    /// starts until the job ends and handed to rank 0 of our worker as its store's listener,
    /// so that no other job can take the port in between.
    pub store_listener: Option<Arc<TcpListener>>,
}

impl Plan {
    /// Resolves the command line and the environment (Slurm, `PET_*`) into a plan. Looks the
    /// GPUs up only when it needs them (`auto`, `--gpu-ids`, a dry run), so a start stays fast.
    pub fn from_cli(cli: &Cli) -> Result<Plan, PlanError> {
        Plan::from_cli_and_env(cli, &job_shape::process_env())
    }

    /// [`Plan::from_cli`] with the environment's job-shape variables given (tests).
    pub fn from_cli_and_env(cli: &Cli, env: &job_shape::Env) -> Result<Plan, PlanError> {
        let flags = flags_of(cli);
        let shape = job_shape::resolve(&flags, env).map_err(|e| PlanError::Usage(e.0))?;
        let mut notices = Vec::new();
        let nnodes = shape.nnodes.value;
        let elastic = shape.elastic.is_some();
        if nnodes > 1 && !elastic && is_loopback_name(&shape.master_addr.value) {
            notices.push(format!(
                "the master address {} ({}) is a loopback address but there are {nnodes} nodes: other nodes cannot reach it",
                shape.master_addr.value, shape.master_addr.source
            ));
        }

        let num_processes = shape.num_processes.value;
        let want_gpus =
            cli.dry_run || num_processes == NumProcesses::Auto || flags.gpu_ids.is_some();
        let found = if want_gpus {
            FoundGpus::look_up(flags.gpu_ids.as_deref())?
        } else {
            FoundGpus::default()
        };
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let nproc = found.processes(num_processes, cli, cores, &mut notices)?;
        let (gpus, selection) = (found.gpus, found.selection);
        let world_size = job_shape::check_world(&shape.nnodes, nproc, &shape.num_processes.source)
            .map_err(|e| PlanError::Usage(e.0))?;

        let elastic = shape.elastic.as_ref().map(|e| (e, nproc));
        let (command, config) = command_and_config(cli, world_size, elastic)?;
        // An elastic job is planned at its largest world that keeps the global batch; each
        // round the rendezvous forms gets its own plan (`for_round`).
        let (nnodes, world_size) = match (&shape.elastic, &config) {
            (Some(_), Some(t)) => (t.batch.world_size as u32 / nproc, t.batch.world_size as u32),
            _ => (nnodes, world_size),
        };

        // accelerate's --num_cpu_threads_per_process sets it as the user would.
        let given = std::env::var_os("OMP_NUM_THREADS").is_some()
            || cli.num_cpu_threads_per_process.is_some();
        let omp_threads = if !given {
            Some(((cores / nproc as usize).max(1), cores))
        } else {
            None
        };
        let require_secret = cli.require_secret
            || job_shape::require_secret_from_env(env).map_err(|e| PlanError::Usage(e.0))?
            || config
                .as_ref()
                .is_some_and(|t| t.config.dist.require_secret);
        notices.extend(torchrun_notices(cli));
        let (run_id, secret_warning) =
            crate::secret::run_id_of(&shape, cli.dry_run, require_secret, &mut notices)
                .map_err(PlanError::Usage)?;
        Ok(Plan {
            nnodes,
            node_rank: shape.node_rank.value,
            first_rank: shape.node_rank.value * nproc,
            nproc,
            world_size,
            master_addr: shape.master_addr.value.clone(),
            master_port: shape.master_port.value,
            run_id,
            max_restarts: shape.max_restarts.value,
            grace_period: cli.grace_period,
            log_dir: cli.log_dir.clone(),
            rank_logs: cli.rank_logs.clone(),
            log_streams: cli.log_dir.is_some() || cli.tee.is_some() || cli.redirects.is_some(),
            layout: None,
            console: console_policy(cli, nproc)?,
            command,
            omp_threads,
            pinning: binding_of(cli).map(|(asked, _)| asked),
            cpu_map: binding_of(cli).and_then(|(_, b)| crate::cpus::plan(nproc, b)),
            config,
            gpus,
            cuda_visible_devices: selection.map(|s| s.cuda_visible_devices),
            local_addr: local_addr(cli, &shape),
            store_listener: None,
            shape,
            notices,
            secret_warning,
            role: cli.role.clone(),
            signals_to_handle: (cli.signals_to_handle.clone())
                .unwrap_or_else(|| "SIGTERM,SIGINT,SIGHUP,SIGQUIT".to_string()),
            virtual_local_rank: cli.virtual_local_rank && cli.config.is_none(),
            accelerate_env: cli.accelerate_env.clone(),
        })
    }

    /// The contract variables of local rank `local_rank` in restart round `restart_count`.
    pub fn worker_env(&self, local_rank: u32, restart_count: u32) -> WorkerEnv {
        WorkerEnv {
            rank: self.first_rank + local_rank,
            local_rank,
            world_size: self.world_size,
            local_world_size: self.nproc,
            group_rank: self.node_rank,
            group_world_size: self.nnodes,
            master_addr: self.master_addr.clone(),
            master_port: self.master_port,
            restart_count,
            max_restarts: self.max_restarts,
            run_id: self.run_id.clone(),
        }
    }

    /// Variables beyond the contract that every worker gets.
    pub fn extra_env(&self) -> Vec<(&'static str, String)> {
        let mut vars = Vec::new();
        if let Some(devices) = &self.cuda_visible_devices {
            vars.push(("CUDA_VISIBLE_DEVICES", devices.clone()));
        }
        // CUDA's own default order is "fastest first"; nvidia-smi, NVML, Slurm and --gpu-ids
        // number GPUs by PCI bus: make cuda:N the GPU everyone else calls N.
        if std::env::var_os("CUDA_DEVICE_ORDER").is_none() {
            vars.push(("CUDA_DEVICE_ORDER", "PCI_BUS_ID".to_string()));
        }
        if let Some((threads, _)) = self.omp_threads {
            vars.push(("OMP_NUM_THREADS", threads.to_string()));
        }
        // Workers write into pipes; without this Python block-buffers and lines arrive late.
        if std::env::var_os("PYTHONUNBUFFERED").is_none() {
            vars.push(("PYTHONUNBUFFERED", "1".to_string()));
        }
        // As torchrun sets them: its agent's signal list, and NCCL's error handling on unless
        // the user chose.
        vars.push((
            "TORCHELASTIC_SIGNALS_TO_HANDLE",
            self.signals_to_handle.clone(),
        ));
        if std::env::var_os("TORCH_NCCL_ASYNC_ERROR_HANDLING").is_none() {
            vars.push(("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1".to_string()));
        }
        // Growable segments in libtorch's CUDA caching allocator (a user's own setting passes
        // through unchanged).
        if let Some((name, value)) =
            common::env_contract::alloc_conf_default(|n| std::env::var_os(n).is_some())
        {
            vars.push((name, value.to_string()));
        }
        vars
    }

    /// Says to our workers that the SIGTERM they are about to get is a preemption (a SIGTERM to
    /// `launch`), not a teardown of its own: they then stop at a checkpoint
    /// ([`common::env_contract::PREEMPT_FILE_VAR`]).
    pub fn mark_preempted(&self) {
        if let (Some(layout), Some(_)) = (&self.layout, &self.config) {
            if let Err(e) = std::fs::write(layout.preempt_marker(), b"SIGTERM\n") {
                tracing::warn!("cannot tell the workers this is a preemption: {e}");
            }
        }
    }

    /// Makes torchrun's log layout ([`crate::logs::Layout`]): where the workers' error files,
    /// and their streams when asked, go.
    pub fn prepare_logs(&mut self) -> Result<(), PlanError> {
        let layout =
            crate::logs::Layout::create(self.log_dir.as_deref(), &self.run_id, self.log_streams)
                .map_err(|e| {
                    let dir = self
                        .log_dir
                        .as_ref()
                        .map_or("a temporary directory".into(), |d| {
                            format!("--log-dir {}", d.display())
                        });
                    PlanError::Usage(format!("cannot make the log directory in {dir}: {e}"))
                })?;
        self.layout = Some(Arc::new(layout));
        Ok(())
    }

    /// Binds the rendezvous port on the node that hosts the store: port 0 (a single node's
    /// default) takes a free one from the OS. For our worker the socket is kept
    /// ([`Plan::store_listener`]); any other program binds the port itself, so it is released.
    /// A port that is taken is refused, naming the process that holds it: it is never swapped
    /// for another that the user did not name (other nodes, or the user's scripts, dial it).
    pub fn resolve_port(&mut self) -> Result<(), PlanError> {
        if self.node_rank != 0 || self.shape.elastic.is_some() {
            return Ok(()); // the store lives on node 0; nothing here to bind
        }
        let ip = resolve_ip(&self.master_addr)?;
        let requested = self.master_port;
        match TcpListener::bind(SocketAddr::new(ip, requested)) {
            Ok(listener) => {
                self.master_port = bound_port(&listener)?;
                if self.config.is_some() {
                    self.store_listener = Some(Arc::new(above_handed_down(listener)?));
                }
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                let held = crate::port::holder(requested)
                    .map(|h| format!(" by {h}"))
                    .unwrap_or_default();
                let advice = if self.nnodes > 1 {
                    "the other nodes expect it, so pick a free port for all of them (or stop what holds it)"
                } else {
                    "pick another, or leave --master-port out for a free one"
                };
                Err(PlanError::Usage(format!(
                    "master port {requested} ({}) on {} is in use{held}; {advice}",
                    self.shape.master_port.source, self.master_addr
                )))
            }
            Err(e) => Err(PlanError::Usage(format!(
                "cannot listen on --master-addr {}:{requested} from this node ({e}); node 0 must own that address",
                self.master_addr
            ))),
        }
    }

    /// The `CUDA_VISIBLE_DEVICES` entry `local_rank` would use as `cuda:LOCAL_RANK`: the
    /// `--gpu-ids` selection, else the inherited list, else the index itself.
    pub fn visible_device(&self, local_rank: u32) -> Option<String> {
        let list = (self.cuda_visible_devices.clone())
            .or_else(|| std::env::var("CUDA_VISIBLE_DEVICES").ok());
        match list {
            Some(list) => (list.split(','))
                .nth(local_rank as usize)
                .map(|d| d.trim().to_string()),
            None => Some(local_rank.to_string()),
        }
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// `--local-ranks-filter`, `--tee` and `--redirects`, checked against this node's local ranks
/// and the log directory the last two write to.
fn console_policy(cli: &Cli, nproc: u32) -> Result<crate::console::Policy, PlanError> {
    let filter = cli.local_ranks_filter.as_ref().map(|r| r.0.clone());
    if let Some(rank) = filter.iter().flatten().find(|&&r| r >= nproc) {
        return Err(PlanError::Usage(format!(
            "--local-ranks-filter {rank}: this node runs local ranks 0..{}",
            nproc - 1
        )));
    }
    Ok(crate::console::Policy {
        shown_ranks: filter,
        redirects: cli.redirects.clone().unwrap_or_default(),
    })
}

/// `listener` moved to a descriptor number above those a worker is handed (0 to 4: the standard
/// streams, the progress pipe, the store's socket), so that setting those up in a child can
/// never overwrite it before it is copied to its own number.
fn above_handed_down(listener: TcpListener) -> Result<TcpListener, PlanError> {
    use std::os::fd::{AsRawFd, FromRawFd};
    // SAFETY: duplicating an open descriptor we own; the copy is owned by the new listener.
    let fd = unsafe { libc::fcntl(listener.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 10) };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return Err(PlanError::Usage(format!(
            "cannot keep the rendezvous port open: {e}"
        )));
    }
    // SAFETY: `fd` is a fresh descriptor of the listening socket, owned by nothing else.
    Ok(unsafe { TcpListener::from_raw_fd(fd) })
}

/// What the command line gave explicitly, for the job shape's precedence rules.
/// One line for each torchrun flag given that `launch` accepts but does not apply as torchrun
/// would (the reference lists those that have no effect at all and need no line).
fn torchrun_notices(cli: &Cli) -> Vec<String> {
    let mut notices = Vec::new();
    if let Some(name) = cli.logs_specs.as_deref().filter(|n| *n != "default") {
        notices.push(format!(
            "--logs-specs {name}: launch writes torchrun's default layout (it cannot load a Python entry point)"
        ));
    }
    for (flag, given) in [
        ("--duplicate-stdout-filters", &cli.duplicate_stdout_filters),
        ("--duplicate-stderr-filters", &cli.duplicate_stderr_filters),
    ] {
        if given.is_some() {
            notices.push(format!(
                "{flag}: not applied by launch; every line is in --log-dir's logs"
            ));
        }
    }
    if cli.virtual_local_rank && cli.config.is_some() {
        notices.push(
            "--virtual-local-rank: not applied to our worker, which picks its GPU by LOCAL_RANK among the visible ones".into(),
        );
    }
    notices
}

/// The pinning the command line asked for (`--numa-binding MODE`, `--pin`), as written and as
/// applied; none unless asked.
fn binding_of(cli: &Cli) -> Option<(String, crate::cpus::Binding)> {
    use crate::cpus::Binding;
    match (&cli.numa_binding, cli.pin) {
        (Some(mode), _) => {
            let binding = Binding::parse(mode).unwrap_or(Binding::Exclusive);
            Some((format!("--numa-binding {mode}"), binding))
        }
        (None, true) => Some(("--pin".to_string(), Binding::Exclusive)),
        (None, false) => None,
    }
}

fn flags_of(cli: &Cli) -> Flags {
    let (gpu_ids, num_processes) = match &cli.gpu_ids {
        Some(GpuIds::List(ids)) => (Some(ids.clone()), cli.num_processes),
        // `all` is `auto` unless a count was given too.
        Some(GpuIds::All) => (None, cli.num_processes.or(Some(NumProcesses::Auto))),
        None => (None, cli.num_processes),
    };
    let range = cli.nnodes;
    Flags {
        nnodes: range.and_then(|r| r.fixed()),
        elastic_nnodes: range.filter(|r| r.fixed().is_none()),
        rdzv_endpoint: cli.rdzv_endpoint.clone(),
        rdzv_timeout: cli.rdzv_timeout,
        rdzv_conf: cli.rdzv_conf.clone().map(|c| c.0).unwrap_or_default(),
        node_rank: cli.node_rank,
        master_addr: cli.master_addr.clone(),
        master_port: cli.master_port,
        run_id: cli.run_id.clone(),
        run_id_file: cli.run_id_file.as_ref().map(|p| p.display().to_string()),
        num_processes,
        gpu_ids,
        max_restarts: cli.max_restarts,
        standalone: cli.standalone,
    }
}

/// What a plan knows of this node's GPUs, when it needed to look (`auto`, `--gpu-ids`, a dry
/// run): the ones it uses, the selection `--gpu-ids` made, and why none could be looked up.
#[derive(Debug, Default)]
struct FoundGpus {
    /// Those `--gpu-ids` selected, else every visible one; `None` when not looked up.
    gpus: Option<Vec<Gpu>>,
    selection: Option<GpuSelection>,
    /// Why NVML could not tell (then `gpus` is empty).
    error: Option<String>,
}

impl FoundGpus {
    /// Looks the visible GPUs up and applies `--gpu-ids` (its ids, when given as a list).
    fn look_up(ids: Option<&[u32]>) -> Result<FoundGpus, PlanError> {
        let (visible, error) = match gpu::visible_gpus() {
            Ok(gpus) => (gpus, None),
            Err(gpu::GpuError::TooMany(why)) => return Err(PlanError::Usage(why)),
            Err(gpu::GpuError::Unavailable(why)) => (Vec::new(), Some(why)),
        };
        let selection = match ids {
            Some(ids) => Some(select_gpus(ids, &visible, error.as_deref())?),
            None => None,
        };
        let gpus = match &selection {
            Some(sel) => sel.gpus.clone(),
            None => visible,
        };
        Ok(FoundGpus {
            gpus: Some(gpus),
            selection,
            error,
        })
    }

    /// Workers on this node for `--num-processes`: the count, the cores, or (`auto`) one per
    /// GPU found, else 1, each with a notice saying so.
    fn processes(
        &self,
        num_processes: NumProcesses,
        cli: &Cli,
        cores: usize,
        notices: &mut Vec<String>,
    ) -> Result<u32, PlanError> {
        Ok(match num_processes {
            NumProcesses::Count(n) => n,
            NumProcesses::Cpu => (cores as u32).min(crate::cli::MAX_PROCESSES),
            NumProcesses::Auto => {
                let n = self.gpus.as_ref().map_or(0, Vec::len) as u32;
                if n == 0 && matches!(cli.gpu_ids, Some(GpuIds::All)) {
                    return Err(no_gpu_visible("all", self.error.as_deref()));
                }
                if n == 0 {
                    if let Some(why) = &self.error {
                        notices.push(format!("no GPU found ({why})"));
                    }
                    notices.push("--num-processes auto: no visible GPU, starting 1 process".into());
                    1
                } else {
                    notices.push(format!(
                        "--num-processes auto: {n} visible GPU(s), starting {n} process(es)"
                    ));
                    n
                }
            }
        })
    }
}

/// The GPUs `--gpu-ids` chose, in local-rank order, and the workers' `CUDA_VISIBLE_DEVICES`.
#[derive(Debug)]
struct GpuSelection {
    gpus: Vec<Gpu>,
    cuda_visible_devices: String,
}

/// `--gpu-ids LISTED` on a node where no GPU is visible, and why when it is known.
fn no_gpu_visible(listed: &str, why_none: Option<&str>) -> PlanError {
    PlanError::Usage(format!(
        "--gpu-ids {listed}: no GPU is visible on this node ({})",
        why_none.unwrap_or("NVML found none, or CUDA_VISIBLE_DEVICES hides them all")
    ))
}

/// Checks every id against the visible GPUs. The ids index CUDA's visible devices (the
/// physical numbering when `CUDA_VISIBLE_DEVICES` is unset), so an inherited
/// `CUDA_VISIBLE_DEVICES` (e.g. Slurm's) is narrowed, never escaped.
fn select_gpus(
    ids: &[u32],
    visible: &[Gpu],
    why_none: Option<&str>,
) -> Result<GpuSelection, PlanError> {
    let listed = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    if visible.is_empty() {
        return Err(no_gpu_visible(&listed, why_none));
    }
    if let Some(missing) = ids.iter().find(|&&id| id as usize >= visible.len()) {
        let scope = if std::env::var_os("CUDA_VISIBLE_DEVICES").is_some() {
            " (indices into CUDA_VISIBLE_DEVICES)"
        } else {
            ""
        };
        return Err(PlanError::Usage(format!(
            "--gpu-ids {listed}: GPU {missing} does not exist; this node has {} visible GPU(s), 0..{}{scope}",
            visible.len(),
            visible.len() - 1
        )));
    }
    let inherited: Option<Vec<String>> = std::env::var("CUDA_VISIBLE_DEVICES")
        .ok()
        .map(|t| t.split(',').map(|e| e.trim().to_string()).collect());
    let entry = |id: u32| match &inherited {
        Some(entries) => entries
            .get(id as usize)
            .cloned()
            .unwrap_or_else(|| id.to_string()),
        None => visible[id as usize].nvml_index.to_string(),
    };
    Ok(GpuSelection {
        gpus: ids
            .iter()
            .enumerate()
            .map(|(local_rank, &id)| Gpu {
                cuda_index: local_rank,
                ..visible[id as usize].clone()
            })
            .collect(),
        cuda_visible_devices: ids
            .iter()
            .map(|&id| entry(id))
            .collect::<Vec<_>>()
            .join(","),
    })
}

fn resolve_ip(addr: &str) -> Result<IpAddr, PlanError> {
    if let Ok(ip) = addr.parse::<IpAddr>() {
        return Ok(ip);
    }
    (addr, 0)
        .to_socket_addrs()
        .ok()
        .and_then(|mut addrs| addrs.next())
        .map(|a| a.ip())
        .ok_or_else(|| PlanError::Usage(format!("--master-addr {addr:?} does not resolve")))
}

fn bound_port(listener: &TcpListener) -> Result<u16, PlanError> {
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|e| PlanError::Usage(format!("cannot read the chosen port: {e}")))
}

/// `--local-addr`, else 127.0.0.1 for a loopback rendezvous endpoint (or master address), else
/// this host's name.
fn local_addr(cli: &Cli, shape: &JobShape) -> String {
    if let Some(addr) = &cli.local_addr {
        return addr.clone();
    }
    let peer = match &shape.elastic {
        Some(e) => e.endpoint.value.0.clone(),
        None => shape.master_addr.value.clone(),
    };
    if is_loopback_name(&peer) {
        return "127.0.0.1".to_string();
    }
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "127.0.0.1".to_string())
}

pub(crate) fn is_loopback_name(addr: &str) -> bool {
    addr == "localhost" || addr.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The command as a shell would need it typed (for display only).
pub fn shell_words(words: &[OsString]) -> String {
    words
        .iter()
        .map(|w| {
            let w = w.to_string_lossy();
            if !w.is_empty()
                && w.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c))
            {
                w.into_owned()
            } else {
                format!("'{}'", w.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(args: &[&str]) -> Result<Plan, PlanError> {
        let args = std::iter::once("launch").chain(args.iter().copied());
        let cli = crate::cli::parse_from(args.map(OsString::from).collect()).expect("valid CLI");
        Plan::from_cli_and_env(&cli, &Default::default())
    }

    #[test]
    fn ranks_follow_node_rank() {
        let p = plan(&[
            "--run-id",
            "shared-secret",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--num-processes",
            "3",
            "--master-addr",
            "10.0.0.1",
            "--",
            "true",
        ])
        .unwrap();
        assert_eq!(p.world_size, 6);
        let env = p.worker_env(2, 0);
        assert_eq!((env.rank, env.local_rank, env.group_rank), (5, 2, 1));
        assert_eq!(p.run_id, "shared-secret");
        assert_eq!(p.secret_warning, None);
    }

    /// torchrun's static multi-node line, with no secret anywhere, runs as under torchrun (run
    /// id `none`) with a warning; asking for a secret (flag or variable) makes it an error.
    #[test]
    fn several_nodes_without_a_secret_run_with_a_warning_unless_one_is_required() {
        let args = [
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            "29611",
            "--nproc-per-node",
            "1",
            "--",
            "true",
        ];
        let p = plan(&args).unwrap();
        assert_eq!(p.run_id, "none");
        let warning = p.secret_warning.expect("a warning");
        assert!(warning.contains("127.0.0.1:29611"), "{warning}");
        let cli = crate::cli::parse_from(
            std::iter::once("launch")
                .chain(args)
                .map(OsString::from)
                .collect(),
        )
        .unwrap();
        let env = job_shape::Env::from([("LAUNCH_REQUIRE_SECRET".into(), "1".into())]);
        let e = Plan::from_cli_and_env(&cli, &env).unwrap_err().to_string();
        assert!(e.contains("LAUNCH_REQUIRE_SECRET"), "{e}");
    }

    #[test]
    fn usage_errors() {
        for (args, needle) in [
            (
                &["--nnodes", "2", "--node-rank", "2", "--", "true"][..],
                "out of range",
            ),
            (&["--set", "a.b=1", "--", "true"], "no CONFIG"),
            (&[][..], "nothing to run"),
            (&["c.toml", "--", "true"], "not both"),
            (&["--run-id", " ", "--", "true"], "must not be empty"),
            (
                &[
                    "--nnodes",
                    "2",
                    "--node-rank",
                    "0",
                    "--master-addr",
                    "10.0.0.1",
                    "--require-secret",
                    "--",
                    "true",
                ],
                "this run's traffic is unauthenticated",
            ),
            (
                &["--nnodes", "2", "--master-port", "0", "--", "true"],
                "same fixed port",
            ),
            (
                &["--num-processes", "4", "--gpu-ids", "0,1", "--", "true"],
                "does not match --gpu-ids 0,1",
            ),
        ] {
            let err = plan(args).unwrap_err().to_string();
            assert!(err.contains(needle), "{args:?}: {err}");
        }
    }

    /// A port the user named that is taken is refused, naming who holds it, never swapped for
    /// another; a single node's default is a free port, held for our worker only.
    #[test]
    fn a_taken_port_is_refused_naming_its_holder() {
        let holder = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = holder.local_addr().unwrap().port().to_string();
        let mut p = plan(&["--master-port", &port, "--", "true"]).unwrap();
        let err = p.resolve_port().unwrap_err().to_string();
        let by = format!(
            "(flag --master-port) on 127.0.0.1 is in use by pid {} (",
            std::process::id()
        );
        assert!(
            err.contains(&by) && err.contains("leave --master-port out"),
            "{err}"
        );
        let mut p = plan(&["--", "true"]).unwrap();
        assert_eq!(p.master_port, 0);
        p.resolve_port().unwrap();
        assert_ne!(p.master_port, 0);
        assert!(
            p.store_listener.is_none(),
            "a program of the user's binds the port itself"
        );
        // Multi-node, node 0: the others expect that port, so it is an error.
        let mut p = plan(&[
            "--master-port",
            &port,
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--run-id",
            "s",
            "--",
            "true",
        ])
        .unwrap();
        assert!(p.resolve_port().unwrap_err().to_string().contains("in use"));
    }

    #[test]
    fn shell_words_quotes_what_needs_it() {
        let words: Vec<OsString> = vec!["python".into(), "a b.py".into(), "it's".into()];
        assert_eq!(shell_words(&words), r"python 'a b.py' 'it'\''s'");
    }
}
