//! The plan of an elastic job (`--nnodes MIN:MAX`): which node counts keep the configured global
//! batch, the plan of each round the rendezvous forms (ranks, world, the workers' store, the
//! batch re-derived for the new world) and the line that shows what changed. Starts nothing.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

use common::batch::{BatchPlan, BatchSpec};
use common::config::Config;
use common::job_shape::Elastic;
use common::job_terms;
use common::train_plan::TrainPlan;

use super::{Plan, PlanError};
use crate::round::Round;

/// How many node counts an error line explains before "and N more".
const NAMED_REASONS: usize = 3;

/// The plan of the largest node count in MIN..=MAX that keeps `config`'s global batch; an
/// error naming each count's reason when none does.
pub(super) fn largest_plan(
    path: &Path,
    config: Config,
    shape: &Elastic,
    nproc: u32,
) -> Result<TrainPlan, PlanError> {
    let mut reasons = Vec::new();
    let mut more = 0u32;
    for n in (shape.min..=shape.max).rev() {
        match config.batch.resolve_elastic(u64::from(n * nproc)) {
            Ok(batch) => {
                return Ok(TrainPlan {
                    source: path.to_path_buf(),
                    config,
                    batch,
                })
            }
            Err(e) if reasons.len() < NAMED_REASONS => {
                reasons.push(format!("{n} node(s) (world {}): {e}", n * nproc))
            }
            Err(_) => more += 1,
        }
    }
    if more > 0 {
        reasons.push(format!("and {more} more node count(s)"));
    }
    Err(PlanError::Usage(format!(
        "{}: no node count in {}..{} keeps the global batch with {nproc} process(es) per node: {}",
        path.display(),
        shape.min,
        shape.max,
        reasons.join("; ")
    )))
}

/// The node counts in `counts`, at most 8 of them, then how many in all (a range of 65,536
/// counts stays one short line).
pub fn list_counts(counts: impl Iterator<Item = u32>) -> String {
    let mut shown = Vec::new();
    let mut all = 0usize;
    for n in counts {
        if shown.len() < 8 {
            shown.push(n.to_string());
        }
        all += 1;
    }
    match all {
        0 => "none in range".to_string(),
        n if n > shown.len() => format!("{}, ... ({n} in all)", shown.join(", ")),
        _ => shown.join(", "),
    }
}

/// `Ok` when `nodes` nodes of `nproc` processes keep the global batch of `spec` (always, for a
/// program without a config).
pub fn feasible(spec: Option<&BatchSpec>, nproc: u32, nodes: u32) -> Result<(), String> {
    feasible_world(spec, nodes.saturating_mul(nproc))
}

/// `Ok` when a world of `world` processes keeps the global batch of `spec` (nodes may run
/// different numbers of processes: the rendezvous sums theirs).
pub fn feasible_world(spec: Option<&BatchSpec>, world: u32) -> Result<(), String> {
    match spec {
        Some(spec) => spec
            .resolve_elastic(u64::from(world))
            .map(|_| ())
            .map_err(|e| e.to_string()),
        None => Ok(()),
    }
}

impl Plan {
    /// The plan of this node in `round` (node `id`): ranks, world, the workers' store on node
    /// rank 0, and the batch re-derived for the world (passed to the workers as `--set`).
    pub fn for_round(&self, round: &Round, id: u64) -> Result<Plan, String> {
        let node_rank = round
            .node_rank_of(id)
            .ok_or_else(|| format!("node id {id} is not in round {}", round.round))?;
        let mut plan = self.clone();
        let (addr, port) = round.master();
        plan.nnodes = round.nodes.len() as u32;
        plan.node_rank = node_rank;
        plan.first_rank = round.first_rank_of(node_rank);
        plan.nproc = round.nodes[node_rank as usize].nproc;
        plan.world_size = round.world_size();
        plan.master_addr = addr.to_string();
        plan.master_port = port;
        if let Some(train) = plan.config.as_mut() {
            let batch = train
                .config
                .batch
                .resolve_elastic(u64::from(plan.world_size))
                .map_err(|e| e.to_string())?;
            train.batch = batch;
            if !train.config.batch.micro_auto {
                // Before CONFIG, after the user's own --set: the last one wins.
                let at = plan.command.len() - 1;
                let sets: Vec<OsString> = [
                    format!("batch.micro={}", batch.micro),
                    format!("batch.grad_accum={}", batch.grad_accum),
                ]
                .into_iter()
                .flat_map(|set| [OsString::from("--set"), OsString::from(set)])
                .collect();
                plan.command.splice(at..at, sets);
            }
        }
        Ok(plan)
    }

    /// What every node of this job must agree on (`common::job_terms`): the config but for
    /// per-node paths, the data, the program's build, and for a program without a config its
    /// arguments. Processes per node may differ: each round plans the nodes as they are.
    pub fn job_terms(&self) -> job_terms::Terms {
        let mut terms = match &self.config {
            Some(train) => job_terms::of_config(&train.config),
            None => job_terms::Terms::new(),
        };
        if let Some(program) = self.command.first() {
            let path = program_path(program);
            terms.insert("program".into(), job_terms::program_fingerprint(&path));
        }
        if self.config.is_none() {
            let args: Vec<String> = self.command[1..]
                .iter()
                .map(|a| a.to_string_lossy().into_owned())
                .collect();
            terms.insert("program.args".into(), args.join(" "));
        }
        terms
    }

