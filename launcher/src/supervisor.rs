//! The supervisor: starts the worker group the plan describes, keeps watching it, notices the
//! first failure or a signal to the launcher, tears the whole group down (SIGTERM, grace period,
//! SIGKILL, process groups so workers' children go too) and restarts it within the budget.
//! It owns processes and their lifetimes; what to start is the plan's, what to print the report's.

use std::io::Write as _;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::env_contract::WorkerEnv;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tracing::{info, warn};

use crate::console::Muting;
use crate::output::{Sinks, Tail};
use crate::plan::{shell_words, Plan};
use crate::progress::Display;
pub use crate::report::WorkerRecord;
use crate::report::{self, Ending};
use crate::watchdog::Watchdog;

mod spawn;
use spawn::{follow_group, start_worker, Running};

/// How long a failed worker's output may take to be read to its end before `launch` says it
/// failed (so that its own last lines come first).
const DRAIN_FAILED: Duration = Duration::from_millis(500);
/// How long to wait for workers' output to drain after they exit (their children may hold the
/// pipes; those are killed, so this is only a safety net).
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);
/// After SIGKILL, how long to wait for the kernel to remove what was killed before giving up on
/// a process stuck in the kernel (uninterruptible sleep in a driver, a dead NFS mount).
const KILL_SETTLE: Duration = Duration::from_secs(30);
/// How often teardown checks whether process groups are gone.
const POLL: Duration = Duration::from_millis(5);
/// How often a running group's adopted orphans that exited are reaped (no zombie piles up).
const REAP_EVERY: Duration = Duration::from_millis(500);

pub use crate::event::Event;

/// A rank that could not start, and why.
type NotStarted = (u32, std::io::Error);

/// How a group run ended.
pub enum GroupEnd {
    Success,
    /// A worker failed; the group was torn down. `root` indexes `records`. `interrupted` is set
    /// when the launcher was also signalled (then there is no restart).
    Failed {
        records: Vec<WorkerRecord>,
        root: usize,
        interrupted: Option<i32>,
    },
    /// The launcher was signalled before any worker failed; the group was torn down.
    Interrupted {
        signal: i32,
    },
    /// Every worker stopped at a checkpoint to be resumed (exit code 75) without `launch` being
    /// signalled: a preemption reached the job on another node.
    Stopped,
    /// A worker could not be started.
    SpawnFailed {
        code: i32,
    },
    /// Elastic jobs: torn down to re-form ([`Event::Regroup`]).
    Regroup {
        reason: String,
    },
    /// Elastic jobs: torn down because the rendezvous store is gone.
    StoreLost {
        why: String,
    },
}

/// Runs the plan to completion; returns the launcher's exit code.
pub fn run(plan: &Plan, mut watchdog: Watchdog, events: (Sender<Event>, Receiver<Event>)) -> i32 {
    let sinks = Sinks::new(plan.world_size);
    let mut restart = 0;
    let code = loop {
        match run_once(plan, restart, &sinks, &mut watchdog, &events) {
            GroupEnd::Success => break 0,
            GroupEnd::Interrupted { signal } => break report::interrupted(signal),
            GroupEnd::Stopped => break report::stopped_at_checkpoint(),
            GroupEnd::SpawnFailed { code } => break code,
            // Only elastic jobs send the events behind these.
            GroupEnd::Regroup { .. } | GroupEnd::StoreLost { .. } => break 1,
            GroupEnd::Failed {
                records,
                root,
                interrupted,
            } => {
                let r = &records[root];
                let signalled = interrupted.or_else(|| pending_signal(&events.1));
                if restart < plan.max_restarts && signalled.is_none() {
                    warn!(
                        "rank {} failed ({}); the group was torn down",
                        r.rank, r.ending
                    );
                    restart += 1;
                    info!(
                        "restarting the worker group (restart {restart} of {}, TORCHELASTIC_RESTART_COUNT={restart})",
                        plan.max_restarts
                    );
                    continue;
                }
                if let (Some(sig), true) = (signalled, restart < plan.max_restarts) {
                    warn!(
                        "not restarting: launch received {}",
                        report::signal_name(sig)
                    );
                }
                break report_failure(plan, &records, root, restart + 1);
            }
        }
    };
    watchdog.report_peaks();
    watchdog.disarm();
    code
}

