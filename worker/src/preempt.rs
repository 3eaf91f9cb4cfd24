//! Preemption, as Slurm and Kubernetes do it: SIGTERM, then SIGKILL after a grace period. Under
//! `launch` (which names a marker file in [`PREEMPT_FILE_VAR`] and writes it before it passes on
//! a SIGTERM it received), a SIGTERM while the trainer runs its optimizer steps raises a flag
//! once the marker is there; the next step's summary all-reduce carries the flag to every rank
//! (`runtime::ddp::Ddp::set_stop_flag`), so all ranks stop after that same step, write a
//! checkpoint there and exit with [`EXIT_PREEMPTED`]. More SIGTERMs within a second are the
//! same one (under Slurm, Slurm's own and the one `launch` passes on). A SIGTERM without the
//! marker (`launch` tearing the group down after a failure), outside the steps, a later one, or
//! without `launch` (torchrun, by hand) ends the worker at once, as it always did.
//!
//! Owns the handler, the flag and the decision preemption-or-teardown; must not decide when
//! to checkpoint (the trainer's).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use common::env_contract::PREEMPT_FILE_VAR;

/// Exit code of a worker that stopped at a checkpoint on SIGTERM: resumable by starting the
/// same command again. EX_TEMPFAIL ("try again"), as an elastic re-forming's stop
/// ([`common::env_contract::EXIT_REGROUP`]): both end at a checkpoint to be resumed.
pub const EXIT_PREEMPTED: i32 = common::env_contract::EXIT_REGROUP;

/// How long a SIGTERM waits for `launch`'s marker: Slurm signals the workers and `launch`
/// together, and `launch` writes the marker within milliseconds of its own.
const MARKER_WAIT: Duration = Duration::from_millis(250);
/// After a preemption's SIGTERM, how long more SIGTERMs are taken as the same one: under Slurm
/// a worker gets one from Slurm and one passed on by `launch`, milliseconds apart.
const DUPLICATE_WINDOW: Duration = Duration::from_secs(1);

struct State {
    /// A SIGTERM arrived during the steps; not decided yet.
    pending: Arc<AtomicBool>,
    /// It was a preemption: every rank is to stop after the next step.
    requested: Arc<AtomicBool>,
    /// The trainer is in its optimizer steps ([`Steps`]).
    in_steps: Arc<AtomicBool>,
    /// A SIGTERM now is a duplicate of the first (until the decision, and a while after).
    absorbing: Arc<AtomicBool>,
}

static STATE: OnceLock<State> = OnceLock::new();

/// Installs the SIGTERM handler when `launch` started this worker (once; a failure is logged,
/// and SIGTERM then ends the worker as before: it resumes from its last checkpoint).
pub fn install() {
    let Some(marker) = std::env::var_os(PREEMPT_FILE_VAR).map(PathBuf::from) else {
        return;
    };
    let state = STATE.get_or_init(|| State {
        pending: Arc::default(),
        requested: Arc::default(),
        in_steps: Arc::default(),
        absorbing: Arc::default(),
    });
    let (pending, in_steps) = (state.pending.clone(), state.in_steps.clone());
    let absorbing = state.absorbing.clone();
    // SAFETY: the action only touches atomics and calls signal-hook's emulation of the default
    // action, both async-signal-safe.
    let installed = unsafe {
        signal_hook::low_level::register(signal_hook::consts::SIGTERM, move || {
            if absorbing.load(Ordering::SeqCst) {
                return;
            }
            let first_in_steps =
                in_steps.load(Ordering::SeqCst) && !pending.swap(true, Ordering::SeqCst);
            if first_in_steps {
                absorbing.store(true, Ordering::SeqCst);
            } else {
                die_of_sigterm();
            }
        })
    };
    if let Err(e) = installed {
        tracing::warn!("cannot install the SIGTERM handler for checkpoint on preemption: {e}");
        return;
    }
    let (pending, requested) = (state.pending.clone(), state.requested.clone());
    let absorbing = state.absorbing.clone();
    let decided = std::thread::Builder::new()
        .name("preemption".into())
        .spawn(move || decide(&marker, &pending, &requested, &absorbing));
    if let Err(e) = decided {
        tracing::warn!("cannot start the preemption thread: {e}");
    }
}

/// Waits for a pending SIGTERM, then for `launch`'s marker: there, a preemption (the flag goes
/// up, and SIGTERMs within [`DUPLICATE_WINDOW`] are taken as the same one); not within
/// [`MARKER_WAIT`], a teardown (the worker ends, by SIGTERM).
fn decide(marker: &Path, pending: &AtomicBool, requested: &AtomicBool, absorbing: &AtomicBool) {
    while !pending.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let since = Instant::now();
    while since.elapsed() < MARKER_WAIT {
        if marker.exists() {
            requested.store(true, Ordering::SeqCst);
            std::thread::sleep(DUPLICATE_WINDOW);
            absorbing.store(false, Ordering::SeqCst);
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    die_of_sigterm();
}

/// Ends the process as SIGTERM's default action does (its parent sees "killed by SIGTERM").
fn die_of_sigterm() {
    let _ = signal_hook::low_level::emulate_default_handler(signal_hook::consts::SIGTERM);
}

/// The flag a preemption raises, when the handler is installed.
pub fn flag() -> Option<Arc<AtomicBool>> {
    STATE.get().map(|s| s.requested.clone())
}

/// While it lives, the trainer is in its optimizer steps: a SIGTERM then may ask for a stop at
/// a checkpoint instead of ending the process.
pub struct Steps(());

impl Steps {
    pub fn enter() -> Steps {
        if let Some(state) = STATE.get() {
            state.in_steps.store(true, Ordering::SeqCst);
        }
        Steps(())
    }
}

impl Drop for Steps {
    fn drop(&mut self) {
        if let Some(state) = STATE.get() {
            state.in_steps.store(false, Ordering::SeqCst);
        }
    }
}