    /// What changed from the previous round's world, e.g. `world 6 -> 4: grad_accum 2 -> 3,
    /// global 1536 kept` (the first round: its plan).
    pub fn round_change(&self, previous: Option<(u32, Option<BatchPlan>)>) -> String {
        let batch = self.config.as_ref().map(|t| t.batch);
        let Some((world, before)) = previous else {
            return match batch {
                Some(b) => format!("world {}: {}", self.world_size, b.derivation()),
                None => format!("world {}", self.world_size),
            };
        };
        let mut line = format!("world {world} -> {}", self.world_size);
        if let (Some(a), Some(b)) = (before, batch) {
            let mut changes = Vec::new();
            if a.micro != b.micro {
                changes.push(format!("micro {} -> {}", a.micro, b.micro));
            }
            if a.grad_accum != b.grad_accum {
                changes.push(format!("grad_accum {} -> {}", a.grad_accum, b.grad_accum));
            }
            changes.push(format!("global {} kept", b.global));
            line.push_str(": ");
            line.push_str(&changes.join(", "));
        }
        line
    }
}

/// `program` as run: a path as given, a bare name looked up on `PATH`.
fn program_path(program: &OsStr) -> PathBuf {
    let path = Path::new(program);
    if path.components().count() > 1 {
        return path.to_path_buf();
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| path.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::round::NodeInfo;

    fn node(id: u64, nproc: u32) -> NodeInfo {
        NodeInfo {
            id,
            addr: format!("10.0.0.{id}"),
            nproc,
            port: 4000 + id as u16,
            host: id == 0,
            terms: String::new(),
            hostname: String::new(),
        }
    }

    fn elastic_plan(dir: &Path) -> Plan {
        use clap::Parser as _;
        let config = dir.join("c.toml");
        std::fs::write(&config, "[batch]\nglobal = 1536\nmicro = 128\n").unwrap();
        let worker = dir.join("worker");
        std::fs::write(&worker, "").unwrap();
        let cli = crate::cli::Cli::try_parse_from([
            "launch",
            "--nnodes",
            "2:3",
            "--num-processes",
            "2",
            "--rdzv-endpoint",
            "127.0.0.1:4999",
            "--run-id",
            "secret",
            "--worker",
            worker.to_str().unwrap(),
            config.to_str().unwrap(),
        ])
        .unwrap();
        Plan::from_cli_and_env(&cli, &Default::default()).unwrap()
    }

    #[test]
    fn each_round_keeps_the_global_batch_and_says_what_changed() {
        let dir = tempfile::tempdir().unwrap();
        let plan = elastic_plan(dir.path());
        // The largest world that keeps 1536: 3 nodes x 2.
        let batch = plan.config.as_ref().unwrap().batch;
        assert_eq!(batch, BatchPlan::new(1536, 128, 2, 6));
        let three = Round {
            round: 0,
            nodes: vec![node(0, 2), node(1, 2), node(2, 2)],
            failures: 0,
            previous_world: None,
        };
        let first = plan.for_round(&three, 2).unwrap();
        assert_eq!((first.node_rank, first.world_size, first.nnodes), (2, 6, 3));
        assert_eq!(
            (first.master_addr.as_str(), first.master_port),
            ("10.0.0.0", 4000)
        );
        let two = Round {
            round: 1,
            nodes: vec![node(0, 2), node(2, 2)],
            failures: 1,
            previous_world: Some(6),
        };
        let second = plan.for_round(&two, 2).unwrap();
        assert_eq!((second.node_rank, second.world_size), (1, 4));
        assert_eq!(
            second.config.as_ref().unwrap().batch,
            BatchPlan::new(1536, 128, 3, 4)
        );
        let words: Vec<String> = second
            .command
            .iter()
            .map(|w| w.to_string_lossy().into_owned())
            .collect();
        let n = words.len();
        assert_eq!(
            words[n - 5..n - 1],
            ["--set", "batch.micro=128", "--set", "batch.grad_accum=3"]
        );
        assert_eq!(
            second.round_change(Some((6, Some(batch)))),
            "world 6 -> 4: grad_accum 2 -> 3, global 1536 kept"
        );
        assert!(plan.for_round(&two, 7).is_err());
    }

    #[test]
    fn node_counts_that_cannot_keep_the_global_batch_are_refused_with_the_reason() {
        let spec = BatchSpec {
            global: Some(256),
            micro: Some(64),
            ..Default::default()
        };
        assert!(feasible(Some(&spec), 2, 2).is_ok());
        let why = feasible(Some(&spec), 2, 3).unwrap_err();
        assert!(why.contains("not divisible by world 6"), "{why}");
        assert!(feasible(None, 2, 3).is_ok());
    }
}