/// One run of the worker group (round `round`): sweeps what dead runs left in shared memory
/// before and after, shows the progress display while it runs.
pub fn run_once(
    plan: &Plan,
    round: u32,
    sinks: &Arc<Sinks>,
    watchdog: &mut Watchdog,
    events: &(Sender<Event>, Receiver<Event>),
) -> GroupEnd {
    crate::shm_sweep::sweep_and_log();
    crate::report::oom::mark_start();
    let display = crate::progress::wanted().then(|| {
        crate::progress::Display::start((0..plan.nproc).map(|l| plan.worker_env(l, round).rank))
    });
    let end = run_group(plan, round, sinks, display.as_ref(), watchdog, events);
    if let Some(display) = &display {
        display.stop();
    }
    crate::shm_sweep::sweep_and_log(); // every worker of the group is reaped by now
    end
}

/// Prints the failure summary of a group that failed `runs` time(s); the launcher's exit code.
pub fn report_failure(plan: &Plan, records: &[WorkerRecord], root: usize, runs: u32) -> i32 {
    let first = plan.first_rank;
    let flight = report::flight::lines(plan);
    let summary = report::failure_summary(records, root, runs, first..first + plan.nproc, &flight);
    crate::console_line::end_open_line();
    // A closed console must not turn a failure report into a panic.
    let _ = writeln!(std::io::stderr().lock(), "{summary}");
    report::exit_code(records, root)
}

/// A signal that arrived while nothing was listening (between group runs).
pub fn pending_signal(rx: &Receiver<Event>) -> Option<i32> {
    rx.try_iter().find_map(|event| match event {
        Event::Signal(sig) => Some(sig),
        _ => None,
    })
}

struct Worker {
    rank: u32,
    local_rank: u32,
    pid: i32,
    ending: Option<(Ending, Instant)>,
    sent: Option<Signal>,
    /// It was stopped (SIGSTOP, a debugger) when the teardown first signalled it: it had
    /// stopped answering, which the summary says.
    stopped: bool,
    tail: Tail,
    /// Whether its output reaches the console (`--local-ranks-filter`).
    muting: Muting,
}

/// Why the group is being torn down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cause {
    Failure,
    Signal(i32),
    /// Elastic jobs: re-form ([`Event::Regroup`]) or the store is gone ([`Event::StoreLost`]);
    /// the reason is in [`Group::elastic_reason`].
    Regroup,
    StoreLost,
}

/// One run of the worker group, from spawn to the last process gone.
struct Group<'a> {
    plan: &'a Plan,
    round: u32,
    rx: &'a Receiver<Event>,
    started: Instant,
    workers: Vec<Worker>,
    open_streams: usize,
    /// The first reason for tearing down, and when teardown began.
    cause: Option<(Cause, Instant)>,
    /// A signal to the launcher, whenever it came.
    interrupted: Option<i32>,
    /// When the remaining workers get SIGKILL (grace period running).
    kill_at: Option<Instant>,
    /// After SIGKILL: when to stop waiting for processes the kernel cannot remove.
    give_up_at: Option<Instant>,
    /// Why an elastic teardown ([`Cause::Regroup`], [`Cause::StoreLost`]) began.
    elastic_reason: String,
    /// Elastic jobs: the workers were asked to stop at their next checkpoint, and why.
    regroup_asked: Option<String>,
}

