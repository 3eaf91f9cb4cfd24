//! Shared helpers for the end-to-end tests: where the built binaries are, running them with a
//! deadline, and finding processes that belong to a run (by the run id in their environment).
#![allow(dead_code)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
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

/// A run id no other test uses, so processes can be found by it.
pub fn unique_run_id(tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("e2e-{tag}-{}-{nanos}", std::process::id())
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
}

/// `launch ARGS...`, with piped output, in the repo root.
pub fn launch_cmd(args: &[&str]) -> Command {
    let mut cmd = Command::new(bin("launch"));
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

/// Collects a child's output, killing it if it outlives `timeout`.
pub fn wait_output(mut child: Child, timeout: Duration) -> Output {
    let start = Instant::now();
    let mut out = child.stdout.take().expect("piped stdout");
    let mut err = child.stderr.take().expect("piped stderr");
    let out_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let status = child.wait().expect("wait");
            let stdout = out_reader.join().unwrap_or_default();
            let stderr = err_reader.join().unwrap_or_default();
            panic!(
                "launch did not finish within {timeout:?} (status after kill {status:?})\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let elapsed = start.elapsed();
    Output {
        status,
        stdout: out_reader.join().unwrap_or_default(),
        stderr: err_reader.join().unwrap_or_default(),
        elapsed,
    }
}

/// Pids of live processes whose environment contains `TORCHELASTIC_RUN_ID=<run_id>`
/// (workers and anything they started). Zombies are not counted: they hold nothing.
pub fn processes_of_run(run_id: &str) -> Vec<i32> {
    let needle = format!("TORCHELASTIC_RUN_ID={run_id}\0");
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
        if !contains(&environ, needle.as_bytes()) {
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

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
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
