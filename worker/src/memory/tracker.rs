//! The out-of-memory tracker: one value, made by `main` and handed down to the trainer, the
//! model build and the auto-micro probe (and captured by the panic hook), that knows which
//! phase the worker is in, how many optimizer steps it has done, what it runs (config, plan,
//! device, data, last checkpoint) and this process's device peak — so that an out-of-memory
//! error anywhere becomes one report that says where and what to change, and exits before
//! unwinding disturbs the other ranks. It also raises `GPTREC_FAULT_OOM`'s simulated failure.
//!
//! It never decides what to do about memory beyond that exit; the estimate is `common::memory`.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use common::batch::BatchPlan;
use common::memory::{self as estimate, DataShape, Fault, Phase, PhaseSink, SIMULATED_OOM};
use common::train_plan::TrainPlan;
use tch::Device;

use super::{first_line, is_oom, peak_rss_bytes, usage, Usage};

/// Exit code of a worker that ran out of memory.
pub const EXIT_OUT_OF_MEMORY: i32 = 3;

/// What the worker knows when memory runs out, kept up to date as it goes (for the report).
#[derive(Clone)]
pub struct RunFacts {
    pub plan: TrainPlan,
    pub device: Device,
    /// Ranks on this worker's host (`LOCAL_WORLD_SIZE`), for the estimate.
    pub host_ranks: u32,
    pub data: Option<DataShape>,
    pub last_checkpoint: Option<String>,
}

/// The tracker; clones share one state (cheap to pass and to capture).
#[derive(Clone, Default)]
pub struct PhaseTracker(Arc<State>);

#[derive(Default)]
struct State {
    phase: AtomicU8,
    step: AtomicU64,
    rank: AtomicU64,
    /// The largest device figure sampled (libtorch's caching allocator keeps what it reserved,
    /// so samples at log steps and at the end see the peak reservation).
    peak_device: AtomicU64,
    /// Set while the auto-micro probe runs: an out-of-memory error there is its answer.
    probing: AtomicBool,
    fault: OnceLock<Option<Fault>>,
    facts: Mutex<Option<RunFacts>>,
}

impl PhaseTracker {
    /// A tracker in [`Phase::Setup`] on rank 0 with no fault armed.
    pub fn new() -> PhaseTracker {
        PhaseTracker::default()
    }

    /// Records this worker's rank and arms `GPTREC_FAULT_OOM` (read once); call at start-up.
    pub fn arm_from_env(&self, rank: u32) -> Result<(), String> {
        let fault = Fault::parse(&std::env::var("GPTREC_FAULT_OOM").unwrap_or_default())?;
        self.arm(rank, fault);
        Ok(())
    }

    /// Records the rank and the fault to raise (the first call wins for the fault).
    pub fn arm(&self, rank: u32, fault: Option<Fault>) {
        self.0.rank.store(u64::from(rank), Ordering::Relaxed);
        let _ = self.0.fault.set(fault);
    }

    /// The phase entered last.
    pub fn phase(&self) -> Phase {
        Phase::from_u8(self.0.phase.load(Ordering::Relaxed))
    }

    /// Records the number of optimizer steps done (for the fault and the message).
    pub fn set_step(&self, step: u64) {
        self.0.step.store(step, Ordering::Relaxed);
    }

    /// Records what the report needs (at start-up, and again when the plan changes).
    pub fn record(&self, facts: RunFacts) {
        if let Ok(mut slot) = self.0.facts.lock() {
            *slot = Some(facts);
        }
    }

    /// Updates the recorded facts (nothing before [`PhaseTracker::record`]).
    pub fn update(&self, change: impl FnOnce(&mut RunFacts)) {
        if let Ok(mut slot) = self.0.facts.lock() {
            if let Some(facts) = slot.as_mut() {
                change(facts);
            }
        }
    }

    /// Runs `probe` with out-of-memory errors expected: [`PhaseTracker::exit_if_oom`] lets them
    /// pass, for the caller (`batch.micro = "auto"`) to handle.
    pub fn probing<T>(&self, probe: impl FnOnce() -> T) -> T {
        self.0.probing.store(true, Ordering::Relaxed);
        let out = probe();
        self.0.probing.store(false, Ordering::Relaxed);
        out
    }

