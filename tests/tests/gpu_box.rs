//! End-to-end tests of `scripts/gpu-box.sh` with real processes: a fake `nvidia-smi` (a shell
//! script printing canned CSV, via GPUBOX_NVIDIA_SMI) describes 4 GPUs of which 1 and 3 are busy,
//! `GPTREC_SIMULATE_GPUS=4` makes `launch` believe they exist, and the workers train on the CPU.
//! Where only the script's choice matters, a fake `launch` (via LAUNCH) records its arguments.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use support::*;

const T: Duration = Duration::from_secs(120);

/// `index, memory.used, memory.total, utilization.gpu` as `nvidia-smi ... --format=csv,noheader,nounits`
/// prints it: GPU 1 is busy (memory and utilisation), GPU 3 by utilisation alone (512 MiB is
/// under the 1024 MiB limit); of the idle ones GPU 0 is the least used (0% before 2%).
const FOUR_GPUS: &str = "0, 3, 81559, 0\n1, 40211, 81559, 97\n2, 1, 81559, 2\n3, 512, 81559, 64\n";
const UUIDS: &str = "0, GPU-aaaa-1\n1, GPU-bbbb-2\n2, GPU-cccc-3\n3, GPU-dddd-4\n";

fn script() -> PathBuf {
    repo_root().join("scripts/gpu-box.sh")
}

fn write_executable(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// A fake nvidia-smi in `dir` that answers exactly the two queries the script makes, and fails
/// loudly on anything else (so a changed query shows up here).
fn fake_nvidia_smi(dir: &Path) -> PathBuf {
    let path = dir.join("nvidia-smi");
    write_executable(
        &path,
        &format!(
            "#!/bin/sh\n\
             case \"$*\" in\n\
             '--query-gpu=index,memory.used,memory.total,utilization.gpu --format=csv,noheader,nounits') printf '{FOUR_GPUS}' ;;\n\
             '--query-gpu=index,uuid --format=csv,noheader') printf '{UUIDS}' ;;\n\
             *) echo \"fake nvidia-smi: unexpected arguments: $*\" >&2; exit 1 ;;\n\
             esac\n"
        ),
    );
    path
}

/// A fake launch that writes its arguments (one per line) to `dir/launch-args` and exits 7.
fn fake_launch(dir: &Path) -> PathBuf {
    let path = dir.join("fake-launch");
    write_executable(
        &path,
        &format!(
            "#!/bin/sh\nprintf '%s\\n' \"$@\" > '{}'\nexit 7\n",
            dir.join("launch-args").display()
        ),
    );
    path
}

struct GpuBox {
    tmp: tempfile::TempDir,
    smi: PathBuf,
}

impl GpuBox {
    fn new() -> GpuBox {
        let tmp = tempfile::tempdir().unwrap();
        let smi = fake_nvidia_smi(tmp.path());
        GpuBox { tmp, smi }
    }

    /// A fresh box and a fake launch in its tempdir (see [`fake_launch`]).
    fn with_fake_launch() -> (GpuBox, PathBuf) {
        let gb = GpuBox::new();
        let launch = fake_launch(gb.tmp.path());
        (gb, launch)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.tmp.path().join(name)
    }

    fn log_root(&self) -> PathBuf {
        self.path("logs")
    }

    /// `scripts/gpu-box.sh ARGS` in the repo root with the fake nvidia-smi, 4 simulated GPUs,
    /// LOG_ROOT in the tempdir and the `launch` of this build (or `launch` given).
    fn command(&self, args: &[&str], launch: &Path) -> Command {
        let mut cmd = Command::new(script());
        cmd.args(args)
            .current_dir(repo_root())
            .env("GPUBOX_NVIDIA_SMI", &self.smi)
            .env("GPTREC_SIMULATE_GPUS", "4")
            .env("LOG_ROOT", self.log_root())
            .env("LAUNCH", launch)
            .env_remove("CUDA_VISIBLE_DEVICES")
            .env_remove("GPTREC_MEMORY_LIMIT_MB")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    fn run(&self, args: &[&str], launch: &Path) -> Output {
        self.run_cmd(self.command(args, launch))
    }

    fn run_cmd(&self, mut cmd: Command) -> Output {
        wait_output(cmd.spawn().expect("start scripts/gpu-box.sh"), T)
    }

    /// The dated log directories under LOG_ROOT/<stem>, oldest first.
    fn log_dirs(&self, stem: &str) -> Vec<PathBuf> {
        let Ok(entries) = std::fs::read_dir(self.log_root().join(stem)) else {
            return Vec::new();
        };
        let mut dirs: Vec<PathBuf> = entries.map(|e| e.unwrap().path()).collect();
        // YYYYmmdd-HHMMSS, then -2, -3 ... within one second
        dirs.sort_by_key(|d| {
            let name = d.file_name().unwrap().to_str().unwrap().to_string();
            let (stamp, n) = match name.get(15..) {
                Some(rest) if !rest.is_empty() => {
                    (name[..15].to_string(), rest[1..].parse().unwrap_or(0))
                }
                _ => (name.clone(), 1),
            };
            (stamp, n)
        });
        dirs
    }

    fn launch_args(&self) -> Vec<String> {
        std::fs::read_to_string(self.path("launch-args"))
            .unwrap_or_default()
            .lines()
            .map(String::from)
            .collect()
    }
}

fn both(out: &Output) -> String {
    format!("--- stdout\n{}\n--- stderr\n{}", out.stdout, out.stderr)
}

fn gpu_box_lines(out: &Output) -> Vec<&str> {
    out.stderr
        .lines()
        .filter(|l| l.starts_with("gpu-box:"))
        .collect()
}

fn line_with<'a>(out: &'a Output, prefix: &str) -> &'a str {
    gpu_box_lines(out)
        .into_iter()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line starting {prefix:?}\n{}", both(out)))
}

