//! The supervisor: starts the worker group the plan describes, keeps watching it, notices the
//! first failure or a signal to the launcher, tears the whole group down (SIGTERM, grace period,
//! SIGKILL, process groups so workers' children go too) and restarts it within the budget.
//! It owns processes and their lifetimes; what to start is the plan's, what to print the report's.

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tracing::{info, warn};

use crate::output::{self, Sinks, Stream, Tail};
use crate::plan::{shell_words, Plan};
use crate::report::{self, Ending, WorkerRecord};
use crate::watchdog::Watchdog;

/// How long to wait for workers' output to drain after they exit (their children may hold the
/// pipes; those are killed, so this is only a safety net).
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);
/// After SIGKILL, how long to wait for the kernel to remove what was killed.
const KILL_SETTLE: Duration = Duration::from_secs(2);

/// What the supervisor reacts to.
#[derive(Debug)]
pub enum Event {
    /// A signal delivered to the launcher.
    Signal(i32),
    /// Worker `local_rank` of group run `round` exited.
    Exited {
        round: u32,
        local_rank: u32,
        status: ExitStatus,
        at: Instant,
    },
    /// One of the output streams of group run `round` reached end of file.
    OutputClosed { round: u32 },
}

/// How a group run ended.
enum GroupEnd {
    Success,
    /// A worker failed; the group was torn down. `root` indexes `records`.
    Failed {
        records: Vec<WorkerRecord>,
        root: usize,
    },
    /// The launcher was signalled; the group was torn down.
    Interrupted {
        signal: i32,
    },
    /// A worker could not be started.
    SpawnFailed {
        code: i32,
    },
}

/// Runs the plan to completion; returns the launcher's exit code.
pub fn run(plan: &Plan, mut watchdog: Watchdog, events: (Sender<Event>, Receiver<Event>)) -> i32 {
    let sinks = Sinks::new(plan.world_size);
    let mut restart = 0;
    loop {
        if restart > 0 {
            info!(
                "restarting the worker group (restart {restart} of {}, TORCHELASTIC_RESTART_COUNT={restart})",
                plan.max_restarts
            );
        }
        let end = run_group(plan, restart, &sinks, &mut watchdog, &events);
        match end {
            GroupEnd::Success => {
                watchdog.disarm();
                return 0;
            }
            GroupEnd::Interrupted { signal } => {
                watchdog.disarm();
                warn!(
                    "stopped by {}: every worker was terminated; exit code {}",
                    report::signal_name(signal),
                    128 + signal
                );
                return 128 + signal;
            }
            GroupEnd::SpawnFailed { code } => {
                watchdog.disarm();
                return code;
            }
            GroupEnd::Failed { records, root } => {
                let r = &records[root];
                if restart < plan.max_restarts {
                    warn!(
                        "rank {} failed ({}); the group was torn down",
                        r.rank, r.ending
                    );
                    restart += 1;
                    continue;
                }
                eprintln!("{}", report::failure_summary(&records, root, restart + 1));
                watchdog.disarm();
                let code = r.ending.exit_code();
                // A worker that "failed" with code 0 cannot be the root cause, but be safe.
                return if code == 0 { 1 } else { code };
            }
        }
    }
}

struct Worker {
    rank: u32,
    local_rank: u32,
    pid: i32,
    ending: Option<(Ending, Instant)>,
    sent: Option<Signal>,
    tail: Tail,
}

