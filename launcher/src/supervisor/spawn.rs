//! Starting the workers: each one's command and environment (own process group, bound to die
//! with the launcher, SIGUSR1 ignored until our worker's handler is in), then, once all of the
//! group run, their output forwarded line by line (and to `--log-dir` files) and their exits
//! reported as [`Event`]s, by one thread for the whole group.

use std::fs::File;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crossbeam_channel::Sender;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tracing::warn;

use super::Event;
use crate::child::{Child, Command};
use crate::console::Muting;
use crate::output::{self, Sinks, Stream, Tail};
use crate::plan::Plan;
use crate::progress::{Display, Follow};
use common::env_contract::WorkerEnv;

/// A worker that runs, not followed yet ([`follow_group`]).
pub(super) struct Running {
    child: Child,
    follow: Option<Follow>,
}

impl Running {
    pub(super) fn pid(&self) -> i32 {
        self.child.pid
    }
}

/// Starts the worker of `env`; returns once it has exec'd. Its output waits in its pipes until
/// [`follow_group`], so that all the group's workers start before any of its threads.
pub(super) fn start_worker(
    plan: &Plan,
    env: &WorkerEnv,
    display: Option<&Arc<Display>>,
    cgroup: Option<&crate::cgroup::JobCgroup>,
) -> std::io::Result<Running> {
    let mut command = worker_command(plan, env)?;
    let follow = display
        .map(|d| d.connect(&mut command, env.rank))
        .transpose()?;
    // After the progress pipe's descriptor is in place (a pipe end that happens to be number 4
    // has then been copied to 3 already).
    pass_store_listener(&mut command, plan, env);
    pin_to_cpus(&mut command, plan, env.local_rank);
    if let Some(cgroup) = cgroup {
        command.join_cgroup(cgroup.procs());
    }
    let child = command.spawn()?;
    Ok(Running { child, follow })
}

/// A followed worker: its ranks and pid, the stderr lines kept for the failure summary, and
/// whether its output is shown.
pub(super) struct Followed {
    pub(super) rank: u32,
    pub(super) local_rank: u32,
    pub(super) pid: i32,
    pub(super) tail: Tail,
    pub(super) muting: Muting,
}

/// Follows the group's running workers: one thread forwards all their output and reports each
/// exit (its pidfd polled beside the pipes), and each worker's progress reports, if a display is up,
/// are read on a thread of their own. If a thread cannot start, every worker is killed and
/// reaped (nobody would read or wait for them), and the error says why.
pub(super) fn follow_group(
    running: Vec<(WorkerEnv, Running)>,
    plan: &Plan,
    sinks: &Arc<Sinks>,
    tx: &Sender<Event>,
    round: u32,
) -> std::io::Result<Vec<Followed>> {
    let mut followed = Vec::with_capacity(running.len());
    let mut sources = Vec::with_capacity(2 * running.len());
    let mut waited = Vec::with_capacity(running.len());
    let mut progress = Vec::new();
    for (env, Running { child, follow }) in running {
        let worker = Followed {
            rank: env.rank,
            local_rank: env.local_rank,
            pid: child.pid,
            tail: Default::default(),
            muting: Muting::new(plan.console.shows(env.local_rank)),
        };
        sources.extend(output_sources(
            child.stdout,
            child.stderr,
            &worker,
            plan,
            &env,
            sinks,
            tx,
            round,
        ));
        waited.push((child.pid, env.local_rank));
        progress.extend(follow);
        followed.push(worker);
    }
    let pids: Vec<i32> = waited.iter().map(|&(pid, _)| pid).collect();
    let started = progress
        .into_iter()
        .try_for_each(Follow::start)
        .and_then(|()| exit_watches(waited, tx, round))
        .and_then(|watches| output::forward(sources, watches));
    if let Err(e) = started {
        for &pid in &pids {
            let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
            let _ = crate::child::wait(pid);
        }
        return Err(e);
    }
    Ok(followed)
}

