//! `launch` as a drop-in for torchrun with what its users' scripts do: progress bars redrawn
//! with `\r` (real tqdm) move as they are drawn, and a line written in pieces is shown once it
//! has waited, not held until its end. The Python tests need the venv `scripts/setup.sh` makes
//! (with tqdm); without it they say so and pass as skipped.

mod support;

use std::path::PathBuf;
use std::time::Duration;

use support::*;

/// The venv of scripts/setup.sh with `module` importable; `None`, after a `skipped:` line,
/// without one.
fn venv_with(module: &str) -> Option<PathBuf> {
    let venv = std::env::var_os("GPTREC_TORCH_VENV").map(PathBuf::from);
    let python = venv.as_ref().map(|v| v.join("bin/python"));
    let found = python.filter(|p| {
        std::process::Command::new(p)
            .args(["-c", &format!("import {module}")])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    if found.is_none() {
        eprintln!("skipped: no venv with {module} (run scripts/setup.sh)");
    }
    found
}

/// A real tqdm bar, drawn on stderr with `\r` and no newline until its end, reaches the console
/// while the loop runs: the script waits at 2/5 until the test has seen "2/5" through `launch`
/// (a launch that held the bar until its line ended would never show it).
#[test]
fn a_tqdm_bar_moves_under_launch() {
    let Some(python) = venv_with("tqdm") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let gate = dir.path().join("go");
    let script = [
        "import os, sys, time",
        "from tqdm import tqdm",
        "for i in tqdm(range(5), desc='progress', mininterval=0, ascii=True):",
        "    while i == 2 and not os.path.exists(sys.argv[1]):",
        "        time.sleep(0.02)",
        "print('done', flush=True)",
    ]
    .join("\n");
    let gate_arg = gate.display().to_string();
    let py = python.display().to_string();
    let args = [
        "--num-processes",
        "1",
        "--",
        py.as_str(),
        "-c",
        &script,
        &gate_arg,
    ];
    let job = Live::new(launch_cmd(&args).spawn().expect("start launch"));
    job.wait_stderr("2/5", Duration::from_secs(60));
    assert!(!job.stdout_now().contains("done"), "{}", job.stdout_now());
    std::fs::write(&gate, "").unwrap();
    let out = job.finish(Duration::from_secs(60));
    out.assert_code(0);
    assert!(
        out.stderr.contains("[rank 0] progress:  40%"),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("5/5"), "{}", out.stderr);
    assert!(out.stdout.contains("[rank 0] done"), "{}", out.stdout);
}

/// A prompt-like partial line (no `\r`, no newline) is shown once it has waited, labelled once;
/// its end, written later, completes the same console line.
#[test]
fn a_partial_line_is_shown_while_its_end_is_awaited() {
    let dir = tempfile::tempdir().unwrap();
    let gate = dir.path().join("go");
    let script = format!(
        "printf 'loading... '; while [ ! -e '{}' ]; do sleep 0.02; done; printf 'ok\\n'",
        gate.display()
    );
    let args = ["--num-processes", "1", "--", "sh", "-c", script.as_str()];
    let job = Live::new(launch_cmd(&args).spawn().expect("start launch"));
    job.wait_output("[rank 0] loading... ", Duration::from_secs(60));
    std::fs::write(&gate, "").unwrap();
    let out = job.finish(Duration::from_secs(60));
    out.assert_code(0);
    assert_eq!(out.stdout, "[rank 0] loading... ok\n", "{}", out.all());
}

/// A real PyTorch script whose `main` is wrapped in torchrun's `@record` and raises: the summary's
/// root cause is the exception it recorded in `TORCHELASTIC_ERROR_FILE` (message, failing frame,
/// time), as torchrun's is; with `--log-dir` the file stays in torchrun's layout.
#[test]
fn a_recorded_exception_is_the_root_cause() {
    let Some(python) = venv_with("torch") else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let script = [
        "import os",
        "from torch.distributed.elastic.multiprocessing.errors import record",
        "@record",
        "def main():",
        "    if os.environ['RANK'] == '1':",
        "        raise ValueError('bad batch 3')",
        "main()",
    ]
    .join("\n");
    let py = python.display().to_string();
    let dir = logs.path().display().to_string();
    let args = [
        "--num-processes",
        "2",
        "--log-dir",
        &dir,
        "--",
        &py,
        "-c",
        &script,
    ];
    let out = launch(&args, Duration::from_secs(120));
    out.assert_code(1);
    out.assert_stderr_all(&[
        "  root cause: rank 1 ",
        "  error (recorded by the rank in its error file):",
        "    | ValueError: bad batch 3",
        "    | File \"<string>\", line 6, in main",
        "    | at 20",
    ]);
    let runs: Vec<_> = std::fs::read_dir(logs.path()).unwrap().flatten().collect();
    let error = runs[0].path().join("attempt_0/1/error.json");
    let text = std::fs::read_to_string(&error).unwrap();
    assert!(text.contains("ValueError: bad batch 3"), "{text}");
}

/// torchrun's environment beyond the contract, and every torchrun 2.11 flag accepted in one
/// command line: `--role` is the workers' ROLE_NAME, `--virtual-local-rank` gives each worker
/// LOCAL_RANK 0 and its own device only, and the error file is each rank's own.
#[test]
fn torchruns_environment_and_flags() {
    let script = "echo rank=$RANK local=$LOCAL_RANK cuda=$CUDA_VISIBLE_DEVICES role=$ROLE_NAME \
                  store=$TORCHELASTIC_USE_AGENT_STORE nccl=$TORCH_NCCL_ASYNC_ERROR_HANDLING \
                  signals=$TORCHELASTIC_SIGNALS_TO_HANDLE error=$TORCHELASTIC_ERROR_FILE";
    let args = [
        "--nproc-per-node",
        "2",
        "--monitor-interval",
        "0.5",
        "--start-method",
        "fork",
        "--event-log-handler",
        "null",
        "--role",
        "trainer",
        "--logs-specs",
        "default",
        "--signals-to-handle",
        "SIGTERM,SIGUSR1",
        "--virtual-local-rank",
        "--no-python",
        "sh",
        "-c",
        script,
    ];
    let mut cmd = launch_cmd(&args);
    cmd.env("CUDA_VISIBLE_DEVICES", "4,6")
        .env_remove("TORCH_NCCL_ASYNC_ERROR_HANDLING");
    let out = wait_output(cmd.spawn().unwrap(), Duration::from_secs(60));
    out.assert_code(0);
    let mut lines = rank_lines(&out.stdout);
    lines.sort();
    assert_eq!(lines.len(), 2, "{}", out.all());
    for (rank, line) in &lines {
        let gpu = ["4", "6"][*rank as usize];
        let want = format!(
            "rank={rank} local=0 cuda={gpu} role=trainer store=False nccl=1 signals=SIGTERM,SIGUSR1 error="
        );
        assert!(line.starts_with(&want), "{line}");
        assert!(
            line.ends_with(&format!("/attempt_0/{rank}/error.json")),
            "{line}"
        );
    }
    assert!(!out.stderr.contains("error"), "{}", out.stderr);
}