fn run_group(
    plan: &Plan,
    round: u32,
    sinks: &Arc<Sinks>,
    watchdog: &mut Watchdog,
    (tx, rx): &(Sender<Event>, Receiver<Event>),
) -> GroupEnd {
    let started = Instant::now();
    let mut workers: Vec<Worker> = Vec::with_capacity(plan.nproc as usize);
    let mut readers: Vec<JoinHandle<()>> = Vec::new();
    for local_rank in 0..plan.nproc {
        let env = plan.worker_env(local_rank, round);
        match spawn_worker(plan, &env, sinks, tx, round, &mut readers) {
            Ok((pid, tail)) => {
                watchdog.watch(pid);
                workers.push(Worker {
                    rank: env.rank,
                    local_rank,
                    pid,
                    ending: None,
                    sent: None,
                    tail,
                });
            }
            Err(e) => {
                let code = match e.kind() {
                    std::io::ErrorKind::NotFound => 127,
                    std::io::ErrorKind::PermissionDenied => 126,
                    _ => 1,
                };
                eprintln!(
                    "launch: error: cannot start rank {} ({}): {e}",
                    env.rank,
                    shell_words(&plan.command)
                );
                signal_all(&mut workers, Signal::SIGKILL);
                wait_for_exits(&mut workers, rx, round, Instant::now() + KILL_SETTLE);
                finish_groups(&workers, watchdog, Duration::ZERO);
                return GroupEnd::SpawnFailed { code };
            }
        }
    }

    let mut root: Option<usize> = None;
    let mut interrupted: Option<i32> = None;
    let mut kill_at: Option<Instant> = None;
    let mut open_streams = 2 * workers.len();
    while workers.iter().any(|w| w.ending.is_none()) {
        let event = match kill_at {
            Some(deadline) => match rx.recv_deadline(deadline) {
                Ok(event) => event,
                Err(RecvTimeoutError::Timeout) => {
                    let left = workers.iter().filter(|w| w.ending.is_none()).count();
                    warn!(
                        "{left} worker(s) still running {:.1} s after SIGTERM: sending SIGKILL",
                        plan.grace_period.as_secs_f64()
                    );
                    signal_all(&mut workers, Signal::SIGKILL);
                    kill_at = None;
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => break,
            },
            None => match rx.recv() {
                Ok(event) => event,
                Err(_) => break,
            },
        };
        match event {
            Event::Exited {
                round: r,
                local_rank,
                status,
                at,
            } if r == round => {
                let index = local_rank as usize;
                let ending = ending_of(status);
                workers[index].ending = Some((ending, at));
                if !ending.is_success() && root.is_none() && interrupted.is_none() {
                    root = Some(index);
                    let w = &workers[index];
                    warn!(
                        "rank {} (pid {}) failed: {ending}; stopping the other workers (SIGTERM, SIGKILL after {:.1} s)",
                        w.rank,
                        w.pid,
                        plan.grace_period.as_secs_f64()
                    );
                    signal_all(&mut workers, Signal::SIGTERM);
                    kill_at = Some(Instant::now() + plan.grace_period);
                }
            }
            Event::Signal(sig) => {
                let Ok(signal) = Signal::try_from(sig) else {
                    continue;
                };
                if interrupted.is_none() && root.is_none() {
                    interrupted = Some(sig);
                    warn!(
                        "received {}: forwarding it to every worker (SIGKILL after {:.1} s; {} again to kill now)",
                        signal.as_str(),
                        plan.grace_period.as_secs_f64(),
                        signal.as_str()
                    );
                    signal_all(&mut workers, signal);
                    kill_at = Some(Instant::now() + plan.grace_period);
                } else {
                    interrupted.get_or_insert(sig);
                    warn!(
                        "received {} again: killing every worker now",
                        signal.as_str()
                    );
                    signal_all(&mut workers, Signal::SIGKILL);
                    kill_at = None;
                }
            }
            Event::OutputClosed { round: r } if r == round => {
                open_streams = open_streams.saturating_sub(1);
            }
            _ => {} // stale event of an earlier round
        }
    }

    // Leaders are gone; make sure their children are too, then let the output drain.
    let grace = if root.is_some() || interrupted.is_some() {
        kill_at.map_or(Duration::ZERO, |d| {
            d.saturating_duration_since(Instant::now())
        })
    } else {
        plan.grace_period
    };
    finish_groups(&workers, watchdog, grace);
    let drain_until = Instant::now() + DRAIN_TIMEOUT;
    while open_streams > 0 {
        match rx.recv_deadline(drain_until) {
            Ok(Event::OutputClosed { round: r }) if r == round => open_streams -= 1,
            Ok(Event::Signal(_)) | Ok(_) => {}
            Err(_) => break,
        }
    }
    for reader in readers {
        if reader.is_finished() {
            let _ = reader.join();
        }
    }

    if let Some(signal) = interrupted {
        return GroupEnd::Interrupted { signal };
    }
    match root {
        None => GroupEnd::Success,
        Some(root) => GroupEnd::Failed {
            records: workers
                .iter()
                .map(|w| {
                    let (ending, at) = w.ending.unwrap_or((Ending::Signal(9), Instant::now()));
                    WorkerRecord {
                        rank: w.rank,
                        local_rank: w.local_rank,
                        pid: w.pid,
                        ending,
                        after: at.saturating_duration_since(started),
                        sent_by_launcher: w.sent,
                        stderr_tail: w
                            .tail
                            .lock()
                            .map(|t| t.iter().cloned().collect())
                            .unwrap_or_default(),
                    }
                })
                .collect(),
            root,
        },
    }
}

fn spawn_worker(
    plan: &Plan,
    env: &common::env_contract::WorkerEnv,
    sinks: &Arc<Sinks>,
    tx: &Sender<Event>,
    round: u32,
    readers: &mut Vec<JoinHandle<()>>,
) -> std::io::Result<(i32, Tail)> {
    let mut command = Command::new(&plan.command[0]);
    command
        .args(&plan.command[1..])
        .envs(env.to_vars())
        .envs(plan.extra_env())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Own process group: teardown reaches the worker's children, and the terminal's Ctrl-C
        // reaches only the launcher, which forwards it.
        .process_group(0);
    let launcher = std::process::id() as i32;
    // SAFETY: only async-signal-safe calls (prctl, getppid) between fork and exec.
    unsafe {
        command.pre_exec(move || {
            // Die with the launcher, even if it is SIGKILLed (the spawning thread is the main
            // thread, which lives as long as the launcher).
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != launcher {
                return Err(std::io::Error::other(
                    "launch exited while starting workers",
                ));
            }
            Ok(())
        });
    }
    let mut child: Child = command.spawn()?;
    let pid = child.id() as i32;
    let log = match &plan.log_dir {
        Some(dir) => match output::open_log(dir, env.rank) {
            Ok(log) => Some(log),
            Err(e) => {
                warn!("cannot write {}/rank-{}.log: {e}", dir.display(), env.rank);
                None
            }
        },
        None => None,
    };
    let tail: Tail = Default::default();
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
        let Some(source) = source else { continue };
        let tx = tx.clone();
        let reader = output::forward(
            NotifyOnEof {
                inner: source,
                tx: Some(tx),
                round,
            },
            stream,
            env.rank,
            sinks.clone(),
            log.clone(),
            (stream == Stream::Stderr).then(|| tail.clone()),
        )?;
        readers.push(reader);
    }
    let tx = tx.clone();
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
    Ok((pid, tail))
}

