//! `launch` under a real Slurm 22.05 (no mocks): every test starts its own cluster on this
//! machine (tests/slurm/minicluster.sh through support::slurm: munged, slurmctld, one slurmd
//! per emulated node n0, n1, ...) and submits the shipped `scripts/slurm/train.sbatch` with
//! `sbatch --wait`. The nodes' tasks run here too, so they share the test's temporary
//! directories. Without root, Slurm or `unshare -m`, each test prints one `skipping:` line.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use support::slurm::{
    wait_no_processes_with_env, Job, Options, SlurmCluster, Submitted, JOB_TIMEOUT,
};
use support::*;

/// How long the processes of a finished (or failed) job may take to disappear.
const CLEANUP: Duration = Duration::from_secs(5);

/// A submit directory laid out like the repository (`target/release/launch`, `configs/`), so
/// the shipped script runs with its defaults: it finds `launch` through $SLURM_SUBMIT_DIR and
/// writes `slurm-gptrec-<job>.out` and `logs/slurm-<job>/` there, not into the checkout.
struct SubmitDir {
    dir: tempfile::TempDir,
}

impl SubmitDir {
    fn new() -> SubmitDir {
        let dir = tempfile::tempdir().unwrap();
        let release = dir.path().join("target/release");
        std::fs::create_dir_all(&release).unwrap();
        // launch finds `worker` next to its real path (/proc/self/exe resolves the link).
        std::os::unix::fs::symlink(bin("launch"), release.join("launch")).unwrap();
        bin("worker");
        std::os::unix::fs::symlink(repo_root().join("configs"), dir.path().join("configs"))
            .unwrap();
        SubmitDir { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The job's output file (`#SBATCH --output=slurm-%x-%j.out`, job name gptrec).
    fn job_output(&self, job: u64) -> String {
        let path = self.path().join(format!("slurm-gptrec-{job}.out"));
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    fn log_dir(&self, job: u64) -> PathBuf {
        self.path().join(format!("logs/slurm-{job}"))
    }

    fn runs(&self) -> PathBuf {
        self.path().join("runs")
    }
}

fn train_sbatch() -> String {
    repo_root()
        .join("scripts/slurm/train.sbatch")
        .display()
        .to_string()
}

/// `sbatch` arguments for the shipped script on the tiny config, 2 processes per node,
/// writing its run into `output_dir`.
fn tiny_job_args(sbatch_opts: &[&str], output_dir: &Path) -> Vec<String> {
    let mut args: Vec<String> = sbatch_opts.iter().map(|s| s.to_string()).collect();
    args.push(train_sbatch());
    args.extend(["configs/default.toml", "--num-processes", "2"].map(String::from));
    args.extend(tiny_bpr_sets(output_dir));
    args.extend(["--set", "eval.patience=0"].map(String::from));
    args
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// What a worker prints first: `worker rank R/W (local l/L, node n/N), pid P, rendezvous
/// HOST:PORT run id ID, restart a/b`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct WorkerStart {
    rank: u32,
    world: u32,
    node: u32,
    nodes: u32,
    host: String,
    port: u16,
}

fn parse_worker_start(text: &str) -> Option<WorkerStart> {
    let rest = text.trim_start().strip_prefix("worker rank ")?;
    let (rank_world, rest) = rest.split_once(' ')?;
    let (rank, world) = rank_world.split_once('/')?;
    let node_part = rest.split("node ").nth(1)?;
    let (node_nodes, _) = node_part.split_once(')')?;
    let (node, nodes) = node_nodes.split_once('/')?;
    let rdzv = rest.split("rendezvous ").nth(1)?;
    let (endpoint, _) = rdzv.split_once(' ')?;
    let (host, port) = endpoint.rsplit_once(':')?;
    Some(WorkerStart {
        rank: rank.parse().ok()?,
        world: world.parse().ok()?,
        node: node.parse().ok()?,
        nodes: nodes.parse().ok()?,
        host: host.to_string(),
        port: port.parse().ok()?,
    })
}

/// The workers' start lines of a job's output, by rank.
fn worker_starts(output: &str) -> BTreeMap<u32, WorkerStart> {
    let mut starts = BTreeMap::new();
    for (rank, text) in rank_lines(output) {
        if let Some(start) = parse_worker_start(&text) {
            assert_eq!(start.rank, rank, "[rank {rank}] prefix vs {text:?}");
            assert!(
                starts.insert(rank, start).is_none(),
                "rank {rank} started twice:\n{output}"
            );
        }
    }
    starts
}

/// Asserts that nothing of the run is left: no worker (TORCHELASTIC_RUN_ID) and nothing else
/// that got the job's LAUNCH_RUN_ID (batch script, srun, launch, watchdogs).
fn assert_nothing_left(run_id: &str, timeout: Duration) {
    let start = Instant::now();
    let workers = wait_no_processes(run_id, timeout);
    assert!(
        workers.is_empty(),
        "workers of run {run_id} still running {:?} after the job ended: {workers:?}",
        start.elapsed()
    );
    let left = wait_no_processes_with_env("LAUNCH_RUN_ID", run_id, timeout);
    assert!(
        left.is_empty(),
        "processes of run {run_id} still running {:?} after the job ended: {left:#?}",
        start.elapsed()
    );
}

/// Panics unless the job output has train.sbatch's line for the job's first start.
#[track_caller]
fn assert_first_start(job: u64, output: &str) {
    assert!(
        output.contains(&format!("train.sbatch: job {job} first start")),
        "{output}"
    );
}

/// Panics, showing the job and its output, unless the job exited 0.
#[track_caller]
fn assert_job_succeeded(job: &Job, output: &str) {
    assert_eq!(job.code(), Some(0), "{job}\n--- job output\n{output}");
}

/// One test's Slurm cluster, submit directory and run id (the job's LAUNCH_RUN_ID).
struct JobSetup {
    // Fields drop in this order: the submit directory before the cluster.
    submit: SubmitDir,
    run_id: String,
    cluster: SlurmCluster,
}

impl JobSetup {
    /// A submit directory and a fresh run id tagged `tag` next to `cluster`; `None` where the
    /// cluster could not start (it printed why).
    fn new(cluster: Option<SlurmCluster>, tag: &str) -> Option<JobSetup> {
        let cluster = cluster?;
        let submit = SubmitDir::new();
        let run_id = unique_run_id(tag);
        Some(JobSetup {
            submit,
            run_id,
            cluster,
        })
    }

    /// `sbatch` arguments of the tiny job on 2 nodes (see [`tiny_job_args`]) into `runs/`.
    fn tiny_args(&self) -> Vec<String> {
        tiny_job_args(&["-N2"], &self.submit.runs())
    }

    /// Starts `sbatch ARGS` from the submit directory with the run id as LAUNCH_RUN_ID.
    fn sbatch(&self, args: &[String]) -> Submitted<'_> {
        self.cluster.sbatch(
            self.submit.path(),
            &refs(args),
            &[("LAUNCH_RUN_ID", &self.run_id)],
        )
    }

    /// Runs `sbatch ARGS` from the submit directory with the run id as LAUNCH_RUN_ID and `env`
    /// to its end; the job and its output file.
    fn run(&self, args: &[&str], env: &[(&str, &str)]) -> (Job, String) {
        let mut job_env = vec![("LAUNCH_RUN_ID", self.run_id.as_str())];
        job_env.extend_from_slice(env);
        let job = self
            .cluster
            .sbatch_wait_in(self.submit.path(), args, &job_env, JOB_TIMEOUT);
        let output = self.submit.job_output(job.id);
        (job, output)
    }

    /// [`JobSetup::run`] on the tiny job's arguments (see [`JobSetup::tiny_args`]).
    fn run_tiny(&self, env: &[(&str, &str)]) -> (Job, String) {
        self.run(&refs(&self.tiny_args()), env)
    }

    /// Asserts that nothing of the run is left within [`CLEANUP`].
    fn assert_nothing_left(&self) {
        assert_nothing_left(&self.run_id, CLEANUP);
    }
}

/// The harness itself: a two-node job runs one task on each node, node names resolve inside
/// jobs, and sbatch --wait returns the job's exit code.
#[test]
fn harness_runs_a_two_node_job() {
    let Some(cluster) = SlurmCluster::start(2, 2, 0) else {
        return;
    };
    let out = tempfile::tempdir().unwrap();
    let output = out.path().join("job-%j.out");
    let job = cluster.sbatch_wait(
        &[
            "-N2",
            "--ntasks-per-node=1",
            "-o",
            output.to_str().unwrap(),
            "--wrap",
            "srun -N2 bash -c 'echo \"task $SLURM_PROCID node $SLURMD_NODENAME nodeid $SLURM_NODEID step ${SLURM_STEP_ID-none}\"; getent hosts n0 n1 | sed \"s/^/host /\"'",
        ],
        &[],
    );
    assert_eq!(job.code(), Some(0), "{job}\n{}", cluster.logs());
    let text = std::fs::read_to_string(out.path().join(format!("job-{}.out", job.id))).unwrap();
    assert!(text.contains("task 0 node n0 nodeid 0 step 0"), "{text}");
    assert!(text.contains("task 1 node n1 nodeid 1 step 0"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("host 127.0.0.1") && l.contains("n0")),
        "n0 does not resolve inside the job:\n{text}"
    );
    assert!(
        job.id >= cluster.first_job_id && job.id < cluster.first_job_id + 10,
        "job id {} outside this cluster's range from {}",
        job.id,
        cluster.first_job_id
    );
    let failing = cluster.sbatch_wait(
        &[
            "-N1",
            "-o",
            "/dev/null",
            "--wrap",
            "srun -N1 sh -c 'exit 7'",
        ],
        &[],
    );
    assert_eq!(failing.code(), Some(7), "{failing}");
}

/// Stopping a cluster leaves nothing running: its daemons, a running job, and a process that
/// left its job's process tree (double fork + setsid) are all gone after Drop.
#[test]
fn harness_stop_leaves_nothing_running() {
    let Some(cluster) = SlurmCluster::start(2, 2, 0) else {
        return;
    };
    let marker = unique_run_id("slurm-stop");
    let out = tempfile::tempdir().unwrap();
    let mut submitted = cluster.sbatch(
        out.path(),
        &[
            "-N2",
            "--ntasks-per-node=1",
            "-o",
            "/dev/null",
            "--wrap",
            "srun -N2 bash -c '(setsid sleep 300 </dev/null >/dev/null 2>&1 &); sleep 300'",
        ],
        &[("GPTREC_SLURM_MARKER", &marker)],
    );
    let id = submitted.id(Duration::from_secs(10));
    let start = Instant::now();
    // Per node: the step's sleep and the escaped one.
    let sleeps = || {
        processes_with_env("GPTREC_SLURM_MARKER", &marker)
            .into_iter()
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| c.starts_with(b"sleep\0"))
            })
            .count()
    };
    while sleeps() < 4 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "job {id} never started all its processes: {:?}\n{}",
            processes_with_env("GPTREC_SLURM_MARKER", &marker),
            cluster.show_job(id)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let daemons: Vec<i32> = std::fs::read_to_string(cluster.dir.join("pids"))
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1)?.parse().ok())
        .collect();
    assert_eq!(daemons.len(), 4, "munged, slurmctld, 2 slurmd");
    let conf = cluster.conf().display().to_string();
    drop(submitted);
    drop(cluster);
    let left = wait_no_processes_with_env("GPTREC_SLURM_MARKER", &marker, Duration::from_secs(2));
    assert!(left.is_empty(), "job processes left after stop: {left:#?}");
    let left = wait_no_processes_with_env("SLURM_CONF", &conf, Duration::from_secs(2));
    assert!(
        left.is_empty(),
        "processes of the cluster left after stop: {left:#?}"
    );
    for pid in daemons {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat
            .rsplit_once(") ")
            .map(|(_, r)| &r[..1])
            .unwrap_or("gone");
        assert!(
            state == "gone" || state == "Z",
            "daemon {pid} still running after stop: {stat}"
        );
    }
}

