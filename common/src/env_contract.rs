//! The worker environment contract: the torchrun-compatible variables `launch` sets for every
//! worker and the worker reads back. It owns the variable names and their meaning; it must not
//! decide policy (how many processes, which port) — that is the launcher's plan.

use std::collections::BTreeMap;

/// What one worker process is told about its place in the job (torchrun's names).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerEnv {
    /// `RANK`: global rank, `node_rank * local_world_size + local_rank`.
    pub rank: u32,
    /// `LOCAL_RANK`: rank on this node; also the CUDA device index among the visible ones.
    pub local_rank: u32,
    /// `WORLD_SIZE`: processes in the whole job.
    pub world_size: u32,
    /// `LOCAL_WORLD_SIZE`: processes on this node.
    pub local_world_size: u32,
    /// `GROUP_RANK`: this node's rank (torchrun's agent group rank).
    pub group_rank: u32,
    /// `GROUP_WORLD_SIZE`: number of nodes.
    pub group_world_size: u32,
    /// `MASTER_ADDR`: host of rank 0's rendezvous store.
    pub master_addr: String,
    /// `MASTER_PORT`: port of rank 0's rendezvous store.
    pub master_port: u16,
    /// `TORCHELASTIC_RESTART_COUNT`: how many times the group has been restarted so far.
    pub restart_count: u32,
    /// `TORCHELASTIC_MAX_RESTARTS`: the restart budget.
    pub max_restarts: u32,
    /// `TORCHELASTIC_RUN_ID`: shared by every worker of one job; the store checks it.
    pub run_id: String,
}

/// The CUDA caching allocator's setting every worker runs with unless the user chose one:
/// growable segments instead of fixed blocks, far less fragmentation.
pub const DEFAULT_CUDA_ALLOC_CONF: &str = "expandable_segments:True";

/// The allocator variable to set when the user set neither `PYTORCH_CUDA_ALLOC_CONF` nor its
/// newer name `PYTORCH_ALLOC_CONF` (PyTorch 2.9+): `launch` passes it to its workers, and a
/// worker started by another launcher (torchrun) sets it itself before CUDA starts.
pub fn alloc_conf_default(is_set: impl Fn(&str) -> bool) -> Option<(&'static str, &'static str)> {
    let user_chose = ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"]
        .iter()
        .any(|name| is_set(name));
    (!user_chose).then_some(("PYTORCH_CUDA_ALLOC_CONF", DEFAULT_CUDA_ALLOC_CONF))
}

/// `ROLE_NAME` value; we have one role, as torchrun does by default.
pub const ROLE_NAME: &str = "default";

/// How a worker's last stderr line begins when it stopped because another rank of the job ended
/// first (`runtime::job_watch`): the line goes on to name that rank. Its launcher then knows
/// that the failure it saw is not its node's own.
pub const STOPPED_FOR_PEER: &str = "worker: error: stopping: ";

/// Exit code of a worker that an elastic `launch` asked (SIGUSR1) to stop at its next
/// checkpoint so that the group can re-form with a node that waits to join, and that did:
/// not a failure (EX_TEMPFAIL, "try again").
pub const EXIT_REGROUP: i32 = 75;

/// The variable naming the file that `launch` writes before it passes a SIGTERM it received
/// (a preemption) on to our worker. With it, a SIGTERM during training stops every rank at a
/// checkpoint when the file appears (within a quarter of a second), and ends the worker at once
/// when it does not (a teardown after a failure); without it (torchrun, by hand), SIGTERM ends
/// the worker, as it always did.
pub const PREEMPT_FILE_VAR: &str = "LAUNCH_PREEMPT_FILE";

/// The variable naming the descriptor of the rendezvous port's listening socket, which `launch`
/// binds before it starts anything and holds for the whole job, and hands to rank 0 of our
/// worker as its store's listener: no other process can take the port in between (two jobs
/// started at once on one box no longer race for it). Absent: rank 0 binds `MASTER_PORT` itself.
pub const STORE_FD_VAR: &str = "GPTREC_STORE_FD";

/// The descriptor number `launch` gives that socket in rank 0 (3 is the progress pipe's).
pub const STORE_FD: i32 = 4;

/// The variable giving every rank of the node whose `launch` holds that socket its address
/// (`IP:PORT`): what accepts a connection there is rank 0's own listener even before rank 0
/// serves it (the kernel accepts for it), so a rank that meets silence there waits for a slow
/// or stopped rank 0 until the rendezvous deadline instead of taking it for a stranger on the
/// port after 10 s. Absent (other nodes, torchrun): silence after 10 s is a stranger.
pub const STORE_HELD_VAR: &str = "GPTREC_STORE_HELD";

/// The variables a worker cannot do without (the others have defaults).
const REQUIRED: [&str; 5] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
];