    /// [`usage`], remembering the device peak.
    pub fn sample(&self, device: Device) -> (Usage, String) {
        let (u, name) = usage(device);
        if device.is_cuda() {
            self.0.peak_device.fetch_max(u.used, Ordering::Relaxed);
        }
        (u, name)
    }

    /// This process's peak so far: the RSS high-water mark on the CPU; on a GPU the largest
    /// figure sampled, this one included.
    pub fn peak_bytes(&self, device: Device) -> u64 {
        match device {
            Device::Cuda(_) => {
                let _ = self.sample(device);
                self.0.peak_device.load(Ordering::Relaxed)
            }
            _ => peak_rss_bytes(),
        }
    }

    /// When `detail` is an allocation failure (and no probe expects one): prints the report and
    /// exits with [`EXIT_OUT_OF_MEMORY`] at once — before unwinding closes this rank's
    /// connections, so that the launcher sees this rank fail first, as the root cause, and the
    /// others do not report a lost peer instead.
    pub fn exit_if_oom(&self, detail: &str) {
        if self.0.probing.load(Ordering::Relaxed) || !is_oom(detail) {
            return;
        }
        use std::io::Write as _;
        let report = self.report(detail);
        let mut err = std::io::stderr().lock();
        let _ = writeln!(err, "worker: error: {report}");
        let _ = err.flush();
        let _ = std::io::stdout().flush();
        std::process::exit(EXIT_OUT_OF_MEMORY);
    }

    /// [`PhaseTracker::exit_if_oom`] on an error result, passing every other outcome through.
    pub fn check<T, E: std::fmt::Display>(&self, result: Result<T, E>) -> Result<T, E> {
        if let Err(e) = &result {
            self.exit_if_oom(&e.to_string());
        }
        result
    }

    /// The out-of-memory message: rank, device, phase, memory in use and free, the plan, its
    /// estimate, the nearest plans keeping the global batch, other levers, and the last
    /// checkpoint. A few lines; the first says what happened.
    pub fn report(&self, detail: &str) -> String {
        let facts = self.0.facts.lock().ok().and_then(|f| f.clone());
        let device = facts.as_ref().map_or(Device::Cpu, |f| f.device);
        let mut lines = vec![self.headline(device)];
        lines.push(format!("  libtorch said: {}", first_line(detail)));
        if let Some(f) = &facts {
            lines.extend(remedies(f));
        }
        lines.join("\n")
    }

    fn headline(&self, device: Device) -> String {
        let (u, name) = usage(device);
        let what = if device.is_cuda() {
            "on the device"
        } else {
            "resident"
        };
        format!(
            "out of memory on rank {} ({name}) {} at step {}: {} {what}, {} free of {}",
            self.0.rank.load(Ordering::Relaxed),
            self.phase().description(),
            self.0.step.load(Ordering::Relaxed),
            gib(u.used),
            gib(u.free),
            gib(u.total)
        )
    }
}

impl PhaseSink for PhaseTracker {
    /// Enters `phase`. With a matching `GPTREC_FAULT_OOM`, panics as a libtorch allocation
    /// would.
    fn enter(&self, phase: Phase) {
        self.0.phase.store(phase as u8, Ordering::Relaxed);
        if let Some(Some(f)) = self.0.fault.get() {
            let (rank, step) = (
                self.0.rank.load(Ordering::Relaxed),
                self.0.step.load(Ordering::Relaxed),
            );
            if f.fires(phase, rank, step) {
                panic!("{SIMULATED_OOM}");
            }
        }
    }
}

