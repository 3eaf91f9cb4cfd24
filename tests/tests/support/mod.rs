//! Shared helpers for the end-to-end tests: where the built binaries are, running them with a
//! deadline, and finding processes that belong to a run (by the run id in their environment).
#![allow(dead_code)]

pub mod netns;
pub mod slurm;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// `target/<profile>/` of the build running these tests.
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test>-<hash>
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile> directory")
        .to_path_buf()
}

/// A built binary of the workspace (`launch`, `worker`); fails with a hint when it is missing.
pub fn bin(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    assert!(
        path.is_file(),
        "{} is missing: build the binaries first (`cargo build --release --workspace`, as scripts/test.sh does)",
        path.display()
    );
    path
}

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repo root")
        .to_path_buf()
}

/// A TCP port that was free a moment ago (for a fixed `--master-port`).
#[allow(dead_code)] // not every test binary needs it
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A run id no other test uses, so processes can be found by it.
pub fn unique_run_id(tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("e2e-{tag}-{}-{nanos}", std::process::id())
}

/// Panics, showing `text`, unless it contains every one of `needles`.
#[track_caller]
fn assert_contains_all<S: AsRef<str>>(text: &str, needles: &[S]) {
    for needle in needles {
        let needle = needle.as_ref();
        assert!(text.contains(needle), "no {needle:?} in:\n{text}");
    }
}

pub struct Output {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl Output {
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }

    /// Panics, showing stderr, unless the process exited with `code`.
    #[track_caller]
    pub fn assert_code(&self, code: i32) {
        assert_eq!(self.code(), Some(code), "{}", self.stderr);
    }

    /// Panics, showing stderr, unless stderr contains `needle`.
    #[track_caller]
    pub fn assert_stderr(&self, needle: impl AsRef<str>) {
        assert_contains_all(&self.stderr, &[needle]);
    }

    /// Panics, showing stderr, unless stderr contains every one of `needles`.
    #[track_caller]
    pub fn assert_stderr_all<S: AsRef<str>>(&self, needles: &[S]) {
        assert_contains_all(&self.stderr, needles);
    }

    /// Panics, showing stdout, unless stdout contains every one of `needles`.
    #[track_caller]
    pub fn assert_stdout_all<S: AsRef<str>>(&self, needles: &[S]) {
        assert_contains_all(&self.stdout, needles);
    }

    /// Stdout, a newline, then stderr: everything it printed, for messages and searches.
    pub fn all(&self) -> String {
        format!("{}\n{}", self.stdout, self.stderr)
    }

    /// Panics unless the process ended within `secs` seconds (a bound on hanging, far above
    /// the usual time, not a benchmark).
    #[track_caller]
    pub fn assert_ended_within(&self, secs: u64) {
        let limit = Duration::from_secs(secs);
        assert!(
            self.elapsed < limit,
            "took {:?}, limit {limit:?}",
            self.elapsed
        );
    }
}

/// The `--set`s of a tiny, fast training run (BPR on the tiny synthetic data, one epoch) whose
/// files go to `output_dir`; for tests about launching, not about training.
pub fn tiny_bpr_sets(output_dir: &Path) -> Vec<String> {
    [
        format!("run.output_dir={:?}", output_dir.display().to_string()),
        "data.synthetic=\"tiny\"".into(),
        "model.kind=\"bpr\"".into(),
        "train.epochs=1".into(),
    ]
    .into_iter()
    .flat_map(|set| ["--set".to_string(), set])
    .collect()
}

/// The newest checkpoint's directory of a run.
pub fn latest_checkpoint(run_dir: &Path) -> PathBuf {
    let checkpoints = run_dir.join("checkpoints");
    let latest = std::fs::read_to_string(checkpoints.join("latest")).expect("checkpoints/latest");
    checkpoints.join(latest.trim())
}

/// `launch ARGS...`, with piped output, in the repo root, without any job-shape variables of
/// the environment the tests run in (Slurm's, `PET_*`, `LAUNCH_RUN_ID`): tests set their own.
pub fn launch_cmd(args: &[&str]) -> Command {
    let mut cmd = Command::new(bin("launch"));
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        if key.starts_with("SLURM_") || key.starts_with("PET_") || key == "LAUNCH_RUN_ID" {
            cmd.env_remove(key.as_ref());
        }
    }
    cmd.args(args)
        .current_dir(repo_root())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// Runs `launch ARGS...` to completion (killing it after `timeout`).
pub fn launch(args: &[&str], timeout: Duration) -> Output {
    let child = launch_cmd(args).spawn().expect("start launch");
    wait_output(child, timeout)
}