fn run_group(
    plan: &Plan,
    round: u32,
    sinks: &Arc<Sinks>,
    display: Option<&Arc<Display>>,
    watchdog: &mut Watchdog,
    (tx, rx): &(Sender<Event>, Receiver<Event>),
) -> GroupEnd {
    if let Some(signal) = pending_signal(rx) {
        return GroupEnd::Interrupted { signal };
    }
    let mut group = Group {
        plan,
        round,
        rx,
        started: Instant::now(),
        workers: Vec::with_capacity(plan.nproc as usize),
        open_streams: 0,
        cause: None,
        interrupted: None,
        kill_at: None,
        give_up_at: None,
        elastic_reason: String::new(),
        regroup_asked: None,
    };
    if let Err((rank, e)) = group.start(sinks, display, tx, watchdog) {
        let code = match e.kind() {
            std::io::ErrorKind::NotFound => 127,
            std::io::ErrorKind::PermissionDenied => 126,
            _ => 1,
        };
        let _ = writeln!(
            std::io::stderr().lock(),
            "launch: error: cannot start rank {rank} ({}): {e}",
            shell_words(&plan.command)
        );
        group.kill_now();
        group.wait_for_workers();
        group.finish(watchdog);
        return GroupEnd::SpawnFailed { code };
    }
    group.wait_for_workers();
    group.finish(watchdog);
    group.end()
}