/// The report's lines after the first two: the plan and its estimate, smaller plans keeping the
/// global batch, other levers, and what a resume would start from.
fn remedies(f: &RunFacts) -> Vec<String> {
    let (config, plan) = (&f.plan.config, &f.plan.batch);
    let shape = f.data.clone().unwrap_or_else(|| DataShape::assumed(config));
    let at = crate::memory::placement(f.device, f.host_ranks);
    let peak = |plan: &BatchPlan| {
        estimate::mib_text(estimate::estimate(config, plan, &shape, at).peak_bytes())
    };
    let mut lines = vec![format!(
        "  batch plan: {} (estimated peak {} per worker)",
        plan.derivation(),
        peak(plan)
    )];
    let smaller: Vec<String> = estimate::smaller_micro_plans(plan)
        .iter()
        .take(3)
        .map(|p| format!("{} (estimate {})", estimate::change_text(plan, p), peak(p)))
        .collect();
    lines.push(if smaller.is_empty() {
        format!(
            "  no smaller micro batch keeps global {} (micro is 1); lower batch.global or use the levers below",
            plan.global
        )
    } else {
        format!(
            "  nearest plans keeping global {}: {}; or batch.micro = \"auto\"",
            plan.global,
            smaller.join("; ")
        )
    });
    let mut levers = estimate::other_levers(config, plan, &shape, at);
    let expandable = ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"]
        .iter()
        .filter_map(|n| std::env::var(n).ok())
        .any(|v| v.contains("expandable_segments:True"));
    if f.device.is_cuda() && !expandable {
        levers.push("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less fragmentation)".into());
    }
    if !levers.is_empty() {
        lines.push(format!("  other levers: {}", levers.join("; ")));
    }
    lines.push(match &f.last_checkpoint {
        Some(path) if config.checkpoint.resume == "never" => format!(
            "  the last checkpoint {path} is intact, but checkpoint.resume = \"never\": a rerun starts over (set it to \"auto\" to continue from that checkpoint)"
        ),
        Some(path) => format!(
            "  nothing was lost: the last checkpoint {path} is intact; a rerun or restart resumes from it"
        ),
        None => "  no checkpoint had been written yet".to_string(),
    });
    lines
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entering_the_fault_phase_panics_with_the_simulated_text_on_its_rank_only() {
        let fault = Fault::parse("eval@1:2").unwrap();
        let (rank0, rank1) = (PhaseTracker::new(), PhaseTracker::new());
        rank0.arm(0, fault.clone());
        rank1.arm(1, fault);
        rank1.set_step(2);
        rank0.set_step(2);
        rank0.enter(Phase::Evaluation);
        assert_eq!(rank0.phase(), Phase::Evaluation);
        let caught = std::panic::catch_unwind(|| rank1.enter(Phase::Evaluation));
        let text = crate::memory::panic_text(caught.unwrap_err().as_ref());
        assert_eq!(text, SIMULATED_OOM);
        // Clones share the state: the phase was recorded before the panic.
        assert_eq!(rank1.clone().phase(), Phase::Evaluation);
    }

    #[test]
    fn the_report_names_rank_phase_step_plan_and_checkpoint() {
        let t = PhaseTracker::new();
        t.arm(3, None);
        t.enter(Phase::Backward);
        t.set_step(17);
        let config = common::config::Config {
            batch: common::batch::BatchSpec {
                global: Some(256),
                micro: Some(64),
                ..Default::default()
            },
            ..Default::default()
        };
        let plan = TrainPlan::resolve("x.toml".as_ref(), config, 2).unwrap();
        let derivation = plan.batch.derivation();
        t.record(RunFacts {
            plan,
            device: Device::Cpu,
            host_ranks: 2,
            data: None,
            last_checkpoint: None,
        });
        t.update(|f| f.last_checkpoint = Some("runs/x/checkpoint".into()));
        let report = t.report("CUDA out of memory. Tried to allocate 2 GiB\nsecond line");
        let lines: Vec<&str> = report.lines().collect();
        assert!(
            lines[0]
                .starts_with("out of memory on rank 3 (cpu) during the backward pass at step 17"),
            "{report}"
        );
        assert_eq!(
            lines[1],
            "  libtorch said: CUDA out of memory. Tried to allocate 2 GiB"
        );
        assert!(lines[2].contains(&derivation), "{report}");
        assert!(
            report.contains("the last checkpoint runs/x/checkpoint is intact; a rerun or restart resumes from it"),
            "{report}"
        );
        // With resume = "never" it does not promise a resume that will not happen.
        t.update(|f| f.plan.config.checkpoint.resume = "never".into());
        let report = t.report("CUDA out of memory.");
        assert!(
            report.contains("but checkpoint.resume = \"never\": a rerun starts over"),
            "{report}"
        );
        assert!(!report.contains("resumes from it"), "{report}");
    }

    #[test]
    fn a_probe_lets_an_out_of_memory_error_pass() {
        let t = PhaseTracker::new();
        // Would exit the test process if the probe did not hold it back.
        let passed = t.probing(|| t.check(Err::<(), _>("CUDA out of memory")).is_err());
        assert!(passed);
        assert!(t.check(Err::<(), _>("a shape mismatch")).is_err());
    }
}