/// `launch --num-processes 2 --master-port 0 [--run-id ID] configs/default.toml` with the run
/// directory `out_dir/name`, then `sets` as `--set`s; `env` added to its environment.
pub fn launch_default_config(
    out_dir: &Path,
    name: &str,
    run_id: Option<&str>,
    env: &[(&str, &str)],
    sets: &[&str],
) -> Output {
    let output_dir = format!("run.output_dir={:?}", out_dir.display().to_string());
    let run_name = format!("run.name={name:?}");
    let mut args = vec!["--num-processes", "2", "--master-port", "0"];
    if let Some(id) = run_id {
        args.extend(["--run-id", id]);
    }
    args.extend([
        "configs/default.toml",
        "--set",
        &output_dir,
        "--set",
        &run_name,
    ]);
    for set in sets {
        args.extend(["--set", set]);
    }
    let mut cmd = launch_cmd(&args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    wait_output(cmd.spawn().expect("start launch"), Duration::from_secs(600))
}

/// Collects a child's output, killing it if it outlives `timeout`.
pub fn wait_output(child: Child, timeout: Duration) -> Output {
    Live::new(child).finish(timeout)
}

/// A running `launch` whose output is collected as it arrives.
pub struct Live {
    pub child: Child,
    start: Instant,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Live {
    pub fn new(mut child: Child) -> Live {
        let stdout: Arc<Mutex<String>> = Arc::default();
        let stderr: Arc<Mutex<String>> = Arc::default();
        let mut readers = Vec::new();
        type Source = Box<dyn Read + Send>;
        let sources: [(Source, Arc<Mutex<String>>); 2] = [
            (
                Box::new(child.stdout.take().expect("piped stdout")),
                stdout.clone(),
            ),
            (
                Box::new(child.stderr.take().expect("piped stderr")),
                stderr.clone(),
            ),
        ];
        for (mut source, sink) in sources {
            readers.push(std::thread::spawn(move || {
                let mut buf = [0u8; 8192];
                loop {
                    match source.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => sink
                            .lock()
                            .unwrap()
                            .push_str(&String::from_utf8_lossy(&buf[..n])),
                    }
                }
            }));
        }
        Live {
            child,
            start: Instant::now(),
            stdout,
            stderr,
            readers,
        }
    }

    /// Everything it has written to stdout so far.
    pub fn stdout_now(&self) -> String {
        self.stdout.lock().unwrap().clone()
    }

    /// Everything it has written to stderr so far.
    pub fn stderr_now(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Time since it was started.
    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }

    pub fn pid(&self) -> nix::unistd::Pid {
        nix::unistd::Pid::from_raw(self.child.id() as i32)
    }

    /// Waits until stderr contains `needle`; panics with what was seen after `timeout`.
    pub fn wait_stderr(&self, needle: &str, timeout: Duration) {
        let start = Instant::now();
        while !self.stderr.lock().unwrap().contains(needle) {
            if start.elapsed() > timeout {
                panic!(
                    "stderr never showed {needle:?}; it has:\n{}",
                    self.stderr.lock().unwrap()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits until stdout or stderr contains `needle`; returns when it was seen, and panics
    /// with both after `timeout`.
    pub fn wait_output(&self, needle: &str, timeout: Duration) -> Instant {
        let start = Instant::now();
        while !(self.stderr_now().contains(needle) || self.stdout_now().contains(needle)) {
            assert!(
                start.elapsed() < timeout,
                "never saw {needle:?}:\n--- stdout\n{}\n--- stderr\n{}",
                self.stdout_now(),
                self.stderr_now()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Instant::now()
    }

    /// Waits for exit (killing it after `timeout`) and returns everything it printed.
    pub fn finish(mut self, timeout: Duration) -> Output {
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                break status;
            }
            if self.start.elapsed() > timeout {
                let _ = self.child.kill();
                let status = self.child.wait().expect("wait");
                panic!(
                    "launch did not finish within {timeout:?} (status after kill {status:?})\n--- stdout\n{}\n--- stderr\n{}",
                    self.stdout.lock().unwrap(),
                    self.stderr.lock().unwrap()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let elapsed = self.start.elapsed();
        for reader in self.readers.drain(..) {
            let _ = reader.join();
        }
        let stdout = self.stdout.lock().unwrap().clone();
        let stderr = self.stderr.lock().unwrap().clone();
        Output {
            status,
            stdout,
            stderr,
            elapsed,
        }
    }
}

/// Cuts the file at `path` to 1/`divisor` of its length, as a crash while writing it would.
pub fn truncate_to_fraction(path: &Path, divisor: u64) {
    let len = std::fs::metadata(path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(len / divisor)
        .unwrap();
}

/// Pids of live processes whose environment contains `TORCHELASTIC_RUN_ID=<run_id>`
/// (workers and anything they started). Zombies are not counted: they hold nothing.
pub fn processes_of_run(run_id: &str) -> Vec<i32> {
    processes_with_env("TORCHELASTIC_RUN_ID", run_id)
}

/// Pids of live processes whose environment holds `KEY=VALUE` exactly (e.g. the
/// `LAUNCH_RUN_ID` a test gave its job: the batch script, srun, every launch and worker).
/// Zombies are not counted.
pub fn processes_with_env(key: &str, value: &str) -> Vec<i32> {
    let needle = format!("{key}={value}");
    let mut pids = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return pids;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        if !environ.split(|&b| b == 0).any(|v| v == needle.as_bytes()) {
            continue;
        }
        let state = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        // Field 3 of /proc/PID/stat is the state; `Z` is a zombie.
        let zombie = state
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'));
        if !zombie {
            pids.push(pid);
        }
    }
    pids
}

/// Waits until no process of the run is left (or `timeout`), returning what is left.
pub fn wait_no_processes(run_id: &str, timeout: Duration) -> Vec<i32> {
    let start = Instant::now();
    loop {
        let left = processes_of_run(run_id);
        if left.is_empty() || start.elapsed() > timeout {
            return left;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Panics unless every process of the run is gone within `timeout`.
#[track_caller]
pub fn assert_no_processes(run_id: &str, timeout: Duration) {
    let left = wait_no_processes(run_id, timeout);
    assert!(
        left.is_empty(),
        "processes of {run_id} left behind: {left:?}"
    );
}

/// Waits until `count` processes of the run exist.
pub fn wait_processes(run_id: &str, count: usize, timeout: Duration) -> Vec<i32> {
    let start = Instant::now();
    loop {
        let pids = processes_of_run(run_id);
        if pids.len() >= count || start.elapsed() > timeout {
            return pids;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Lines `[rank N] text` of `output`, as (N, text).
pub fn rank_lines(output: &str) -> Vec<(u32, String)> {
    output
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("[rank ")?;
            let (rank, text) = rest.split_once("] ")?;
            Some((rank.trim().parse().ok()?, text.to_string()))
        })
        .collect()
}

/// The f32 tensors of a safetensors file, by name (enough of the format for our tests).
pub fn read_f32_tensors(path: &Path) -> std::collections::BTreeMap<String, Vec<f32>> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let data = &bytes[8 + header_len..];
    let mut out = std::collections::BTreeMap::new();
    for (name, info) in header.as_object().unwrap() {
        if name == "__metadata__" {
            continue;
        }
        assert_eq!(info["dtype"], "F32", "{name}");
        let offsets = info["data_offsets"].as_array().unwrap();
        let (start, end) = (
            offsets[0].as_u64().unwrap() as usize,
            offsets[1].as_u64().unwrap() as usize,
        );
        let values = data[start..end]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        out.insert(name.clone(), values);
    }
    out
}

/// Largest absolute difference between two sets of named tensors with the same names/shapes.
pub fn max_abs_diff(
    a: &std::collections::BTreeMap<String, Vec<f32>>,
    b: &std::collections::BTreeMap<String, Vec<f32>>,
) -> f32 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    a.iter()
        .flat_map(|(name, x)| {
            let y = &b[name];
            assert_eq!(x.len(), y.len(), "{name}");
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f32::max)
}

/// A model whose AdamW moments are a large share of its memory, so that ZeRO stage 1 (which
/// shards them) needs visibly less: BPR with 32,768-wide dense ID tables (about 44 MiB of
/// parameters on the tiny data), not the one-host shared-memory form of stage 1.
pub const WIDE_DENSE: [&str; 5] = [
    "model.kind=\"bpr\"",
    "model.embedding_dim=32768",
    "dist.sparse_embeddings=false",
    "dist.shard_optimizer=false",
    "train.epochs=1",
];

/// The peak X of a dry run's ZeRO line `stage N: ... peak X MiB at micro M: ...`, in MiB.
pub fn stage_peak(stdout: &str, stage: u8) -> f64 {
    let line = stdout
        .lines()
        .find(|l| l.trim_start().starts_with(&format!("stage {stage}:")))
        .unwrap_or_else(|| panic!("no stage {stage} line:\n{stdout}"));
    let number = line
        .split(" peak ")
        .nth(1)
        .and_then(|r| r.split(' ').next());
    number
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no peak in {line:?}"))
}