/// The shipped script on 2 nodes x 2 processes: one launch per node, world size 4 with ranks
/// 0-3 spread over both nodes, rank 0 alone writes checkpoints, the run is named after the job,
/// and nothing of it is left when the job has ended.
#[test]
fn train_sbatch_two_nodes_two_processes() {
    let Some(setup) = JobSetup::new(SlurmCluster::start(2, 2, 0), "slurm-train") else {
        return;
    };
    let (submit, run_id) = (&setup.submit, &setup.run_id);
    let (job, output) = setup.run_tiny(&[]);
    assert_job_succeeded(&job, &output);
    assert_first_start(job.id, &output);

    // World size 4: ranks 0, 1 on node 0 and 2, 3 on node 1, one rendezvous on the first node.
    let starts = worker_starts(&output);
    assert_eq!(
        starts.keys().copied().collect::<Vec<_>>(),
        vec![0, 1, 2, 3],
        "{output}"
    );
    for (rank, s) in &starts {
        assert_eq!((s.world, s.nodes), (4, 2), "rank {rank}: {s:?}\n{output}");
        assert_eq!(
            s.node,
            rank / 2,
            "rank {rank} on node {}:\n{output}",
            s.node
        );
        assert_eq!(s.host, "n0", "rank {rank}: rendezvous {s:?}\n{output}");
        assert_eq!(s.port, starts[&0].port, "rank {rank}: {s:?}\n{output}");
    }
    // One launch per node: each reports the batch plan once.
    let plans = output
        .lines()
        .filter(|l| l.starts_with("launch: configs/default.toml: micro"))
        .count();
    assert_eq!(plans, 2, "expected one launch per node:\n{output}");

    // Per-rank logs in logs/slurm-<job>/, each starting with its own rank of 4.
    let logs = submit.log_dir(job.id);
    let mut writers = BTreeSet::new();
    // The run id is the secret that admits a connection to the store: never in a log.
    assert!(
        !output.contains(run_id),
        "the job output shows the run id:\n{output}"
    );
    for rank in 0..4 {
        let path = logs.join(format!("rank-{rank}.log"));
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}\n{output}", path.display()));
        assert!(
            !text.contains(run_id),
            "{} shows the run id",
            path.display()
        );
        let first = text.lines().next().unwrap_or_default();
        let start = parse_worker_start(first)
            .unwrap_or_else(|| panic!("{}: first line {first:?}", path.display()));
        assert_eq!((start.rank, start.world), (rank, 4), "{}", path.display());
        if text.lines().any(|l| l.contains("INFO checkpoint ")) {
            writers.insert(rank);
        }
    }
    // Exactly one checkpoint writer, rank 0, and its checkpoint is in the job's run.
    assert_eq!(writers, BTreeSet::from([0]), "ranks that wrote checkpoints");
    let run_dir = submit.runs().join(format!("slurm-{}", job.id));
    let latest = std::fs::read_to_string(run_dir.join("checkpoints/latest"))
        .unwrap_or_else(|e| panic!("{}: {e}\n{output}", run_dir.display()));
    assert!(
        run_dir.join("checkpoints").join(latest.trim()).is_dir(),
        "checkpoints/latest names {latest:?}"
    );
    let checkpoint_lines: Vec<(u32, String)> = rank_lines(&output)
        .into_iter()
        .filter(|(_, t)| t.contains("INFO checkpoint "))
        .collect();
    assert!(
        !checkpoint_lines.is_empty() && checkpoint_lines.iter().all(|(r, _)| *r == 0),
        "{checkpoint_lines:?}"
    );

    setup.assert_nothing_left();
}