/// The worker's two output streams, each with its route and what to say when it closes.
#[allow(clippy::too_many_arguments)]
fn output_sources(
    stdout: File,
    stderr: File,
    worker: &Followed,
    plan: &Plan,
    env: &WorkerEnv,
    sinks: &Arc<Sinks>,
    tx: &Sender<Event>,
    round: u32,
) -> [output::Source; 2] {
    let rank_log = rank_log(plan, env.rank);
    [(stdout, Stream::Stdout), (stderr, Stream::Stderr)].map(|(pipe, stream)| {
        let (tx, closing) = (tx.clone(), worker.muting.clone());
        let logs = rank_log
            .iter()
            .cloned()
            .chain(stream_log(plan, env, stream));
        output::Source {
            pipe,
            route: output::Route {
                stream,
                rank: env.rank,
                console: (plan.console.route(env.local_rank, stream, &worker.muting))
                    .map(|m| (sinks.clone(), m)),
                logs: logs.collect(),
                tail: (stream == Stream::Stderr).then(|| worker.tail.clone()),
            },
            done: Box::new(move || {
                closing.stream_closed();
                let _ = tx.send(Event::OutputClosed { round });
            }),
        }
    })
}

/// The worker's command: the plan's program with the rank's environment, its output piped, in
/// its own process group, and bound to die with the launcher.
fn worker_command(plan: &Plan, env: &WorkerEnv) -> std::io::Result<Command> {
    let mut command = Command::new(&plan.command[0], &plan.command[1..])?;
    command
        // Our workers rendezvous through our store: a torchrun setting inherited from where
        // `launch` runs (inside a torchrun job) must not send them to torchrun's.
        .env("TORCHELASTIC_USE_AGENT_STORE", "False")
        .envs(env.to_vars())
        .envs(plan.extra_env())
        .envs(plan.accelerate_env.iter().map(|(k, v)| (k, v)));
    if let Some(layout) = &plan.layout {
        let file = layout.error_file(env.restart_count, env.local_rank);
        command.env("TORCHELASTIC_ERROR_FILE", file);
    }
    if let (Some(layout), Some(_)) = (&plan.layout, &plan.config) {
        let marker = layout.preempt_marker();
        command.env(common::env_contract::PREEMPT_FILE_VAR, marker);
    }
    if let Some(role) = &plan.role {
        command.env("ROLE_NAME", role);
    }
    if plan.virtual_local_rank {
        command.env("LOCAL_RANK", "0");
        if let Some(gpu) = plan.visible_device(env.local_rank) {
            command.env("CUDA_VISIBLE_DEVICES", gpu);
        }
    }
    // Our worker takes SIGUSR1 as "stop at your next checkpoint" (elastic re-forming); until
    // its handler is installed the signal must not kill it (the supervisor repeats the
    // request).
    if plan.config.is_some() {
        command.ignore_usr1();
    }
    Ok(command)
}

/// Rank 0 of our worker gets the rendezvous port's listening socket as descriptor
/// [`STORE_FD`](common::env_contract::STORE_FD), named in its environment; nobody else gets
/// the variable, whatever the launcher's own environment says. Every rank of this node learns
/// that the listener is held for rank 0 ([`STORE_HELD_VAR`](common::env_contract::STORE_HELD_VAR)),
/// so that a slow rank 0 is waited for.
fn pass_store_listener(command: &mut Command, plan: &Plan, env: &WorkerEnv) {
    use common::env_contract::{STORE_FD, STORE_FD_VAR, STORE_HELD_VAR};
    use std::os::fd::AsRawFd;
    command.env_remove(STORE_FD_VAR);
    command.env_remove(STORE_HELD_VAR);
    let Some(listener) = plan.store_listener.as_ref() else {
        return;
    };
    if let Ok(addr) = listener.local_addr() {
        command.env(STORE_HELD_VAR, addr.to_string());
    }
    if env.rank != 0 {
        return;
    }
    command.env(STORE_FD_VAR, STORE_FD.to_string());
    command.hand_down(listener.as_raw_fd(), STORE_FD);
}

/// Pins the worker to its CPUs of the plan's map, when the user asked for one (from before it
/// execs, so its threads all start there), with `OMP_NUM_THREADS` set to their number unless the
/// user set it or the sets are shared.
fn pin_to_cpus(command: &mut Command, plan: &Plan, local_rank: u32) {
    let Some(map) = plan.cpu_map.as_ref() else {
        return;
    };
    let Some(cpus) = map.sets.get(local_rank as usize) else {
        return;
    };
    // Shared sets (binding by node) keep the cores / processes default.
    if plan.omp_threads.is_some() && map.exclusive {
        command.env("OMP_NUM_THREADS", cpus.len().to_string());
    }
    let mut set = nix::sched::CpuSet::new();
    for &cpu in cpus {
        // CPU ids come from the kernel's own set, of this size: never out of range.
        let _ = set.set(cpu);
    }
    command.pin(set);
}

