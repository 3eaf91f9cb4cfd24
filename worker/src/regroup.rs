//! An elastic `launch`'s request to re-form the group: SIGUSR1 to a worker means "stop at your
//! next checkpoint" (a node waits to join). The handler only sets a flag; the trainer reads it
//! after each checkpoint and all ranks stop there together, exiting with
//! [`common::env_contract::EXIT_REGROUP`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

static REQUESTED: OnceLock<std::sync::Arc<AtomicBool>> = OnceLock::new();

/// Installs the SIGUSR1 handler (once; a failure is logged, and the request then kills the
/// worker, which `launch` reads as a failure and restarts the group anyway).
pub fn install() {
    let flag = REQUESTED.get_or_init(Default::default).clone();
    if let Err(e) = signal_hook::flag::register(signal_hook::consts::SIGUSR1, flag) {
        tracing::warn!("cannot install the SIGUSR1 handler for elastic re-forming: {e}");
    }
}

/// Whether `launch` asked this worker to stop at its next checkpoint.
pub fn requested() -> bool {
    REQUESTED.get().is_some_and(|f| f.load(Ordering::Relaxed))
}
