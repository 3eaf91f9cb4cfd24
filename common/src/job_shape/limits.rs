//! The bounds on every count of a job's shape (nodes, processes per node, the world), from
//! whichever source gave it: a count beyond them is a typo or an attack, refused with one line
//! before anything is allocated for it.

use super::{ShapeError, Source, Sourced};

/// More workers than this on one node is a typo, not a plan.
pub const MAX_PROCESSES: u32 = 1024;
/// The most nodes a job may have (`--nnodes`, `PET_NNODES`, Slurm's node counts).
pub const MAX_NODES: u32 = 65_536;
/// The most workers a job may have in all (nodes x processes per node).
pub const MAX_WORLD: u32 = 1 << 20;

/// What a count counts. [`Count::parse`] and [`Count::at_most`] are the one place node and
/// process counts are bounded, whichever flag or variable they come from, so a typo such as
/// `--nnodes 1:4000000000` is one line, never a table of 4 billion nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Count {
    /// Nodes in the job: at most [`MAX_NODES`].
    Nodes,
    /// Processes (or GPUs) on one node: at most [`MAX_PROCESSES`].
    Processes,
    /// Processes in the job: at most [`MAX_WORLD`].
    World,
}

/// Why a written count was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CountError {
    /// Not a whole number (each caller says what it expected instead).
    NotANumber,
    /// A number above the limit: the reason, naming the value and the limit.
    TooMany(String),
}

impl Count {
    pub fn limit(self) -> u32 {
        match self {
            Count::Nodes => MAX_NODES,
            Count::Processes => MAX_PROCESSES,
            Count::World => MAX_WORLD,
        }
    }

    fn noun(self) -> &'static str {
        match self {
            Count::Nodes => "nodes",
            Count::Processes => "processes on one node",
            Count::World => "processes in the job",
        }
    }

    /// `n` when it is within the limit; else the reason, e.g. `4000000000 nodes is more than
    /// launch supports (at most 65536)`.
    pub fn at_most(self, n: u64) -> Result<u32, String> {
        self.check(n, &n.to_string())
    }

    /// A whole number (`0` included: callers that need one say so) within the limit, however
    /// many digits it has.
    pub fn parse(self, text: &str) -> Result<u32, CountError> {
        let text = text.trim();
        let digits = text.strip_prefix('+').unwrap_or(text);
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(CountError::NotANumber);
        }
        // Past u64 is past any limit: saturate, the message shows the text.
        let n = digits.parse::<u64>().unwrap_or(u64::MAX);
        self.check(n, digits).map_err(CountError::TooMany)
    }

    fn check(self, n: u64, shown: &str) -> Result<u32, String> {
        match u32::try_from(n) {
            Ok(n) if n <= self.limit() => Ok(n),
            _ => Err(format!(
                "{shown} {} is more than launch supports (at most {})",
                self.noun(),
                self.limit()
            )),
        }
    }
}

/// The job's world, `nnodes` x `nproc`, within [`MAX_WORLD`]: else one line naming both
/// counts, where each came from, and the limit.
pub fn check_world(
    nnodes: &Sourced<u32>,
    nproc: u32,
    nproc_source: &Source,
) -> Result<u32, ShapeError> {
    let world = u64::from(nnodes.value) * u64::from(nproc);
    Count::World.at_most(world).map_err(|why| {
        ShapeError(format!(
            "{} node(s) ({}) x {nproc} process(es) per node ({nproc_source}): {why}",
            nnodes.value, nnodes.source
        ))
    })
}
