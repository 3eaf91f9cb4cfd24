//! A real Slurm cluster on this machine for one test: `tests/slurm/minicluster.sh` (munged,
//! slurmctld and one slurmd per emulated node `n0`, `n1`, ... in DIR), started on free ports
//! and stopped again in `Drop`, so a failed assertion leaves nothing running.
//!
//! ```ignore
//! let Some(cluster) = SlurmCluster::start(2, 4, 0) else { return }; // printed "skipping: ..."
//! let job = cluster.sbatch_wait(&["-N2", "--wrap", "srun hostname"], &[]);
//! assert_eq!(job.code(), Some(0), "{job}");
//! ```
#![allow(dead_code)]

use std::fmt;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::{processes_with_env, repo_root, Live};

/// Ports the clusters use: slurmctld on a block's first port, slurmd `i` on first + 1 + i.
/// Above the kernel's ephemeral range (32768-60999) and above the ports `launch` derives for
/// Slurm jobs (12000-31999).
const PORT_BASE: u16 = 61000;
const PORT_BLOCK: u16 = 8;
const PORT_BLOCKS: u32 = 500;
/// Job ids per cluster before its ids (and so `launch`'s derived ports) could meet another
/// cluster's: cluster `b` numbers its jobs from `FIRST_JOB_ID + b * JOB_IDS_PER_CLUSTER`.
const FIRST_JOB_ID: u64 = 1000;
const JOB_IDS_PER_CLUSTER: u64 = 10;
/// Default deadline of `sbatch_wait`.
pub const JOB_TIMEOUT: Duration = Duration::from_secs(120);

/// Programs the harness needs (`sbatch`, `srun`, ... for the tests; the rest for the script).
const NEEDED: &[&str] = &[
    "slurmctld",
    "slurmd",
    "munged",
    "mungekey",
    "munge",
    "unmunge",
    "sbatch",
    "srun",
    "squeue",
    "scancel",
    "scontrol",
    "sinfo",
    "unshare",
];

static NEXT_CLUSTER: AtomicU32 = AtomicU32::new(0);

pub struct SlurmCluster {
    /// The cluster's directory (config, daemons' logs and spool).
    pub dir: PathBuf,
    pub nodes: u32,
    /// slurmctld's port; slurmd `i` listens on `port + 1 + i`.
    pub port: u16,
    /// Job ids of this cluster start here.
    pub first_job_id: u64,
    path: String,
}

/// A finished batch job: what `sbatch --wait --parsable` said and how it ended.
pub struct Job {
    pub id: u64,
    /// `sbatch --wait` exits with the job's exit code.
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl Job {
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }
}

impl fmt::Display for Job {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "job {} ({:?} after {:.1} s)\n--- sbatch stdout\n{}\n--- sbatch stderr\n{}",
            self.id,
            self.status,
            self.elapsed.as_secs_f64(),
            self.stdout,
            self.stderr
        )
    }
}

/// A running `sbatch --wait` (see [`SlurmCluster::sbatch`]).
pub struct Submitted<'c> {
    cluster: &'c SlurmCluster,
    /// `None` once [`Submitted::wait`] has collected it.
    sbatch: Option<Live>,
    args: Vec<String>,
}