impl Group<'_> {
    /// Starts every worker of the group, then the threads that follow them (the workers run
    /// meanwhile); each worker is under the orphan guard from its start. The rank that could
    /// not start, and why, if one could not.
    fn start(
        &mut self,
        sinks: &Arc<Sinks>,
        display: Option<&Arc<Display>>,
        tx: &Sender<Event>,
        watchdog: &mut Watchdog,
    ) -> Result<(), NotStarted> {
        let (running, not_started) = self.spawn_all(display, watchdog);
        let followed = match running.is_empty() {
            true => Ok(()),
            false => self.follow(running, sinks, tx, watchdog),
        };
        not_started.map_or(followed, Err)
    }

    /// Starts the workers in rank order until one cannot start; those that run, and the first
    /// that did not with why.
    fn spawn_all(
        &self,
        display: Option<&Arc<Display>>,
        watchdog: &mut Watchdog,
    ) -> (Vec<(WorkerEnv, Running)>, Option<NotStarted>) {
        let mut running = Vec::with_capacity(self.plan.nproc as usize);
        if let Some(layout) = &self.plan.layout {
            if let Err(e) = layout.begin_attempt(self.round, self.plan.nproc) {
                warn!(
                    "cannot make attempt_{} under {}: {e}",
                    self.round,
                    layout.run_dir().display()
                );
            }
        }
        for local_rank in 0..self.plan.nproc {
            let env = self.plan.worker_env(local_rank, self.round);
            match start_worker(self.plan, &env, display, watchdog.cgroup()) {
                Ok(worker) => {
                    watchdog.watch(worker.pid());
                    running.push((env, worker));
                }
                Err(e) => return (running, Some((env.rank, e))),
            }
        }
        (running, None)
    }

    /// Has the running workers followed and makes them the group's; if they cannot be, they
    /// were killed and reaped (the group cannot run without them).
    fn follow(
        &mut self,
        running: Vec<(WorkerEnv, Running)>,
        sinks: &Arc<Sinks>,
        tx: &Sender<Event>,
        watchdog: &mut Watchdog,
    ) -> Result<(), NotStarted> {
        let first_rank = running
            .first()
            .map_or(self.plan.first_rank, |(env, _)| env.rank);
        let pids: Vec<i32> = running.iter().map(|(_, worker)| worker.pid()).collect();
        let followed = follow_group(running, self.plan, sinks, tx, self.round).map_err(|e| {
            pids.iter().for_each(|&pid| watchdog.forget(pid));
            (first_rank, e)
        })?;
        for w in followed {
            self.open_streams += 2;
            self.workers.push(Worker {
                rank: w.rank,
                local_rank: w.local_rank,
                pid: w.pid,
                ending: None,
                sent: None,
                stopped: false,
                tail: w.tail,
                muting: w.muting,
            });
        }
        Ok(())
    }

    fn running(&self) -> usize {
        self.workers.iter().filter(|w| w.ending.is_none()).count()
    }

    /// The launcher's own children, which the adopted-process cleanup leaves alone: the
    /// workers (their threads wait for them). The orphan guard is not a child of the launcher.
    fn own_children(&self) -> Vec<i32> {
        self.workers.iter().map(|w| w.pid).collect()
    }

    /// The signal the teardown sent the workers: the one `launch` received and forwarded
    /// (SIGINT on Ctrl-C), else SIGTERM.
    fn stop_signal(&self) -> &'static str {
        match self.cause {
            Some((Cause::Signal(sig), _)) => {
                Signal::try_from(sig).map_or("SIGTERM", |s| s.as_str())
            }
            _ => "SIGTERM",
        }
    }

    /// Until every worker has exited: react to exits and signals, enforce the grace period.
    fn wait_for_workers(&mut self) {
        while self.running() > 0 {
            let deadline = self.kill_at.or(self.give_up_at);
            let event = match deadline {
                Some(deadline) => match self.rx.recv_deadline(deadline) {
                    Ok(event) => event,
                    Err(RecvTimeoutError::Timeout) => {
                        if self.kill_at.is_some() {
                            warn!(
                                "{} worker(s) still running {:.1} s after {}: sending SIGKILL",
                                self.running(),
                                self.plan.grace_period.as_secs_f64(),
                                self.stop_signal()
                            );
                            self.kill_now();
                        } else {
                            let stuck: Vec<i32> = self
                                .workers
                                .iter()
                                .filter(|w| w.ending.is_none())
                                .map(|w| w.pid)
                                .collect();
                            warn!(
                                "worker pid(s) {stuck:?} survived SIGKILL for {} s (stuck in the kernel?); giving up on them",
                                KILL_SETTLE.as_secs()
                            );
                            return;
                        }
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => return,
                },
                None => match self.rx.recv_timeout(REAP_EVERY) {
                    Ok(event) => event,
                    Err(RecvTimeoutError::Timeout) => {
                        crate::adopted::reap_zombies(&self.own_children());
                        // A worker still starting ignores the request: ask again.
                        self.signal_regroup();
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => return,
                },
            };
            self.handle(event);
        }
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Exited {
                round,
                local_rank,
                status,
                at,
            } if round == self.round => {
                let ending = ending_of(status);
                let Some(w) = self.workers.iter_mut().find(|w| w.local_rank == local_rank) else {
                    return;
                };
                w.ending = Some((ending, at));
                // Stopping at a checkpoint is not a failure: when asked to (re-forming), and when
                // our workers agreed to (a preemption that reached another node first).
                let regrouping = (self.regroup_asked.is_some() || self.plan.config.is_some())
                    && ending == Ending::Code(common::env_contract::EXIT_REGROUP);
                // Not one that ended because the teardown signalled it.
                if !ending.is_success() && !regrouping && w.sent.is_none() {
                    // Its last lines (the error, most often) come before what launch says of
                    // it; a child of the worker may hold its pipes, so the wait is bounded.
                    w.muting.wait_drained(DRAIN_FAILED);
                    show_hidden(w, &ending);
                }
                if !ending.is_success() && !regrouping && self.cause.is_none() {
                    self.cause = Some((Cause::Failure, Instant::now()));
                    warn!(
                        "rank {} (pid {}) failed: {ending}; stopping the other workers (SIGTERM, SIGKILL after {:.1} s)",
                        w.rank,
                        w.pid,
                        self.plan.grace_period.as_secs_f64()
                    );
                    self.signal_running(Signal::SIGTERM);
                    self.kill_at = Some(Instant::now() + self.plan.grace_period);
                }
            }
            Event::Signal(sig) => {
                let Ok(signal) = Signal::try_from(sig) else {
                    return;
                };
                self.interrupted.get_or_insert(sig);
                if self.cause.is_none() {
                    self.cause = Some((Cause::Signal(sig), Instant::now()));
                    warn!(
                        "received {}: forwarding it to every worker (SIGKILL after {:.1} s; {} again to kill now)",
                        signal.as_str(),
                        self.plan.grace_period.as_secs_f64(),
                        signal.as_str()
                    );
                    if signal == Signal::SIGTERM {
                        // Our worker then stops at a checkpoint (a teardown of our own, after a
                        // failure, ends it at once).
                        self.plan.mark_preempted();
                    }
                    self.signal_running(signal);
                    self.kill_at = Some(Instant::now() + self.plan.grace_period);
                } else {
                    // Already tearing down (after a failure or a first signal): the user wants
                    // it over now.
                    warn!(
                        "received {} again: killing every worker now",
                        signal.as_str()
                    );
                    self.kill_now();
                }
            }
            Event::OutputClosed { round } if round == self.round => {
                self.open_streams = self.open_streams.saturating_sub(1);
            }
            Event::Regroup {
                round,
                reason,
                at_checkpoint,
            } if round == self.round => {
                if at_checkpoint && self.plan.config.is_some() {
                    self.ask_to_stop_at_checkpoint(reason);
                } else {
                    self.elastic_teardown(Cause::Regroup, reason);
                }
            }
            Event::StoreLost(why) => self.elastic_teardown(Cause::StoreLost, why),
            _ => {} // stale event of an earlier round
        }
    }

    /// Tears the group down for an elastic reason (SIGTERM, SIGKILL after the grace period),
    /// unless a teardown is under way already.
    fn elastic_teardown(&mut self, cause: Cause, reason: String) {
        if self.cause.is_some() {
            return;
        }
        let line = format!(
            "{reason}: stopping this node's workers (SIGTERM, SIGKILL after {:.1} s)",
            self.plan.grace_period.as_secs_f64()
        );
        // A lost store is said once, as a warning, by the elastic supervisor.
        if matches!(cause, Cause::StoreLost) {
            tracing::info!("{line}");
        } else {
            warn!("{line}");
        }
        self.cause = Some((cause, Instant::now()));
        self.elastic_reason = reason;
        self.signal_running(Signal::SIGTERM);
        self.kill_at = Some(Instant::now() + self.plan.grace_period);
    }

    /// SIGUSR1 to every running worker: each stops after its next checkpoint, all ranks
    /// together, and exits with `EXIT_REGROUP`.
    fn ask_to_stop_at_checkpoint(&mut self, reason: String) {
        if self.cause.is_some() || self.regroup_asked.is_some() {
            return;
        }
        info!("{reason}: asking this node's workers to stop at their next checkpoint");
        self.regroup_asked = Some(reason);
        self.signal_regroup();
    }

    /// SIGUSR1 to every running worker while a re-forming is asked for (repeated, since a
    /// worker ignores it until its handler is installed).
    fn signal_regroup(&self) {
        if self.regroup_asked.is_none() || self.cause.is_some() {
            return;
        }
        for w in self.workers.iter().filter(|w| w.ending.is_none()) {
            let _ = nix::sys::signal::kill(Pid::from_raw(w.pid), Signal::SIGUSR1);
        }
    }

    /// SIGKILL to every group now (workers and whatever is left of their children).
    fn kill_now(&mut self) {
        for w in &mut self.workers {
            let exited = crate::process::has_exited(w.pid);
            if killpg(Pid::from_raw(w.pid), Signal::SIGKILL).is_ok()
                && w.ending.is_none()
                && !exited
            {
                w.sent = Some(Signal::SIGKILL);
            }
        }
        self.kill_at = None;
        self.give_up_at = Some(Instant::now() + KILL_SETTLE);
    }

    /// Sends `signal` to the process group of every worker still running.
    fn signal_running(&mut self, signal: Signal) {
        for w in self.workers.iter_mut().filter(|w| w.ending.is_none()) {
            if w.sent.is_none() {
                w.stopped = crate::process::is_stopped(w.pid);
            }
            // A worker that exited on its own, not yet reaped, is not ended by this signal
            // (its group may still hold children): the summary must not say launch ended it.
            let exited = crate::process::has_exited(w.pid);
            if killpg(Pid::from_raw(w.pid), signal).is_ok() && !exited {
                w.sent = Some(signal);
            }
        }
    }

    /// After the workers exited: whatever is left in their process groups (their children) gets
    /// SIGTERM, then SIGKILL when the grace period is over; then the output is drained and the
    /// watchdog forgets the groups. Signals keep being handled throughout.
    fn finish(&mut self, watchdog: &mut Watchdog) {
        let groups: Vec<Pid> = self.workers.iter().map(|w| Pid::from_raw(w.pid)).collect();
        crate::adopted::reap_all();
        let mut left = crate::adopted::alive(&groups);
        if !left.is_empty() {
            for pg in &left {
                let _ = killpg(*pg, Signal::SIGTERM);
            }
            let mut kill_at = match (self.cause, self.kill_at) {
                (None, _) => Some(Instant::now() + self.plan.grace_period),
                (Some(_), Some(at)) => Some(at),
                (Some(_), None) => Some(Instant::now()),
            };
            let mut give_up = Instant::now() + self.plan.grace_period + KILL_SETTLE;
            while !left.is_empty() && Instant::now() < give_up {
                if kill_at.is_some_and(|at| Instant::now() >= at) {
                    for pg in &left {
                        let _ = killpg(*pg, Signal::SIGKILL);
                    }
                    kill_at = None;
                    give_up = give_up.min(Instant::now() + KILL_SETTLE);
                }
                if let Ok(event) = self.rx.recv_timeout(POLL) {
                    if matches!(event, Event::Signal(_)) {
                        kill_at = Some(Instant::now());
                    }
                    self.handle(event);
                }
                crate::adopted::reap_all();
                left = crate::adopted::alive(&left);
            }
            if !left.is_empty() {
                warn!("process group(s) {left:?} still exist after SIGKILL; giving up on them");
            }
        }
        self.stop_escaped();
        if watchdog.kill_leftovers() {
            warn!("processes the workers started were left in the job's cgroup: killed them");
        }
        let drain_until = Instant::now() + DRAIN_TIMEOUT;
        while self.open_streams > 0 {
            match self.rx.recv_deadline(drain_until) {
                Ok(event) => self.handle(event),
                Err(_) => break,
            }
        }
        for pg in groups {
            watchdog.forget(pg.as_raw());
        }
    }

    /// Descendants that left their worker's process group (`setsid`) were adopted by the
    /// launcher when their worker ended: SIGTERM, SIGKILL after the grace period (at once after
    /// a failure), until none is left (their own orphans are adopted in turn).
    fn stop_escaped(&mut self) {
        let workers = self.own_children();
        let mut left = crate::adopted::running(&workers);
        if left.is_empty() {
            return;
        }
        warn!(
            "{} process(es) {left:?} left their worker's process group and outlived it: stopping them",
            left.len()
        );
        crate::adopted::signal(&left, Signal::SIGTERM);
        let mut kill_at = Some(match self.cause {
            Some(_) => Instant::now(),
            None => Instant::now() + self.plan.grace_period,
        });
        let give_up = Instant::now() + self.plan.grace_period + KILL_SETTLE;
        while !left.is_empty() && Instant::now() < give_up {
            if kill_at.is_some_and(|at| Instant::now() >= at) {
                crate::adopted::signal(&left, Signal::SIGKILL);
                kill_at = None;
            }
            if let Ok(event) = self.rx.recv_timeout(POLL) {
                if matches!(event, Event::Signal(_)) {
                    kill_at = Some(Instant::now());
                }
                self.handle(event);
            }
            crate::adopted::reap_zombies(&workers);
            left = crate::adopted::running(&workers);
            if kill_at.is_none() && !left.is_empty() {
                // Newly adopted grandchildren get the same end.
                crate::adopted::signal(&left, Signal::SIGKILL);
            }
        }
        if !left.is_empty() {
            warn!("process(es) {left:?} still exist after SIGKILL; giving up on them");
        }
    }

    fn end(self) -> GroupEnd {
        let stopped_to_regroup = self.workers.iter().any(|w| {
            matches!(w.ending, Some((Ending::Code(c), _)) if c == common::env_contract::EXIT_REGROUP)
        });
        let failure_at = match self.cause {
            None if stopped_to_regroup && self.regroup_asked.is_some() => {
                return GroupEnd::Regroup {
                    reason: self.regroup_asked.unwrap_or_default(),
                }
            }
            None if stopped_to_regroup => return GroupEnd::Stopped,
            None => return GroupEnd::Success,
            Some((Cause::Signal(signal), _)) => {
                let all_checkpointed = self.workers.iter().all(|w| {
                    matches!(w.ending, Some((Ending::Code(c), _)) if c == common::env_contract::EXIT_REGROUP)
                });
                if all_checkpointed && !self.workers.is_empty() {
                    info!("every worker stopped at a checkpoint (exit code 75: preempted, resumable): run the same command again to resume");
                }
                return GroupEnd::Interrupted { signal };
            }
            Some((Cause::Regroup | Cause::StoreLost, _)) if self.interrupted.is_some() => {
                return GroupEnd::Interrupted {
                    signal: self.interrupted.unwrap_or(15),
                }
            }
            Some((Cause::Regroup, _)) => {
                return GroupEnd::Regroup {
                    reason: self.elastic_reason,
                }
            }
            Some((Cause::StoreLost, _)) => {
                return GroupEnd::StoreLost {
                    why: self.elastic_reason,
                }
            }
            Some((Cause::Failure, at)) => at,
        };
        // The earliest failure, not the first event that arrived: two wait threads can wake in
        // either order (a stopped rank still comes first, see `report::root_cause`).
        let earliest = self
            .workers
            .iter()
            .enumerate()
            .filter_map(|(i, w)| match w.ending {
                Some((ending, at)) if !ending.is_success() && at <= failure_at => Some((at, i)),
                _ => None,
            })
            .min()
            .map_or(0, |(_, i)| i);
        let records = self
            .workers
            .iter()
            .map(|w| {
                let (ending, at) = w.ending.unwrap_or((Ending::Signal(9), Instant::now()));
                WorkerRecord {
                    rank: w.rank,
                    local_rank: w.local_rank,
                    pid: w.pid,
                    ending,
                    after: at.saturating_duration_since(self.started),
                    sent_by_launcher: w.sent,
                    was_stopped: w.stopped,
                    stderr_tail: w
                        .tail
                        .lock()
                        .map(|t| t.iter().cloned().collect())
                        .unwrap_or_default(),
                    error_file: (self.plan.layout.as_ref())
                        .map(|l| l.error_file(self.round, w.local_rank)),
                }
            })
            .collect::<Vec<_>>();
        GroupEnd::Failed {
            root: report::root_cause(&records, earliest),
            records,
            interrupted: self.interrupted,
        }
    }
}

/// A worker hidden by `--local-ranks-filter` that failed is shown from now on, after the last
/// lines it wrote while hidden (its own failure is what the user must see).
fn show_hidden(w: &Worker, ending: &Ending) {
    if w.muting.is_shown() {
        return;
    }
    let held = w.muting.show();
    if held.is_empty() {
        return;
    }
    warn!(
        "rank {} (local rank {}, hidden by --local-ranks-filter) failed: {ending}; its last lines:",
        w.rank, w.local_rank
    );
    let mut text = String::new();
    for (_, line) in held {
        text.push_str(&format!("[rank {}] {line}\n", w.rank));
    }
    crate::console_line::end_open_line();
    crate::progress::on_console(|| {
        let _ = std::io::stderr().lock().write_all(text.as_bytes());
    });
}

fn ending_of(status: ExitStatus) -> Ending {
    match (status.code(), status.signal()) {
        (Some(code), _) => Ending::Code(code),
        (None, Some(sig)) => Ending::Signal(sig),
        (None, None) => Ending::Code(1),
    }
}
