//! Preemption, as Slurm and Kubernetes do it: SIGTERM, then SIGKILL after a grace period. While
//! the trainer runs its optimizer steps, SIGTERM only raises a flag, which the next step's
//! summary all-reduce carries to every rank (`runtime::ddp::Ddp::set_stop_flag`): all ranks stop
//! after that same step, write a checkpoint there and exit with [`EXIT_PREEMPTED`]. Outside the
//! steps (set-up, evaluation) and at a second SIGTERM, the signal ends the process as it always
//! did. Owns the handler and the flag; must not decide when to checkpoint (the trainer's).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

/// Exit code of a worker that stopped at a checkpoint on SIGTERM: resumable by starting the
/// same command again. EX_TEMPFAIL ("try again"), as an elastic re-forming's stop
/// ([`common::env_contract::EXIT_REGROUP`]): both end at a checkpoint to be resumed.
pub const EXIT_PREEMPTED: i32 = common::env_contract::EXIT_REGROUP;

struct State {
    /// A SIGTERM arrived while the steps ran.
    requested: Arc<AtomicBool>,
    /// The trainer is in its optimizer steps ([`Steps`]).
    in_steps: Arc<AtomicBool>,
}

static STATE: OnceLock<State> = OnceLock::new();

/// Installs the SIGTERM handler (once; a failure is logged, and SIGTERM then ends the worker as
/// before: it resumes from its last checkpoint).
pub fn install() {
    let state = STATE.get_or_init(|| State {
        requested: Arc::default(),
        in_steps: Arc::default(),
    });
    let (requested, in_steps) = (state.requested.clone(), state.in_steps.clone());
    // SAFETY: the action only touches atomics and calls signal-hook's emulation of the default
    // action, both async-signal-safe.
    let installed = unsafe {
        signal_hook::low_level::register(signal_hook::consts::SIGTERM, move || {
            let first_in_steps =
                in_steps.load(Ordering::SeqCst) && !requested.swap(true, Ordering::SeqCst);
            if !first_in_steps {
                let _ =
                    signal_hook::low_level::emulate_default_handler(signal_hook::consts::SIGTERM);
            }
        })
    };
    if let Err(e) = installed {
        tracing::warn!("cannot install the SIGTERM handler for checkpoint on preemption: {e}");
    }
}

/// The flag a SIGTERM raises during the steps, when the handler is installed.
pub fn flag() -> Option<Arc<AtomicBool>> {
    STATE.get().map(|s| s.requested.clone())
}

/// While it lives, the trainer is in its optimizer steps: a SIGTERM then asks for a stop at a
/// checkpoint instead of ending the process.
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
