//! The events a launcher reacts to, from wherever they come: signals, workers exiting, their
//! output closing, and the elastic rendezvous (re-form, store lost). A leaf module: the
//! supervisor consumes them, the rendezvous and the signal thread produce them, and neither
//! side needs the other to name them.

use std::process::ExitStatus;
use std::time::Instant;

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
    /// One output stream of group run `round` has been forwarded completely.
    OutputClosed { round: u32 },
    /// Elastic jobs: the group of `round` must re-form: at once when a member failed, at the
    /// workers' next checkpoint (`at_checkpoint`) when a node waits to join.
    Regroup {
        round: u32,
        reason: String,
        at_checkpoint: bool,
    },
    /// Elastic jobs: the rendezvous store (the host node) is gone.
    StoreLost(String),
}
