//! What a worker is doing, as its out-of-memory report names it ([`Phase`]), the seam through
//! which the code doing it says so ([`PhaseSink`]), and the `GPTREC_FAULT_OOM` specification
//! that raises a simulated out-of-memory error in a chosen phase ([`Fault`]).
//!
//! Plain values only: the worker's tracker keeps the current phase and raises the fault; the
//! estimate's [`super::Held`] says when a term's bytes are held, which is a coarser grain of the
//! same phases (forward, backward and optimizer are all `Held::Training`).

/// What the worker is doing, for the out-of-memory message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    Setup = 0,
    ModelBuild = 1,
    TextCaching = 2,
    Forward = 3,
    Backward = 4,
    Optimizer = 5,
    Evaluation = 6,
    AutoProbe = 7,
}

impl Phase {
    /// Every phase, in the order of their numbers.
    pub const ALL: [Phase; 8] = [
        Phase::Setup,
        Phase::ModelBuild,
        Phase::TextCaching,
        Phase::Forward,
        Phase::Backward,
        Phase::Optimizer,
        Phase::Evaluation,
        Phase::AutoProbe,
    ];

    /// The name used in messages and in `GPTREC_FAULT_OOM`.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Setup => "setup",
            Phase::ModelBuild => "build",
            Phase::TextCaching => "caching",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
            Phase::Evaluation => "eval",
            Phase::AutoProbe => "probe",
        }
    }

    /// How the message says it: "during the forward pass".
    pub fn description(self) -> &'static str {
        match self {
            Phase::Setup => "while starting up",
            Phase::ModelBuild => "while building the model",
            Phase::TextCaching => "while caching the text features",
            Phase::Forward => "during the forward pass",
            Phase::Backward => "during the backward pass",
            Phase::Optimizer => "during the optimizer step (all-reduce, clipping, AdamW)",
            Phase::Evaluation => "during evaluation",
            Phase::AutoProbe => "while probing micro batch sizes (batch.micro = \"auto\")",
        }
    }

    /// The phase numbered `v` (`Setup` for a number that names none).
    pub fn from_u8(v: u8) -> Phase {
        Phase::ALL
            .get(usize::from(v))
            .copied()
            .unwrap_or(Phase::Setup)
    }
}

/// Told when the code that holds it enters a phase (the worker's out-of-memory tracker). Code
/// that builds models or runs steps takes one instead of writing to anything global.
pub trait PhaseSink {
    /// Entering `phase`. May panic as a failed libtorch allocation would (fault injection).
    fn enter(&self, phase: Phase);
}

/// Tells nobody (tests, tools).
impl PhaseSink for () {
    fn enter(&self, _phase: Phase) {}
}

/// `GPTREC_FAULT_OOM=phase[@rank][:step]`: raise a simulated CUDA out-of-memory error the first
/// time `phase` is entered on `rank` (every rank when absent) at or after optimizer step `step`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    pub phase: Phase,
    pub rank: Option<u64>,
    pub after_step: u64,
}

/// The text a simulated failure raises: what libtorch says on a real CUDA OOM, marked.
pub const SIMULATED_OOM: &str =
    "CUDA out of memory. Tried to allocate 1.23 GiB (simulated by GPTREC_FAULT_OOM)";

impl Fault {
    /// Parses the variable's value; `None` for an empty one.
    pub fn parse(text: &str) -> Result<Option<Fault>, String> {
        let text = text.trim();
        if text.is_empty() {
            return Ok(None);
        }
        let number = |what: &str, value: &str| -> Result<u64, String> {
            value
                .parse()
                .map_err(|_| format!("GPTREC_FAULT_OOM={text}: {what} {value:?} is not a number"))
        };
        let (rest, after_step) = match text.split_once(':') {
            Some((rest, step)) => (rest, number("step", step)?),
            None => (text, 0),
        };
        let (phase, rank) = match rest.split_once('@') {
            Some((phase, rank)) => (phase, Some(number("rank", rank)?)),
            None => (rest, None),
        };
        let phase = Phase::ALL
            .into_iter()
            .find(|p| p.name() == phase)
            .ok_or_else(|| {
                let names: Vec<&str> = Phase::ALL.iter().map(|p| p.name()).collect();
                format!(
                    "GPTREC_FAULT_OOM={text}: unknown phase {phase:?} (one of {})",
                    names.join(", ")
                )
            })?;
        Ok(Some(Fault {
            phase,
            rank,
            after_step,
        }))
    }

    /// Whether entering `phase` on `rank` after `step` optimizer steps raises this fault.
    pub fn fires(&self, phase: Phase, rank: u64, step: u64) -> bool {
        self.phase == phase && self.rank.is_none_or(|r| r == rank) && step >= self.after_step
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_specs_parse() {
        assert_eq!(Fault::parse("").unwrap(), None);
        assert_eq!(
            Fault::parse("forward").unwrap(),
            Some(Fault {
                phase: Phase::Forward,
                rank: None,
                after_step: 0
            })
        );
        assert_eq!(
            Fault::parse("backward@1:5").unwrap(),
            Some(Fault {
                phase: Phase::Backward,
                rank: Some(1),
                after_step: 5
            })
        );
        let e = Fault::parse("fwd").unwrap_err();
        assert!(
            e.contains("unknown phase \"fwd\"") && e.contains("forward"),
            "{e}"
        );
        assert!(Fault::parse("eval@x").unwrap_err().contains("rank \"x\""));
        assert!(Fault::parse("eval:y").unwrap_err().contains("step \"y\""));
    }

    #[test]
    fn a_fault_fires_in_its_phase_on_its_rank_from_its_step() {
        let f = Fault::parse("backward@1:5").unwrap().unwrap();
        assert!(f.fires(Phase::Backward, 1, 5));
        assert!(f.fires(Phase::Backward, 1, 9));
        assert!(!f.fires(Phase::Backward, 1, 4));
        assert!(!f.fires(Phase::Backward, 0, 5));
        assert!(!f.fires(Phase::Forward, 1, 5));
        let any = Fault::parse("eval").unwrap().unwrap();
        assert!(any.fires(Phase::Evaluation, 3, 0));
    }

    #[test]
    fn phases_round_trip_through_their_numbers() {
        for p in Phase::ALL {
            assert_eq!(Phase::from_u8(p as u8), p);
        }
        assert_eq!(Phase::from_u8(200), Phase::Setup);
    }
}