/// A reader that reports its end of file to the supervisor (so it knows output has drained).
struct NotifyOnEof {
    inner: Box<dyn std::io::Read + Send>,
    tx: Option<Sender<Event>>,
    round: u32,
}

impl std::io::Read for NotifyOnEof {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let result = self.inner.read(buf);
        if matches!(result, Ok(0) | Err(_)) {
            if let Some(tx) = self.tx.take() {
                let _ = tx.send(Event::OutputClosed { round: self.round });
            }
        }
        result
    }
}

impl Drop for NotifyOnEof {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(Event::OutputClosed { round: self.round });
        }
    }
}

fn ending_of(status: ExitStatus) -> Ending {
    match (status.code(), status.signal()) {
        (Some(code), _) => Ending::Code(code),
        (None, Some(sig)) => Ending::Signal(sig),
        (None, None) => Ending::Code(1),
    }
}

/// Sends `signal` to the process group of every worker still running.
fn signal_all(workers: &mut [Worker], signal: Signal) {
    for w in workers.iter_mut().filter(|w| w.ending.is_none()) {
        if killpg(Pid::from_raw(w.pid), signal).is_ok() {
            w.sent = Some(signal);
        }
    }
}

/// Waits (until `deadline`) for exit events; used when aborting a half-started group.
fn wait_for_exits(workers: &mut [Worker], rx: &Receiver<Event>, round: u32, deadline: Instant) {
    while workers.iter().any(|w| w.ending.is_none()) {
        match rx.recv_deadline(deadline) {
            Ok(Event::Exited {
                round: r,
                local_rank,
                status,
                at,
            }) if r == round => {
                if let Some(w) = workers.iter_mut().find(|w| w.local_rank == local_rank) {
                    w.ending = Some((ending_of(status), at));
                }
            }
            Ok(_) => {}
            Err(_) => return,
        }
    }
}

/// After the leaders exited: anything left in their process groups (children of workers) gets
/// SIGTERM, then SIGKILL once `grace` has passed. Then the watchdog forgets the groups.
fn finish_groups(workers: &[Worker], watchdog: &mut Watchdog, grace: Duration) {
    let groups: Vec<Pid> = workers.iter().map(|w| Pid::from_raw(w.pid)).collect();
    let alive = |groups: &[Pid]| -> Vec<Pid> {
        groups
            .iter()
            .copied()
            .filter(|pg| killpg(*pg, None).is_ok())
            .collect()
    };
    reap_adopted();
    let mut left = alive(&groups);
    if !left.is_empty() {
        for pg in &left {
            let _ = killpg(*pg, Signal::SIGTERM);
        }
        let kill_at = Instant::now() + grace;
        while !left.is_empty() && Instant::now() < kill_at {
            std::thread::sleep(Duration::from_millis(5));
            reap_adopted();
            left = alive(&left);
        }
        for pg in &left {
            let _ = killpg(*pg, Signal::SIGKILL);
        }
        let settle = Instant::now() + KILL_SETTLE;
        while !left.is_empty() && Instant::now() < settle {
            std::thread::sleep(Duration::from_millis(5));
            reap_adopted();
            left = alive(&left);
        }
        if !left.is_empty() {
            warn!("process group(s) {left:?} still exist after SIGKILL (zombies not yet reaped?)");
        }
    }
    for pg in groups {
        watchdog.forget(pg.as_raw());
    }
}

/// Reaps orphaned descendants that were re-parented to the launcher (it is a child subreaper),
/// so that dead workers' children do not linger as zombies. Only called once every worker of the
/// group has been waited for, so it cannot take a worker's exit status from its wait thread.
fn reap_adopted() {
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    loop {
        match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(_) => return,
            Ok(_) => continue,
        }
    }
}
