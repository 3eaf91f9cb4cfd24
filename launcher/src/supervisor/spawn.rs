//! Starting one worker: its command and environment (own process group, bound to die with the
//! launcher, SIGUSR1 ignored until our worker's handler is in), its output forwarded line by
//! line, its `--log-dir` file, and a thread that reports its exit as an [`Event`].

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crossbeam_channel::Sender;
use tracing::warn;

use super::Event;
use crate::console::Muting;
use crate::output::{self, Sinks, Stream, Tail};
use crate::plan::Plan;
use crate::progress::Display;
use crate::watchdog::Watchdog;

pub(super) fn spawn_worker(
    plan: &Plan,
    env: &common::env_contract::WorkerEnv,
    sinks: &Arc<Sinks>,
    display: Option<&Arc<Display>>,
    tx: &Sender<Event>,
    round: u32,
    watchdog: &mut Watchdog,
) -> std::io::Result<Spawned> {
    let mut command = worker_command(plan, env);
    let follow = display
        .map(|d| d.connect(&mut command, env.rank))
        .transpose()?;
    // After the progress pipe's descriptor is in place (a pipe end that happens to be number 4
    // has then been copied to 3 already).
    pass_store_listener(&mut command, plan, env);
    pin_to_cpus(&mut command, plan, env.local_rank);
    let mut child = command.spawn()?;
    if let Some(follow) = follow {
        follow.start()?;
    }
    let pid = child.id() as i32;
    watchdog.watch(pid);
    let log = rank_log(plan, env.rank);
    let tail: Tail = Default::default();
    let muting = Muting::new(plan.console.shows(env.local_rank));
    let streams: [(Option<Box<dyn std::io::Read + Send>>, Stream); 2] = [
        (
            child.stdout.take().map(|s| Box::new(s) as _),
            Stream::Stdout,
        ),
        (
            child.stderr.take().map(|s| Box::new(s) as _),
            Stream::Stderr,
        ),
    ];
    for (source, stream) in streams {
        let (tx, closing) = (tx.clone(), muting.clone());
        let done = move || {
            closing.stream_closed();
            let _ = tx.send(Event::OutputClosed { round });
        };
        match source {
            Some(source) => {
                let route = output::Route {
                    stream,
                    rank: env.rank,
                    console: (plan.console.route(env.local_rank, stream, &muting))
                        .map(|m| (sinks.clone(), m)),
                    log: log.clone(),
                    tail: (stream == Stream::Stderr).then(|| tail.clone()),
                };
                output::forward(source, route, done)?;
            }
            None => done(),
        }
    }
    report_exit(child, tx.clone(), round, env)?;
    Ok(Spawned { pid, tail, muting })
}

/// A started worker: its pid, the stderr lines kept for the failure summary, and whether its
/// output is shown.
pub(super) struct Spawned {
    pub(super) pid: i32,
    pub(super) tail: Tail,
    pub(super) muting: Muting,
}

/// The worker's command: the plan's program with the rank's environment, its output piped, in
/// its own process group, and bound to die with the launcher.
fn worker_command(plan: &Plan, env: &common::env_contract::WorkerEnv) -> Command {
    let mut command = Command::new(&plan.command[0]);
    command
        .args(&plan.command[1..])
        // Our workers rendezvous through our store: a torchrun setting inherited from where
        // `launch` runs (inside a torchrun job) must not send them to torchrun's.
        .env_remove("TORCHELASTIC_USE_AGENT_STORE")
        .envs(env.to_vars())
        .envs(plan.extra_env())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Own process group: teardown reaches the worker's children, and the terminal's Ctrl-C
        // reaches only the launcher, which forwards it.
        .process_group(0);
    let launcher = std::process::id() as i32;
    // Our worker takes SIGUSR1 as "stop at your next checkpoint" (elastic re-forming); until
    // its handler is installed the signal must not kill it (an ignored disposition survives
    // exec, and the supervisor repeats the request).
    let ignore_usr1 = plan.config.is_some();
    // SAFETY: only async-signal-safe calls (prctl, getppid, signal), no allocation, between fork
    // and exec.
    unsafe {
        command.pre_exec(move || {
            if ignore_usr1 {
                libc::signal(libc::SIGUSR1, libc::SIG_IGN);
            }
            // Die with the launcher, even if it is SIGKILLed (the spawning thread is the main
            // thread, which lives as long as the launcher).
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != launcher {
                // The launcher died before prctl took effect.
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
    command
}

/// Rank 0 of our worker gets the rendezvous port's listening socket as descriptor
/// [`STORE_FD`](common::env_contract::STORE_FD), named in its environment; nobody else gets
/// the variable, whatever the launcher's own environment says.
fn pass_store_listener(command: &mut Command, plan: &Plan, env: &common::env_contract::WorkerEnv) {
    use common::env_contract::{STORE_FD, STORE_FD_VAR};
    use std::os::fd::AsRawFd;
    command.env_remove(STORE_FD_VAR);
    let Some(listener) = plan.store_listener.as_ref().filter(|_| env.rank == 0) else {
        return;
    };
    command.env(STORE_FD_VAR, STORE_FD.to_string());
    crate::hand_down::hand_down(command, listener.as_raw_fd(), STORE_FD);
}

/// Pins the worker to its CPUs of the plan's map (from before it execs, so its threads all
/// start there), with `OMP_NUM_THREADS` set to their number unless the user set it.
fn pin_to_cpus(command: &mut Command, plan: &Plan, local_rank: u32) {
    let Some(cpus) = plan
        .cpu_map
        .as_ref()
        .and_then(|m| m.sets.get(local_rank as usize))
    else {
        return;
    };
    if plan.omp_threads.is_some() {
        command.env("OMP_NUM_THREADS", cpus.len().to_string());
    }
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET stays within it (CPU ids come
    // from the kernel's own set of the same size).
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus {
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: only sched_setaffinity, a system call, between fork and exec.
    unsafe {
        command.pre_exec(move || {
            let size = std::mem::size_of::<libc::cpu_set_t>();
            if libc::sched_setaffinity(0, size, &set) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// `--log-dir`'s file for `rank` (a warning, and no file, when it cannot be opened).
fn rank_log(plan: &Plan, rank: u32) -> Option<Arc<Mutex<std::fs::File>>> {
    let dir = plan.log_dir.as_ref()?;
    match output::open_log(dir, rank) {
        Ok(log) => Some(log),
        Err(e) => {
            warn!("cannot write {}/rank-{rank}.log: {e}", dir.display());
            None
        }
    }
}

/// Waits for the worker on its own thread and sends its exit as an event.
fn report_exit(
    mut child: std::process::Child,
    tx: Sender<Event>,
    round: u32,
    env: &common::env_contract::WorkerEnv,
) -> std::io::Result<()> {
    let local_rank = env.local_rank;
    std::thread::Builder::new()
        .name(format!("wait-rank{}", env.rank))
        .spawn(move || {
            let status = loop {
                match child.wait() {
                    Ok(status) => break status,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    // Cannot happen for our own child; report it as a kill rather than hang.
                    Err(_) => break ExitStatus::from_raw(9),
                }
            };
            let _ = tx.send(Event::Exited {
                round,
                local_rank,
                status,
                at: Instant::now(),
            });
        })?;
    Ok(())
}