/// Every variable of the contract, in the order they are documented and printed.
pub const VARIABLES: [&str; 14] = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
];

/// A variable of the contract that is missing or unusable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EnvError {
    #[error(
        "environment variable {name} is not set (a worker needs all of RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, as `launch` and torchrun set them, or none of them to run as one process)"
    )]
    Missing { name: &'static str },
    #[error("environment variable {name}={value:?} is not {expected}")]
    Invalid {
        name: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("inconsistent environment: {0}")]
    Inconsistent(String),
}

impl WorkerEnv {
    /// The contract of rank `rank` in a single-node, first-attempt job of `world_size` ranks
    /// (local ranks equal global ranks), as `launch` gives it on one machine.
    pub fn single_node(
        rank: u32,
        world_size: u32,
        master_addr: &str,
        master_port: u16,
        run_id: &str,
    ) -> WorkerEnv {
        WorkerEnv {
            rank,
            local_rank: rank,
            world_size,
            local_world_size: world_size,
            group_rank: 0,
            group_world_size: 1,
            master_addr: master_addr.to_string(),
            master_port,
            restart_count: 0,
            max_restarts: 0,
            run_id: run_id.to_string(),
        }
    }

    /// The variables as (name, value) pairs, in [`VARIABLES`] order.
    pub fn to_vars(&self) -> Vec<(&'static str, String)> {
        vec![
            ("RANK", self.rank.to_string()),
            ("LOCAL_RANK", self.local_rank.to_string()),
            ("WORLD_SIZE", self.world_size.to_string()),
            ("LOCAL_WORLD_SIZE", self.local_world_size.to_string()),
            ("GROUP_RANK", self.group_rank.to_string()),
            ("GROUP_WORLD_SIZE", self.group_world_size.to_string()),
            // One role: role ranks are the global ranks.
            ("ROLE_RANK", self.rank.to_string()),
            ("ROLE_WORLD_SIZE", self.world_size.to_string()),
            ("ROLE_NAME", ROLE_NAME.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
            ("TORCHELASTIC_RESTART_COUNT", self.restart_count.to_string()),
            ("TORCHELASTIC_MAX_RESTARTS", self.max_restarts.to_string()),
            ("TORCHELASTIC_RUN_ID", self.run_id.clone()),
        ]
    }

    /// Reads the contract from the process environment.
    pub fn from_env() -> Result<Self, EnvError> {
        let vars: BTreeMap<String, String> = std::env::vars().collect();
        Self::from_map(&vars)
    }

    /// The contract from the process environment, or — when none of the variables a worker
    /// needs is set (started by hand, not by `launch` or torchrun) — a single process, rank 0 of
    /// 1, as accelerate and Lightning scripts run alone. The flag says which.
    pub fn from_env_or_single() -> Result<(Self, bool), EnvError> {
        let vars: BTreeMap<String, String> = std::env::vars().collect();
        Self::from_map_or_single(&vars, std::process::id())
    }

    /// [`WorkerEnv::from_env_or_single`] from a map; `pid` names the single process's run.
    pub fn from_map_or_single(
        vars: &BTreeMap<String, String>,
        pid: u32,
    ) -> Result<(Self, bool), EnvError> {
        if REQUIRED.iter().any(|name| vars.contains_key(*name)) {
            return Self::from_map(vars).map(|env| (env, false));
        }
        // Port 0: the store of a world of one listens wherever the OS says.
        let env = WorkerEnv::single_node(0, 1, "127.0.0.1", 0, &format!("single-{pid}"));
        Ok((env, true))
    }

    /// Reads the contract from a map of variables (testable without touching the process env).
    /// Only the variables the worker needs are required; torchrun sets them all too.
    pub fn from_map(vars: &BTreeMap<String, String>) -> Result<Self, EnvError> {
        let get = |name: &'static str| vars.get(name).ok_or(EnvError::Missing { name });
        let num = |name: &'static str| -> Result<u32, EnvError> {
            let value = get(name)?;
            value.trim().parse().map_err(|_| EnvError::Invalid {
                name,
                value: value.clone(),
                expected: "a non-negative integer",
            })
        };
        let opt_num = |name: &'static str, default: u32| -> Result<u32, EnvError> {
            if vars.contains_key(name) {
                num(name)
            } else {
                Ok(default)
            }
        };
        let rank = num("RANK")?;
        let world_size = num("WORLD_SIZE")?;
        let local_rank = num("LOCAL_RANK")?;
        let local_world_size = opt_num("LOCAL_WORLD_SIZE", world_size)?;
        let master_port_text = get("MASTER_PORT")?;
        let master_port = master_port_text
            .trim()
            .parse()
            .map_err(|_| EnvError::Invalid {
                name: "MASTER_PORT",
                value: master_port_text.clone(),
                expected: "a port number (0-65535)",
            })?;
        let env = WorkerEnv {
            rank,
            local_rank,
            world_size,
            local_world_size,
            group_rank: opt_num("GROUP_RANK", 0)?,
            group_world_size: opt_num("GROUP_WORLD_SIZE", 1)?,
            master_addr: get("MASTER_ADDR")?.clone(),
            master_port,
            restart_count: opt_num("TORCHELASTIC_RESTART_COUNT", 0)?,
            max_restarts: opt_num("TORCHELASTIC_MAX_RESTARTS", 0)?,
            run_id: vars
                .get("TORCHELASTIC_RUN_ID")
                .cloned()
                .unwrap_or_else(|| "none".to_string()),
        };
        env.check()?;
        Ok(env)
    }

    fn check(&self) -> Result<(), EnvError> {
        if self.world_size == 0 {
            return Err(EnvError::Inconsistent("WORLD_SIZE is 0".into()));
        }
        if self.rank >= self.world_size {
            return Err(EnvError::Inconsistent(format!(
                "RANK {} is not below WORLD_SIZE {}",
                self.rank, self.world_size
            )));
        }
        if self.local_rank >= self.local_world_size {
            return Err(EnvError::Inconsistent(format!(
                "LOCAL_RANK {} is not below LOCAL_WORLD_SIZE {}",
                self.local_rank, self.local_world_size
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> WorkerEnv {
        WorkerEnv {
            rank: 3,
            local_rank: 1,
            world_size: 4,
            local_world_size: 2,
            group_rank: 1,
            group_world_size: 2,
            master_addr: "10.0.0.1".into(),
            master_port: 29500,
            restart_count: 1,
            max_restarts: 2,
            run_id: "job7".into(),
        }
    }

    fn as_map(env: &WorkerEnv) -> BTreeMap<String, String> {
        env.to_vars()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect()
    }

    /// Why [`WorkerEnv::from_map`] refuses the sample's variables with `name` set to `value`.
    fn error_with(name: &str, value: &str) -> String {
        let mut map = as_map(&sample());
        map.insert(name.into(), value.into());
        WorkerEnv::from_map(&map).unwrap_err().to_string()
    }

    #[test]
    fn round_trips_through_variables() {
        let env = sample();
        let vars = env.to_vars();
        assert_eq!(
            vars.iter().map(|(k, _)| *k).collect::<Vec<_>>(),
            VARIABLES.to_vec()
        );
        assert_eq!(WorkerEnv::from_map(&as_map(&env)), Ok(env));
    }

    #[test]
    fn role_variables_follow_global_ranks() {
        let map = as_map(&sample());
        assert_eq!(map["ROLE_RANK"], "3");
        assert_eq!(map["ROLE_WORLD_SIZE"], "4");
        assert_eq!(map["ROLE_NAME"], "default");
    }

    #[test]
    fn missing_and_invalid_variables_are_named() {
        let mut map = as_map(&sample());
        map.remove("RANK");
        assert_eq!(
            WorkerEnv::from_map(&map),
            Err(EnvError::Missing { name: "RANK" })
        );
        let err = error_with("MASTER_PORT", "http");
        assert!(err.contains("MASTER_PORT=\"http\""), "{err}");
    }

    #[test]
    fn no_launch_variables_at_all_is_a_single_process() {
        let mut map = BTreeMap::new();
        map.insert("PATH".to_string(), "/bin".to_string());
        map.insert("OMP_NUM_THREADS".to_string(), "2".to_string());
        let (env, single) = WorkerEnv::from_map_or_single(&map, 77).unwrap();
        assert!(single);
        assert_eq!((env.rank, env.world_size, env.local_world_size), (0, 1, 1));
        assert_eq!((env.master_port, env.run_id.as_str()), (0, "single-77"));
        // One variable of the contract makes it a launched worker: the rest must be there.
        map.insert("WORLD_SIZE".to_string(), "2".to_string());
        assert_eq!(
            WorkerEnv::from_map_or_single(&map, 77),
            Err(EnvError::Missing { name: "RANK" })
        );
        let full = as_map(&sample());
        assert_eq!(
            WorkerEnv::from_map_or_single(&full, 77),
            Ok((sample(), false))
        );
    }

    #[test]
    fn rank_outside_world_is_rejected() {
        let err = error_with("RANK", "4");
        assert!(err.contains("RANK 4 is not below WORLD_SIZE 4"), "{err}");
    }

    #[test]
    fn the_allocator_default_yields_to_either_user_setting() {
        assert_eq!(
            alloc_conf_default(|_| false),
            Some(("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"))
        );
        assert_eq!(alloc_conf_default(|n| n == "PYTORCH_CUDA_ALLOC_CONF"), None);
        assert_eq!(alloc_conf_default(|n| n == "PYTORCH_ALLOC_CONF"), None);
    }
}