/// Panics unless the output has a `gpu-box:` line starting `prefix` that contains `needle`.
#[track_caller]
fn assert_line_has(out: &Output, prefix: &str, needle: &str) {
    let line = line_with(out, prefix);
    assert!(line.contains(needle), "{line}");
}

/// Panics unless gpu-box exited 2 with one line on stderr, `gpu-box: error: ...`; `what` names
/// the case.
#[track_caller]
fn assert_one_line_error(out: &Output, what: &str) {
    assert_eq!(out.code(), Some(2), "{what}: {}", both(out));
    assert_eq!(out.stderr.lines().count(), 1, "{what}: {}", out.stderr);
    assert!(
        out.stderr.starts_with("gpu-box: error: "),
        "{what}: {}",
        out.stderr
    );
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// (a) and (b): the idle GPUs 0 and 2 get one worker each, a real tiny run finishes with both
/// ranks' logs in a fresh dated directory; the same command with more epochs resumes from the
/// first run's checkpoint into a second dated directory.
#[test]
fn trains_on_the_idle_gpus_then_resumes() {
    let gb = GpuBox::new();
    let out_dir = gb.path("runs");
    let out_dir_set = format!("run.output_dir={:?}", out_dir.to_str().unwrap());
    let launch = bin("launch");
    let run = |epochs: &str| {
        gb.run(
            &[
                "configs/default.toml",
                "--master-port",
                "0",
                "--set",
                "data.synthetic=\"tiny\"",
                "--set",
                "model.kind=\"bpr\"",
                "--set",
                epochs,
                "--set",
                &out_dir_set,
            ],
            &launch,
        )
    };

    // (a)
    let first = run("train.epochs=1");
    assert_eq!(first.code(), Some(0), "{}", both(&first));
    let picked = line_with(&first, "gpu-box: picked ");
    assert!(
        picked.contains("GPU 0 (")
            && picked.contains("GPU 2 (")
            && !picked.contains("GPU 1 (")
            && !picked.contains("GPU 3 ("),
        "{picked}"
    );
    assert_line_has(&first, "gpu-box: exec ", " --gpu-ids 0,2 ");
    let dirs = gb.log_dirs("default");
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    let logs = &dirs[0];
    let name = logs.file_name().unwrap().to_str().unwrap();
    assert!(
        name.len() == 15
            && name.as_bytes()[8] == b'-'
            && name.bytes().filter(u8::is_ascii_digit).count() == 14,
        "log dir {name} is not YYYYmmdd-HHMMSS"
    );
    assert_line_has(&first, "gpu-box: logs go to ", logs.to_str().unwrap());
    assert!(
        rank_lines(&first.stdout)
            .into_iter()
            .chain(rank_lines(&first.stderr))
            .all(|(rank, _)| rank < 2),
        "{}",
        both(&first)
    );
    let rank0 = read(&logs.join("rank-0.log"));
    read(&logs.join("rank-1.log"));
    assert!(!logs.join("rank-2.log").exists());
    // The run finished, with one worker per picked GPU: "... peak RSS per rank [a, b] MiB".
    let summary = rank0
        .lines()
        .find(|l| l.starts_with("summary: "))
        .unwrap_or_else(|| panic!("the run did not finish:\n{rank0}"));
    let per_rank = summary
        .split_once("peak RSS per rank [")
        .and_then(|(_, rest)| rest.split_once(']'))
        .unwrap_or_else(|| panic!("{summary}"))
        .0;
    assert_eq!(per_rank.split(',').count(), 2, "world size 2: {summary}");
    assert!(!rank0.contains("resuming from"), "{rank0}");
    let latest = out_dir.join("default/checkpoints/latest");
    assert!(latest.exists(), "no checkpoint at {}", latest.display());

    // (b) the same command with one more epoch resumes from the first run's checkpoint
    let second = run("train.epochs=2");
    assert_eq!(second.code(), Some(0), "{}", both(&second));
    let dirs = gb.log_dirs("default");
    assert_eq!(dirs.len(), 2, "a fresh log dir per run: {dirs:?}");
    assert_eq!(&dirs[0], logs);
    let rank0 = read(&dirs[1].join("rank-0.log"));
    let resumed = rank0
        .lines()
        .find(|l| l.contains("resuming from"))
        .unwrap_or_else(|| panic!("the second run did not resume:\n{rank0}"));
    let checkpoints = out_dir.join("default/checkpoints");
    assert!(
        resumed.contains(checkpoints.to_str().unwrap()) && resumed.contains("(epoch 2, "),
        "{resumed}"
    );
    assert!(
        !rank0.contains("epoch 1/2 done"),
        "epoch 1 ran again:\n{rank0}"
    );
    assert!(rank0.contains("epoch 2/2 done"), "{rank0}");
    assert!(rank0.contains("summary: "), "{rank0}");
    read(&dirs[1].join("rank-1.log"));
}

/// (c) `-n 3` with 2 idle GPUs: exit 2 before anything starts; every GPU is listed with its
/// usage, the busy ones with why.
#[test]
fn too_few_idle_gpus_is_exit_2_naming_the_busy_ones() {
    let (gb, launch) = GpuBox::with_fake_launch();
    let out = gb.run(&["-n", "3", "configs/default.toml"], &launch);
    assert_eq!(out.code(), Some(2), "{}", both(&out));
    let err = &out.stderr;
    assert!(
        err.starts_with("gpu-box: error: -n 3 needs 3 idle GPUs, but only 2 of 4 are idle"),
        "{err}"
    );
    let gpu = |n: u32| {
        err.lines()
            .find(|l| l.starts_with(&format!("gpu-box:   GPU {n} (")))
            .unwrap_or_else(|| panic!("GPU {n} not listed:\n{err}"))
    };
    assert!(gpu(0).ends_with(": idle"), "{err}");
    assert!(gpu(2).ends_with(": idle"), "{err}");
    let g1 = gpu(1);
    assert!(
        g1.contains("40211/81559 MiB, 97% util")
            && g1.contains("memory used 40211 MiB > 1024 MiB")
            && g1.contains("utilization 97% > 10%"),
        "{g1}"
    );
    let g3 = gpu(3);
    assert!(
        g3.contains("512/81559 MiB, 64% util")
            && g3.contains("utilization 64% > 10%")
            && !g3.contains("memory used"),
        "{g3}"
    );
    assert!(err.contains("-n 2"), "suggests -n 2:\n{err}");
    assert!(gb.launch_args().is_empty(), "launch was started");
    assert!(gb.log_dirs("default").is_empty(), "a log dir was made");
    assert!(out.stdout.is_empty(), "{}", out.stdout);
}

/// (d) no nvidia-smi: exit 2 with a one-line message, nothing started.
#[test]
fn no_nvidia_smi_is_a_one_line_error() {
    let (gb, launch) = GpuBox::with_fake_launch();
    let missing = gb.path("no-such-nvidia-smi");
    let mut cmd = gb.command(&["configs/default.toml"], &launch);
    cmd.env("GPUBOX_NVIDIA_SMI", &missing);
    let out = gb.run_cmd(cmd);
    assert_one_line_error(&out, "no nvidia-smi");
    out.assert_stderr(missing.to_str().unwrap());
    assert!(gb.launch_args().is_empty() && gb.log_dirs("default").is_empty());

    // an nvidia-smi that fails (no driver) is the same kind of error, with its first line
    let broken = gb.path("broken-nvidia-smi");
    write_executable(
        &broken,
        "#!/bin/sh\necho \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\"\necho second line\nexit 9\n",
    );
    let mut cmd = gb.command(&["configs/default.toml"], &launch);
    cmd.env("GPUBOX_NVIDIA_SMI", &broken);
    let out = gb.run_cmd(cmd);
    assert_one_line_error(&out, "failing nvidia-smi");
    out.assert_stderr("couldn't communicate with the NVIDIA driver");
    assert!(gb.launch_args().is_empty());
}

/// `-n 1` takes the least used idle GPU (utilisation first), launch options after CONFIG pass
/// through unchanged, and the script exits with launch's exit code.
#[test]
fn least_used_first_options_pass_through_and_launch_exit_code_is_kept() {
    let (gb, launch) = GpuBox::with_fake_launch();
    let out = gb.run(
        &[
            "-n",
            "1",
            "configs/default.toml",
            "--set",
            "run.name=\"a b\"",
            "--max-restarts",
            "1",
        ],
        &launch,
    );
    assert_eq!(out.code(), Some(7), "launch's exit code\n{}", both(&out));
    let dirs = gb.log_dirs("default");
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    assert_eq!(
        gb.launch_args(),
        [
            "--gpu-ids",
            "0",
            "--rank-logs",
            dirs[0].to_str().unwrap(),
            "configs/default.toml",
            "--set",
            "run.name=\"a b\"",
            "--max-restarts",
            "1",
        ]
    );
    let picked = line_with(&out, "gpu-box: picked ");
    assert!(
        picked.contains("GPU 0 (3/81559 MiB, 0% util)") && picked.contains("-n 1"),
        "{picked}"
    );
    assert_line_has(
        &out,
        "gpu-box: not picked: ",
        "GPU 2 (1/81559 MiB, 2% util): idle",
    );
}

/// With CUDA_VISIBLE_DEVICES only the GPUs it lists are candidates (indices or UUID prefixes),
/// and launch gets their positions in that list.
#[test]
fn cuda_visible_devices_limits_the_candidates_and_launch_gets_positions() {
    let (gb, launch) = GpuBox::with_fake_launch();
    let mut cmd = gb.command(&["configs/default.toml"], &launch);
    // visible 0 = GPU 3 (busy), 1 = GPU 1 (busy), 2 = GPU 2 (idle); GPU 0 is not visible
    cmd.env("CUDA_VISIBLE_DEVICES", "3,GPU-bbbb,2");
    let out = gb.run_cmd(cmd);
    assert_eq!(out.code(), Some(7), "{}", both(&out));
    assert_eq!(&gb.launch_args()[..2], ["--gpu-ids", "2"]);
    assert_line_has(
        &out,
        "gpu-box: not picked: ",
        "GPU 0 (3/81559 MiB, 0% util): not in CUDA_VISIBLE_DEVICES",
    );
}

#[test]
fn help_and_command_line_errors() {
    let (gb, launch) = GpuBox::with_fake_launch();
    let out = gb.run(&["-h"], &launch);
    assert_eq!(out.code(), Some(0));
    assert!(
        out.stdout
            .starts_with("usage: scripts/gpu-box.sh [-n N|auto]"),
        "{}",
        out.stdout
    );
    for args in [
        &["-n", "0", "configs/default.toml"][..],
        &["--bogus", "configs/default.toml"],
        &[],
        &["configs/no-such.toml"],
        &["configs/default.toml", "--gpu-ids", "1"],
    ] {
        let out = gb.run(args, &launch);
        assert_one_line_error(&out, &format!("{args:?}"));
    }
    assert!(gb.launch_args().is_empty());
}
