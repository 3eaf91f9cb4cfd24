//! The documented commands that need what this machine lacks (GPUs, a Slurm cluster, the
//! internet, a fresh build), each run here verbatim, as README.md and docs/guide.md print it,
//! with a stand-in for the missing part: a fake `nvidia-smi` and a `launch` that records what
//! it was asked to do (the GPU work itself is what the other end-to-end tests run on the CPU),
//! a throwaway Slurm cluster (`tests/slurm/minicluster.sh`, skipped where it cannot run), a
//! mirror address where nothing listens, and a `cargo` that only checks its arguments. The
//! documents name this file in `<!-- run by: ... -->`; `tests/tests/docs.rs` checks that each
//! of their command lines is one of the strings below.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use support::slurm::SlurmCluster;
use support::{bin_dir, repo_root, wait_output, Output};

const T: Duration = Duration::from_secs(120);

fn write_executable(path: &Path, text: &str) {
    std::fs::write(path, text).expect("write a stand-in");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
}

/// A `launch` that appends one line per call to `record`: this node's Slurm id, its visible
/// GPUs, then its arguments, one per tab.
fn recording_launch(dir: &Path, record: &Path) -> std::path::PathBuf {
    let path = dir.join("fake-launch");
    let text = format!(
        "#!/bin/bash\nline=$(printf '%s\\t%s' \"${{SLURM_NODEID:-}}\" \"${{CUDA_VISIBLE_DEVICES:-}}\"; \
         printf '\\t%s' \"$@\")\nprintf '%s\\n' \"$line\" >> '{}'\n",
        record.display()
    );
    write_executable(&path, &text);
    path
}

/// The calls `recording_launch` recorded: (node, GPUs, arguments), sorted by node.
fn recorded(record: &Path) -> Vec<(String, String, Vec<String>)> {
    let text = std::fs::read_to_string(record).unwrap_or_default();
    let mut calls: Vec<_> = text
        .lines()
        .map(|line| {
            let mut fields = line.split('\t').map(String::from);
            let node = fields.next().unwrap_or_default();
            let gpus = fields.next().unwrap_or_default();
            (node, gpus, fields.collect())
        })
        .collect();
    calls.sort();
    calls
}

/// `bash -c COMMAND` in `cwd` with the built binaries first on PATH, to its end.
fn run(mut cmd: Command, command: &str, cwd: &Path) -> Output {
    let given = cmd
        .get_envs()
        .find(|(k, _)| *k == "PATH")
        .and_then(|(_, v)| v);
    let given = given.map(|v| v.to_string_lossy().to_string());
    let path = given.unwrap_or_else(|| std::env::var("PATH").unwrap_or_default());
    cmd.arg("-c")
        .arg(command)
        .env("PATH", format!("{}:{path}", bin_dir().display()))
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    wait_output(cmd.spawn().expect("start bash"), T)
}

/// The words of `command` after the word `after`.
fn args_after<'c>(command: &'c str, after: &str) -> Vec<&'c str> {
    let words: Vec<&str> = command.split_whitespace().collect();
    let at = words
        .iter()
        .position(|w| *w == after)
        .expect("the script in the command");
    words[at + 1..].to_vec()
}

const RUN_SH: &str = "scripts/run.sh --dry-run";