/// A rank on node 1 fails (simulated out of memory, exit code 3): the job fails, its output
/// names rank 3 as the root cause, and within seconds nothing of the run is left on any node.
#[test]
fn failing_rank_on_node_1_ends_the_job() {
    let Some(setup) = JobSetup::new(SlurmCluster::start(2, 2, 0), "slurm-fail") else {
        return;
    };
    let (job, output) = setup.run_tiny(&[("GPTREC_FAULT_OOM", "forward@3:2")]);
    assert!(
        job.code().is_some_and(|c| c != 0),
        "the job should fail: {job}\n--- job output\n{output}"
    );
    assert!(
        output.contains("root cause: rank 3 "),
        "launch should name rank 3 as the root cause:\n{output}"
    );
    assert!(
        !output.contains("] summary:"),
        "the run should not have finished:\n{output}"
    );
    // Far from the collectives' timeout: the failure ended the step on both nodes at once.
    assert!(
        job.elapsed < Duration::from_secs(60),
        "the failed job took {:?}:\n{output}",
        job.elapsed
    );
    setup.assert_nothing_left();
}

/// Two 2-node jobs at the same time on the same nodes both train, each on its own rendezvous
/// port (derived from its job id).
#[test]
fn two_jobs_at_once_get_distinct_ports() {
    let Some(cluster) = SlurmCluster::start(2, 4, 0) else {
        return;
    };
    let submit = SubmitDir::new();
    let run_ids = [unique_run_id("slurm-two-a"), unique_run_id("slurm-two-b")];
    let outs = [submit.path().join("runs-a"), submit.path().join("runs-b")];
    // Held at submission and released together, so both start in the same scheduling pass.
    let args: Vec<Vec<String>> = outs
        .iter()
        .map(|o| tiny_job_args(&["-N2", "--hold"], o))
        .collect();
    let mut jobs: Vec<_> = (0..2)
        .map(|i| {
            cluster.sbatch(
                submit.path(),
                &refs(&args[i]),
                &[("LAUNCH_RUN_ID", &run_ids[i])],
            )
        })
        .collect();
    let ids: Vec<u64> = jobs
        .iter_mut()
        .map(|j| j.id(Duration::from_secs(10)))
        .collect();
    let release = cluster
        .command("scontrol")
        .args(["release", &format!("{},{}", ids[0], ids[1])])
        .output()
        .unwrap();
    assert!(release.status.success(), "{release:?}");

    // Both running at once (each takes a few seconds).
    let start = Instant::now();
    let mut together = false;
    while start.elapsed() < JOB_TIMEOUT && !together {
        let out = cluster
            .command("squeue")
            .args(["-h", "-t", "RUNNING", "-o", "%i"])
            .output()
            .unwrap();
        let running: BTreeSet<u64> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        together = ids.iter().all(|id| running.contains(id));
        if !together && ids.iter().all(|id| !cluster.active_jobs().contains(id)) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }

    let finished: Vec<_> = jobs.into_iter().map(|j| j.wait(JOB_TIMEOUT)).collect();
    let mut ports = Vec::new();
    for (job, run_id) in finished.iter().zip(&run_ids) {
        let output = submit.job_output(job.id);
        assert_job_succeeded(job, &output);
        let starts = worker_starts(&output);
        assert_eq!(starts.len(), 4, "job {}:\n{output}", job.id);
        let job_ports: BTreeSet<u16> = starts.values().map(|s| s.port).collect();
        assert_eq!(
            job_ports.len(),
            1,
            "job {}: ranks disagree on the port:\n{output}",
            job.id
        );
        ports.push(*job_ports.iter().next().unwrap());
        assert_nothing_left(run_id, CLEANUP);
    }
    assert!(together, "jobs {ids:?} never ran at the same time");
    assert_ne!(
        ports[0], ports[1],
        "jobs {ids:?} used the same rendezvous port"
    );
}