impl Submitted<'_> {
    fn live(&mut self) -> &mut Live {
        self.sbatch.as_mut().expect("sbatch not yet collected")
    }

    /// The job id, once sbatch has printed it (panics when it has not within `timeout` or
    /// sbatch ended without one).
    pub fn id(&mut self, timeout: Duration) -> u64 {
        let start = Instant::now();
        let mut exited_at = None;
        loop {
            if let Some(id) = job_id_of(&self.live().stdout_now()) {
                return id;
            }
            if exited_at.is_none() && self.live().child.try_wait().expect("wait").is_some() {
                exited_at = Some(Instant::now());
            }
            // After sbatch exits, give the reader a moment to drain its pipe.
            let drained = exited_at.is_some_and(|t| t.elapsed() > Duration::from_millis(500));
            if drained || start.elapsed() > timeout {
                let args = self.args.clone();
                let live = self.live();
                let _ = live.child.kill();
                panic!(
                    "sbatch {args:?} printed no job id\n--- stdout\n{}\n--- stderr\n{}",
                    live.stdout_now(),
                    live.stderr_now()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits until the job has ended (sbatch exits with the job's exit code). After `timeout`
    /// (counted from the submission) it cancels the job and panics with what it knows.
    pub fn wait(mut self, timeout: Duration) -> Job {
        loop {
            let live = self.live();
            if live.child.try_wait().expect("wait for sbatch").is_some() {
                break;
            }
            if live.elapsed() > timeout {
                let (stdout, stderr) = (live.stdout_now(), live.stderr_now());
                let id = job_id_of(&stdout);
                let mut report = String::new();
                if let Some(id) = id {
                    report = self.cluster.show_job(id);
                    let _ = self.cluster.command("scancel").arg(id.to_string()).status();
                }
                panic!(
                    "sbatch {:?}: the job {id:?} did not end within {timeout:?}; cancelled it\n{report}\n--- sbatch stdout\n{stdout}\n--- sbatch stderr\n{stderr}",
                    self.args
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = self.sbatch.take().expect("sbatch").finish(Duration::MAX);
        let id = job_id_of(&out.stdout).unwrap_or_else(|| {
            panic!(
                "sbatch {:?} printed no job id ({:?})\n--- stdout\n{}\n--- stderr\n{}",
                self.args, out.status, out.stdout, out.stderr
            )
        });
        Job {
            id,
            status: out.status,
            stdout: out.stdout,
            stderr: out.stderr,
            elapsed: out.elapsed,
        }
    }
}

impl Drop for Submitted<'_> {
    fn drop(&mut self) {
        // A panic between submitting and waiting: do not leave sbatch behind.
        if let Some(live) = self.sbatch.as_mut() {
            if live.child.try_wait().ok().flatten().is_none() {
                let _ = live.child.kill();
                let _ = live.child.wait();
            }
        }
    }
}

/// `tests/slurm/minicluster.sh`.
pub fn script() -> PathBuf {
    repo_root().join("tests/slurm/minicluster.sh")
}

/// Where the clusters' directories live (one per cluster; removed when a test passes, kept
/// with its logs when it fails, reaped by the next run once their owner is gone).
pub fn base_dir() -> PathBuf {
    std::env::temp_dir().join("gptrec-slurm-e2e")
}

/// PATH plus the sbin directories (where Debian puts slurmctld, slurmd and munged).
fn search_path() -> String {
    let mut path = std::env::var("PATH").unwrap_or_default();
    for extra in ["/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/bin", "/bin"] {
        if !path.split(':').any(|p| p == extra) {
            if !path.is_empty() {
                path.push(':');
            }
            path.push_str(extra);
        }
    }
    path
}

fn find_program(name: &str, path: &str) -> bool {
    path.split(':')
        .filter(|d| !d.is_empty())
        .any(|d| is_executable(&Path::new(d).join(name)))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Why a Slurm cluster cannot run here, or `None` when it can.
pub fn unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("the Slurm tests need root (they start munged, slurmctld and slurmd)".into());
    }
    let path = search_path();
    let missing: Vec<&str> = NEEDED
        .iter()
        .copied()
        .filter(|p| !find_program(p, &path))
        .collect();
    if !missing.is_empty() {
        return Some(format!(
            "{} not installed (apt-get install -y --no-install-recommends slurm-wlm munge)",
            missing.join(", ")
        ));
    }
    let unshare = Command::new("unshare")
        .args(["-m", "true"])
        .env("PATH", &path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !unshare.is_ok_and(|s| s.success()) {
        return Some("`unshare -m` is not permitted here (no private mount namespace for the nodes' /etc/hosts)".into());
    }
    None
}

/// Whether every port of `first..first+count` can be bound now (on all addresses, as
/// slurmctld and slurmd bind).
fn ports_free(first: u16, count: u16) -> bool {
    (first..first + count).all(|p| TcpListener::bind(("0.0.0.0", p)).is_ok())
}

/// What a cluster looks like (see [`SlurmCluster::start_with`]).
#[derive(Debug, Clone)]
pub struct Options {
    pub nodes: u32,
    /// CPUs each node claims (may exceed the real cores).
    pub cpus_per_node: u32,
    /// Fake GPUs per node (gres/gpu on dummy devices: Slurm sets CUDA_VISIBLE_DEVICES etc.).
    pub gpus_per_node: u32,
    /// Slurm's credential lifetime (AuthInfo cred_expire), which is also how long a requeued
    /// job waits before it may start again; `None`: Slurm's 120 s.
    pub cred_expire_s: Option<u32>,
}

impl SlurmCluster {
    /// Starts `nodes` emulated nodes with `cpus_per_node` CPUs (may exceed the real cores) and
    /// `gpus_per_node` fake GPUs each. `None`, after one `skipping: <why>` line on stderr, where
    /// Slurm cannot run (not root, Slurm or munge not installed, no `unshare -m`).
    pub fn start(nodes: u32, cpus_per_node: u32, gpus_per_node: u32) -> Option<SlurmCluster> {
        SlurmCluster::start_with(Options {
            nodes,
            cpus_per_node,
            gpus_per_node,
            cred_expire_s: None,
        })
    }

    /// [`SlurmCluster::start`] with every option.
    pub fn start_with(options: Options) -> Option<SlurmCluster> {
        let Options {
            nodes,
            cpus_per_node,
            gpus_per_node,
            cred_expire_s,
        } = options;
        assert!(
            (1..PORT_BLOCK as u32).contains(&nodes),
            "1 to {} nodes",
            PORT_BLOCK - 1
        );
        if let Some(why) = unavailable() {
            eprintln!("skipping: {why}");
            return None;
        }
        let path = search_path();
        let base = base_dir();
        std::fs::create_dir_all(&base).expect("create the clusters' base directory");
        // Clusters of earlier test runs that were killed before they could stop them.
        let _ = Command::new("bash")
            .arg(script())
            .arg("reap")
            .arg(&base)
            .env("PATH", &path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .status();

        let pid = std::process::id();
        let mut last_error = String::new();
        for attempt in 0..6 {
            let n = NEXT_CLUSTER.fetch_add(1, Ordering::SeqCst);
            // Spread processes over the blocks by pid; within a process, one block each.
            let block = (pid.wrapping_mul(7919).wrapping_add(n)) % PORT_BLOCKS;
            let port = PORT_BASE + block as u16 * PORT_BLOCK;
            if !ports_free(port, nodes as u16 + 1) {
                last_error = format!("ports {port}..{} are taken", port + nodes as u16);
                continue;
            }
            let dir = base.join(format!("{pid}-{n}"));
            let _ = std::fs::remove_dir_all(&dir);
            let first_job_id = FIRST_JOB_ID + block as u64 * JOB_IDS_PER_CLUSTER;
            let mut start = Command::new("bash");
            start
                .arg(script())
                .arg("start")
                .arg(&dir)
                .arg(nodes.to_string());
            if let Some(s) = cred_expire_s {
                start.env("MC_CRED_EXPIRE", s.to_string());
            }
            let out = start
                .env("PATH", &path)
                .env("MC_PORT", port.to_string())
                .env("MC_CPUS", cpus_per_node.to_string())
                .env("MC_GPUS", gpus_per_node.to_string())
                .env("MC_FIRST_JOB_ID", first_job_id.to_string())
                .env("MC_OWNER", pid.to_string())
                .env_remove("SLURM_CONF")
                .stdin(Stdio::null())
                .output()
                .expect("run tests/slurm/minicluster.sh");
            if out.status.success() {
                return Some(SlurmCluster {
                    dir,
                    nodes,
                    port,
                    first_job_id,
                    path,
                });
            }
            last_error = format!(
                "attempt {attempt}: minicluster.sh start {} {nodes} (MC_PORT={port}) failed with {:?}:\n{}{}",
                dir.display(),
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            // The script stopped whatever it had started; the directory has its logs.
            if out.status.code() != Some(3) {
                eprintln!("{last_error}");
            }
        }
        panic!("could not start a Slurm cluster: {last_error}");
    }

    /// `DIR/etc/slurm.conf`: clients find the cluster through `SLURM_CONF`.
    pub fn conf(&self) -> PathBuf {
        self.dir.join("etc/slurm.conf")
    }

    /// The environment to give Slurm's clients (`sbatch`, `srun`, `squeue`, ...).
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("SLURM_CONF".into(), self.conf().display().to_string()),
            ("PATH".into(), self.path.clone()),
        ]
    }

    /// A Slurm client command for this cluster: `SLURM_CONF` set, and none of the variables of
    /// an outer Slurm job or of sbatch's/srun's option variables that the tests may run under.
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        for (key, _) in std::env::vars_os() {
            let key = key.to_string_lossy();
            if ["SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "PET_"]
                .iter()
                .any(|p| key.starts_with(p))
                || key == "LAUNCH_RUN_ID"
                || key == "TORCHELASTIC_RUN_ID"
            {
                cmd.env_remove(key.as_ref());
            }
        }
        cmd.envs(self.env()).stdin(Stdio::null());
        cmd
    }

    /// `sbatch --wait --parsable ARGS` in this cluster's directory, with `env` added; see
    /// [`SlurmCluster::sbatch_wait_in`].
    pub fn sbatch_wait(&self, args: &[&str], env: &[(&str, &str)]) -> Job {
        self.sbatch_wait_in(&self.dir, args, env, JOB_TIMEOUT)
    }

    /// `sbatch --wait --parsable ARGS` submitted from `cwd` (the job's SLURM_SUBMIT_DIR), with
    /// `env` added to the job's environment. Returns when the job has ended; panics when it
    /// has not after `timeout`, after cancelling it.
    pub fn sbatch_wait_in(
        &self,
        cwd: &Path,
        args: &[&str],
        env: &[(&str, &str)],
        timeout: Duration,
    ) -> Job {
        self.sbatch(cwd, args, env).wait(timeout)
    }

    /// Starts `sbatch --wait --parsable ARGS` from `cwd` and returns at once; `wait` on the
    /// result (jobs that must run at the same time: submit them all, then wait).
    pub fn sbatch(&self, cwd: &Path, args: &[&str], env: &[(&str, &str)]) -> Submitted<'_> {
        let child = self
            .command("sbatch")
            .args(["--wait", "--parsable"])
            .args(args)
            .envs(env.iter().copied())
            .current_dir(cwd)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start sbatch");
        Submitted {
            cluster: self,
            sbatch: Some(Live::new(child)),
            args: args.iter().map(|a| a.to_string()).collect(),
        }
    }

    /// `scontrol show job ID`, for failure messages.
    pub fn show_job(&self, id: u64) -> String {
        self.command("scontrol")
            .args(["show", "job", &id.to_string()])
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout).into_owned()
                    + &String::from_utf8_lossy(&o.stderr)
            })
            .unwrap_or_default()
    }

    /// Job ids Slurm still knows as pending or running.
    pub fn active_jobs(&self) -> Vec<u64> {
        let out = self
            .command("squeue")
            .args([
                "-h",
                "-o",
                "%i",
                "-t",
                "PENDING,RUNNING,SUSPENDED,COMPLETING",
            ])
            .output()
            .expect("squeue");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// The daemons' logs (slurmctld, every slurmd), for failure messages.
    pub fn logs(&self) -> String {
        let mut text = String::new();
        if let Ok(entries) = std::fs::read_dir(self.dir.join("log")) {
            let mut paths: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
            paths.sort();
            for path in paths {
                let body = std::fs::read_to_string(&path).unwrap_or_default();
                let tail: Vec<&str> = body.lines().rev().take(40).collect();
                text.push_str(&format!("--- {} (last lines)\n", path.display()));
                for line in tail.into_iter().rev() {
                    text.push_str(line);
                    text.push('\n');
                }
            }
        }
        text
    }

    /// Stops everything (what `Drop` does); safe to call twice.
    pub fn stop(&self) -> std::process::Output {
        Command::new("bash")
            .arg(script())
            .arg("stop")
            .arg(&self.dir)
            .env("PATH", &self.path)
            .env_remove("SLURM_CONF")
            .stdin(Stdio::null())
            .output()
            .expect("run tests/slurm/minicluster.sh stop")
    }
}

impl Drop for SlurmCluster {
    fn drop(&mut self) {
        let out = self.stop();
        if !out.status.success() {
            eprintln!(
                "minicluster.sh stop {} failed ({:?}):\n{}{}",
                self.dir.display(),
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        if std::thread::panicking() {
            eprintln!(
                "the Slurm cluster's files (config, daemons' logs) are kept in {}",
                self.dir.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The job id `sbatch --parsable` prints first (`123` or `123;cluster`).
fn job_id_of(stdout: &str) -> Option<u64> {
    let first = stdout.lines().next()?;
    first.split(';').next()?.trim().parse().ok()
}

/// Waits until no process has `KEY=VALUE` in its environment (or `timeout`); what is left,
/// each as `pid command line`.
pub fn wait_no_processes_with_env(key: &str, value: &str, timeout: Duration) -> Vec<String> {
    let start = Instant::now();
    loop {
        let left = processes_with_env(key, value);
        if left.is_empty() || start.elapsed() > timeout {
            return left
                .into_iter()
                .map(|pid| {
                    let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                    let cmd: Vec<String> = cmd
                        .split(|&b| b == 0)
                        .filter(|a| !a.is_empty())
                        .map(|a| String::from_utf8_lossy(a).into_owned())
                        .collect();
                    format!("{pid} {}", cmd.join(" "))
                })
                .collect();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