/// `scripts/run.sh` sets up, builds and starts the default run; here the build is a `cargo`
/// that only checks it was asked for `build --release --workspace` (the binaries under test
/// were just built so), and `--dry-run` keeps the run from writing into the repository.
#[test]
fn run_sh_sets_up_builds_and_starts_the_default_run() {
    // Where scripts/setup.sh keeps torch: ${GPTREC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gptrec}
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let xdg = var("XDG_CACHE_HOME").or_else(|| var("HOME").map(|h| format!("{h}/.cache")));
    let cache =
        var("GPTREC_CACHE").unwrap_or_else(|| format!("{}/gptrec", xdg.unwrap_or_default()));
    if !Path::new(&cache)
        .join("torch-2.11.0/.gptrec-complete")
        .exists()
    {
        eprintln!("skipping: no torch set up in {cache} (scripts/setup.sh would install it)");
        return;
    }
    let shims = tempfile::tempdir().expect("tempdir");
    write_executable(
        &shims.path().join("cargo"),
        "#!/bin/sh\n[ \"$*\" = 'build --release --workspace' ] || { echo \"cargo $*?\" >&2; exit 9; }\n",
    );
    let mut cmd = Command::new("bash");
    let path = format!(
        "{}:{}",
        shims.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    cmd.env("PATH", path);
    let out = run(cmd, RUN_SH, &repo_root());
    out.assert_code(0);
    out.assert_stdout_all(&[
        "run: cargo build --release",
        "run: target/release/launch --num-processes 2 configs/default.toml --dry-run",
        "launch plan (dry run: nothing was started)",
        "  config:       configs/default.toml (run \"default\")",
    ]);
}

const GPU_BOX: [&str; 3] = [
    "scripts/gpu-box.sh configs/train.toml --set data.dir=/data/ml-1m",
    "scripts/gpu-box.sh -n 4 configs/dynamic.toml",
    "scripts/gpu-box.sh configs/train.toml",
];

/// On a box of 4 idle GPUs, each documented `gpu-box.sh` command starts `launch` on the GPUs
/// it picked, with a dated log directory and the command's config and options.
#[test]
fn gpu_box_commands_start_launch_on_the_idle_gpus() {
    let dir = tempfile::tempdir().expect("tempdir");
    let smi = dir.path().join("nvidia-smi");
    write_executable(
        &smi,
        "#!/bin/sh\ncase \"$*\" in\n\
         *utilization.gpu*) printf '0, 3, 81559, 0\\n1, 5, 81559, 1\\n2, 1, 81559, 2\\n3, 9, 81559, 0\\n' ;;\n\
         *uuid*) printf '0, GPU-a\\n1, GPU-b\\n2, GPU-c\\n3, GPU-d\\n' ;;\n\
         *) exit 1 ;;\nesac\n",
    );
    for (i, command) in GPU_BOX.iter().enumerate() {
        let record = dir.path().join(format!("calls-{i}"));
        let mut cmd = Command::new("bash");
        cmd.env("GPUBOX_NVIDIA_SMI", &smi)
            .env("LAUNCH", recording_launch(dir.path(), &record))
            .env("LOG_ROOT", dir.path().join("logs"))
            .env_remove("CUDA_VISIBLE_DEVICES");
        let out = run(cmd, command, &repo_root());
        assert_eq!(out.code(), Some(0), "{command}\n{}", out.all());
        let calls = recorded(&record);
        assert_eq!(calls.len(), 1, "{command}: {calls:?}");
        let args = &calls[0].2;
        let config_at = args
            .iter()
            .position(|a| a.starts_with("configs/"))
            .expect("a config");
        assert_eq!(args[0], "--gpu-ids", "{command}: {args:?}");
        assert_eq!(
            args[1].split(',').count(),
            4,
            "{command}: all 4 idle GPUs: {args:?}"
        );
        assert_eq!(args[2], "--rank-logs", "{command}: {args:?}");
        let documented = args_after(command, "scripts/gpu-box.sh");
        let documented = &documented[documented
            .iter()
            .position(|a| a.starts_with("configs/"))
            .expect("config")..];
        assert_eq!(&args[config_at..], documented, "{command}");
    }
}

const FETCH: &str = "fetch ml-1m gpt2";

/// Without the internet (the mirrors point where nothing listens) `fetch ml-1m gpt2` is one
/// line that says so and what to do instead, exit 1, and nothing is placed in the cache.
#[test]
fn fetch_without_the_internet_says_what_to_do_instead() {
    let cache = tempfile::tempdir().expect("tempdir");
    let port = support::free_port();
    let mirror = format!("http://127.0.0.1:{port}");
    let mut cmd = Command::new("bash");
    cmd.env("GPTREC_CACHE", cache.path())
        .env("GPTREC_GROUPLENS_URL", &mirror)
        .env("HF_ENDPOINT", &mirror)
        .env("GPTREC_FETCH_RETRIES", "0");
    let out = run(cmd, FETCH, &repo_root());
    out.assert_code(1);
    out.assert_stderr_all(&["cannot reach 127.0.0.1", "fetch --from FILE ml-1m"]);
    assert!(!cache.path().join("data/ml-1m").exists(), "{}", out.all());
    assert!(!cache.path().join("models/gpt2").exists(), "{}", out.all());
}

const SBATCH: [&str; 3] = [
    "sbatch --nodes 2 --gpus-per-node 8 scripts/slurm/train.sbatch configs/train.toml --set data.dir=/data/ml-1m",
    "sbatch --nodes 2 --gpus-per-node 8 scripts/slurm/train.sbatch configs/train.toml",
    "sbatch --nodes 2 scripts/slurm/train.sbatch configs/default.toml --num-processes 2",
];

/// On a two-node cluster with 8 fake GPUs per node, each documented `sbatch` command, submitted
/// from a directory holding the repository's `scripts/` and `configs/`, runs one `launch` per
/// node, with the node's GPUs visible, its log directory, the job's run name and the command's
/// config and options.
#[test]
fn sbatch_commands_run_one_launch_per_node() {
    let Some(cluster) = SlurmCluster::start(2, 2, 8) else {
        return;
    };
    let submit = tempfile::tempdir().expect("tempdir");
    for name in ["scripts", "configs"] {
        std::os::unix::fs::symlink(repo_root().join(name), submit.path().join(name)).expect("link");
    }
    for (i, command) in SBATCH.iter().enumerate() {
        let record = submit.path().join(format!("calls-{i}"));
        let mut cmd = cluster.command("bash");
        cmd.env("SBATCH_WAIT", "1")
            .env("LAUNCH", recording_launch(submit.path(), &record));
        let out = run(cmd, command, submit.path());
        assert_eq!(
            out.code(),
            Some(0),
            "{command}\n{}\n{}",
            out.all(),
            cluster.logs()
        );
        let calls = recorded(&record);
        assert_eq!(calls.len(), 2, "{command}: one launch per node: {calls:?}");
        let gpus = if command.contains("--gpus-per-node 8") {
            "0,1,2,3,4,5,6,7"
        } else {
            ""
        };
        for (node, (id, visible, args)) in calls.iter().enumerate() {
            assert_eq!(
                (id.as_str(), visible.as_str()),
                (node.to_string().as_str(), gpus),
                "{command}: {calls:?}"
            );
            assert_eq!(args[0], "--rank-logs", "{command}: {args:?}");
            assert!(
                args[3].starts_with("run.name=\"slurm-"),
                "{command}: {args:?}"
            );
            assert_eq!(
                args[4..],
                args_after(command, "scripts/slurm/train.sbatch"),
                "{command}"
            );
        }
    }
}

const GPU_CHECK: &str = "scripts/gpu/check.sh";

/// The GPU check (README "On a GPU box") runs its steps in order, goes on after one fails and says
/// how each ended. Without a GPU here: its dry run, its two-rank step on the TCP ring
/// (`CHECK_BACKEND=tcp`) and a step it does not know.
#[test]
fn gpu_check_runs_its_steps_and_says_how_each_ended() {
    let out_dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new("bash");
    cmd.env("GPTREC_BIN", bin_dir())
        .env("CHECK_OUT", out_dir.path())
        .env("CHECK_BACKEND", "tcp")
        .env("PEER_DEVICE", "cpu")
        .env("STEPS", "dry bogus two");
    let out = run(cmd, GPU_CHECK, &repo_root());
    out.assert_code(0);
    out.assert_stdout_all(&[
        "== dry: ok in ",
        "launch plan (dry run: nothing was started)",
        "unknown step bogus",
        "== two-on-one: ok in ",
        "summary: ",
        "time per step by rank (ms): compute, data, collectives, update",
        &format!("logs in {}", out_dir.path().display()),
    ]);
    assert!(out_dir.path().join("two-on-one.log").is_file());
}