/// A job requeued while it trains (`scontrol requeue`, as after a node failure or preemption)
/// keeps its job id, so train.sbatch gives it the same run name: the second start says it is a
/// restart, resumes from the checkpoint the first one wrote, finishes, and the rank logs and
/// the job output are appended to, not replaced.
#[test]
fn requeued_job_resumes_from_its_checkpoint() {
    // A short credential lifetime: a requeued job may start again after it (Slurm: 120 s).
    let options = Options {
        nodes: 2,
        cpus_per_node: 2,
        gpus_per_node: 0,
        cred_expire_s: Some(5),
    };
    let Some(setup) = JobSetup::new(SlurmCluster::start_with(options), "slurm-requeue") else {
        return;
    };
    let (cluster, submit) = (&setup.cluster, &setup.submit);
    let mut args = setup.tiny_args();
    // Long enough to requeue it while it trains; a checkpoint every 10 steps (23 per epoch).
    args.extend(
        [
            "--set",
            "train.epochs=12",
            "--set",
            "checkpoint.every_n_steps=10",
        ]
        .map(String::from),
    );
    let mut submitted = setup.sbatch(&args);
    let id = submitted.id(Duration::from_secs(10));
    let rank0 = submit.log_dir(id).join("rank-0.log");
    let run_dir = submit.runs().join(format!("slurm-{id}"));
    let start = Instant::now();
    let first_checkpoint = loop {
        let log = std::fs::read_to_string(&rank0).unwrap_or_default();
        if let Some(line) = log
            .lines()
            .find(|l| l.contains("INFO checkpoint ") && l.contains("/checkpoints/step-"))
        {
            break line.to_string();
        }
        assert!(
            !log.contains("summary:"),
            "the run finished before it could be requeued:\n{log}"
        );
        assert!(
            start.elapsed() < JOB_TIMEOUT,
            "no checkpoint within {JOB_TIMEOUT:?}:\n{log}\n{}",
            cluster.show_job(id)
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let requeue = cluster
        .command("scontrol")
        .args(["requeue", &id.to_string()])
        .output()
        .unwrap();
    assert!(
        requeue.status.success(),
        "scontrol requeue {id}: {requeue:?}\n{}",
        cluster.show_job(id)
    );
    let job = submitted.wait(JOB_TIMEOUT);
    let output = submit.job_output(id);
    assert_job_succeeded(&job, &output);
    assert_eq!(job.id, id);
    assert_first_start(id, &output);
    assert!(
        output.contains(&format!("train.sbatch: job {id} restart 1 (requeued)")),
        "{output}"
    );
    // The second start resumed the same run (named after the job) from a checkpoint.
    let resumed: Vec<&str> = output
        .lines()
        .filter(|l| l.starts_with("[rank 0]") && l.contains("INFO resuming from "))
        .collect();
    assert_eq!(resumed.len(), 1, "{first_checkpoint}\n{output}");
    assert!(
        resumed[0].contains(&format!("/slurm-{id}/checkpoints/step-")),
        "{}",
        resumed[0]
    );
    assert!(output.contains("] summary:"), "{output}");
    // Appended across the restart: both starts of every rank are in its log.
    for rank in 0..4 {
        let path = submit.log_dir(id).join(format!("rank-{rank}.log"));
        let text = std::fs::read_to_string(&path).unwrap();
        let starts = text
            .lines()
            .filter(|l| parse_worker_start(l).is_some())
            .count();
        assert_eq!(starts, 2, "{}:\n{text}", path.display());
    }
    let runs: Vec<String> = std::fs::read_dir(submit.runs())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != "data")
        .collect();
    assert_eq!(runs, vec![format!("slurm-{id}")], "one run directory");
    assert!(run_dir.join("checkpoints/latest").is_file());
    setup.assert_nothing_left();
}

/// With GPUs (fake ones: Slurm's gres on dummy devices) and no --num-processes, launch starts
/// one worker per GPU Slurm gave the step on each node; a program after `--` runs with the
/// torchrun environment (and gets no run.name).
#[test]
fn train_sbatch_takes_processes_from_slurm_gpus() {
    let Some(setup) = JobSetup::new(SlurmCluster::start(2, 2, 2), "slurm-gpus") else {
        return;
    };
    let (job, output) = setup.run(
        &[
            "-N2",
            "--gpus-per-node=2",
            &train_sbatch(),
            "--",
            "sh",
            "-c",
            "echo \"env RANK=$RANK LOCAL_RANK=$LOCAL_RANK WORLD_SIZE=$WORLD_SIZE GROUP_RANK=$GROUP_RANK CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES MASTER_ADDR=$MASTER_ADDR node=$SLURMD_NODENAME\"",
        ],
        &[],
    );
    assert_job_succeeded(&job, &output);
    let mut seen = BTreeMap::new();
    for (rank, text) in rank_lines(&output) {
        if let Some(env) = text.strip_prefix("env ") {
            seen.insert(rank, env.to_string());
        }
    }
    let expected: BTreeMap<u32, String> = (0..4)
        .map(|r| {
            (
                r,
                format!(
                    "RANK={r} LOCAL_RANK={} WORLD_SIZE=4 GROUP_RANK={} CUDA_VISIBLE_DEVICES=0,1 MASTER_ADDR=n0 node=n{}",
                    r % 2,
                    r / 2,
                    r / 2
                ),
            )
        })
        .collect();
    assert_eq!(seen, expected, "{output}");
    setup.assert_nothing_left();
}