/// `--rank-logs`'s file for `rank` (a warning, and no file, when it cannot be opened).
fn rank_log(plan: &Plan, rank: u32) -> Option<Arc<Mutex<std::fs::File>>> {
    let dir = plan.rank_logs.as_ref()?;
    match output::open_log(dir, rank) {
        Ok(log) => Some(log),
        Err(e) => {
            warn!("cannot write {}/rank-{rank}.log: {e}", dir.display());
            None
        }
    }
}

/// The file of torchrun's layout that `stream` of this worker goes to, when streams are
/// written (a warning, and no file, when it cannot be made).
fn stream_log(plan: &Plan, env: &WorkerEnv, stream: Stream) -> Option<Arc<Mutex<std::fs::File>>> {
    let layout = plan.layout.as_ref()?;
    let path = layout.stream_file(env.restart_count, env.local_rank, stream)?;
    match std::fs::File::create(&path) {
        Ok(file) => Some(Arc::new(Mutex::new(file))),
        Err(e) => {
            warn!("cannot write {}: {e}", path.display());
            None
        }
    }
}

/// What tells of each of `workers` (pid, local rank) ending, on the output thread: its pidfd,
/// whose readiness reports the exit as an event. Where the kernel has no pidfds (before Linux
/// 5.3), a thread per worker waits for it instead, and there is nothing to watch.
fn exit_watches(
    workers: Vec<(i32, u32)>,
    tx: &Sender<Event>,
    round: u32,
) -> std::io::Result<Vec<output::Watch>> {
    let pidfds: std::io::Result<Vec<OwnedFd>> =
        workers.iter().map(|&(pid, _)| pidfd(pid)).collect();
    let Ok(pidfds) = pidfds else {
        for (pid, local_rank) in workers {
            let tx = tx.clone();
            std::thread::Builder::new()
                .name(format!("wait-{pid}"))
                .spawn(move || report_exit(pid, local_rank, &tx, round))?;
        }
        return Ok(Vec::new());
    };
    let watches = workers
        .into_iter()
        .zip(pidfds)
        .map(|((pid, local_rank), fd)| {
            let tx = tx.clone();
            output::Watch {
                fd,
                ready: Box::new(move || report_exit_now(pid, local_rank, tx, round)),
            }
        });
    Ok(watches.collect())
}

/// A pidfd for child `pid`: readable once it has ended.
fn pidfd(pid: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open with no flags returns a new descriptor, which the result then owns.
    unsafe {
        match libc::syscall(libc::SYS_pidfd_open, pid, 0) {
            -1 => Err(std::io::Error::last_os_error()),
            fd => Ok(OwnedFd::from_raw_fd(fd as RawFd)),
        }
    }
}

/// Reports worker `pid`'s exit, which its pidfd says happened, without waiting: one that
/// cannot be reaped yet (a debugger still holds it) is waited for on a thread of its own.
fn report_exit_now(pid: i32, local_rank: u32, tx: Sender<Event>, round: u32) {
    match crate::child::try_wait(pid) {
        Ok(Some(status)) => send_exit(local_rank, status, &tx, round),
        Ok(None) => {
            let thread_tx = tx.clone();
            let waiting = std::thread::Builder::new()
                .name(format!("wait-{pid}"))
                .spawn(move || report_exit(pid, local_rank, &thread_tx, round));
            if waiting.is_err() {
                // No thread to wait on: wait here (the output pauses meanwhile).
                report_exit(pid, local_rank, &tx, round);
            }
        }
        // Cannot happen for our own child: report it as a kill rather than lose it.
        Err(_) => send_exit(local_rank, ExitStatus::from_raw(9), &tx, round),
    }
}

/// Waits for worker `pid` (it has ended, or will) and sends its exit as an event.
fn report_exit(pid: i32, local_rank: u32, tx: &Sender<Event>, round: u32) {
    // Cannot fail for our own child; report it as a kill rather than hang.
    let status = crate::child::wait(pid).unwrap_or(ExitStatus::from_raw(9));
    send_exit(local_rank, status, tx, round);
}

fn send_exit(local_rank: u32, status: ExitStatus, tx: &Sender<Event>, round: u32) {
    let _ = tx.send(Event::Exited {
        round,
        local_rank,
        status,
        at: Instant::now(),
    });
}
