//! Whose output reaches the console: `--local-ranks-filter` (torchrun's spelling) shows only the
//! listed local ranks while every rank still goes to `--log-dir` (torchrun's layout), a hidden rank that fails is
//! shown with the last lines it wrote, and `--redirects` / `--tee` as torchrun spells them.

mod support;

use std::time::Duration;

use support::*;

const T: Duration = Duration::from_secs(60);

/// `launch --num-processes N --master-port 0 EXTRA... -- sh -c SCRIPT`.
fn run(n: &str, extra: &[&str], script: &str) -> Output {
    let mut args = vec!["--num-processes", n, "--master-port", "0"];
    args.extend(extra);
    args.extend(["--", "sh", "-c", script]);
    launch(&args, T)
}

/// The file of torchrun's layout under `root` (one launch's run directory) for `local_rank`'s
/// `name` (`stdout.log`, `stderr.log`) in attempt 0.
fn layout_file(root: &std::path::Path, local_rank: u32, name: &str) -> std::path::PathBuf {
    let runs: Vec<_> = std::fs::read_dir(root).unwrap().flatten().collect();
    assert_eq!(runs.len(), 1, "one run directory under {}", root.display());
    let path = runs[0]
        .path()
        .join(format!("attempt_0/{local_rank}/{name}"));
    assert!(path.is_file(), "{} is missing", path.display());
    path
}

fn ranks_on_console(out: &Output) -> Vec<u32> {
    let text = format!("{}{}", out.stdout, out.stderr);
    let mut ranks: Vec<u32> = rank_lines(&text).into_iter().map(|(r, _)| r).collect();
    ranks.sort();
    ranks.dedup();
    ranks
}

#[test]
fn only_the_filtered_ranks_reach_the_console_and_every_rank_its_log() {
    let logs = tempfile::tempdir().unwrap();
    let dir = logs.path().to_str().unwrap();
    let out = run(
        "4",
        &["--local-ranks-filter", "0,3", "--log-dir", dir],
        "echo out $RANK; echo err $RANK >&2",
    );
    out.assert_code(0);
    assert_eq!(
        ranks_on_console(&out),
        vec![0, 3],
        "{}{}",
        out.stdout,
        out.stderr
    );
    // torchrun's layout: the streams apart, per attempt and local rank, with its error file's
    // directory; no secret run id in the path.
    for rank in 0..4 {
        let read = |name| std::fs::read_to_string(layout_file(logs.path(), rank, name)).unwrap();
        assert_eq!(read("stdout.log"), format!("out {rank}\n"));
        assert_eq!(read("stderr.log"), format!("err {rank}\n"));
    }
}

/// A hidden rank that fails is shown, with the last lines it wrote while hidden; the ranks the
/// teardown stopped stay hidden.
#[test]
fn a_hidden_rank_that_fails_is_shown_with_its_last_lines() {
    let out = run(
        "3",
        &["--local-ranks-filter", "0"],
        "echo hello $RANK >&2; if [ $RANK = 2 ]; then echo 'the real error' >&2; exit 4; fi; sleep 30",
    );
    out.assert_code(4);
    out.assert_stderr_all(&[
        "rank 2 (local rank 2, hidden by --local-ranks-filter) failed: exit code 4; its last lines:\n[rank 2] hello 2\n[rank 2] the real error\n",
        "root cause: rank 2",
    ]);
    assert!(!out.stderr.contains("[rank 1]"), "{}", out.stderr);
    out.assert_ended_within(10);
}

/// Workers' stdin is /dev/null: a hidden rank that reads it is not left stopped in the read
/// (as a rank reading a terminal from the background would be); it reads the end of input,
/// and when it fails on that it is shown with its last lines like any failing hidden rank.
#[test]
fn a_hidden_rank_reading_stdin_is_not_left_waiting_and_is_shown() {
    let out = run(
        "2",
        &["--local-ranks-filter", "0"],
        "if [ $RANK = 1 ]; then echo 'your answer?' >&2; read answer || { echo 'no input: stdin is closed' >&2; exit 5; }; fi; sleep 30",
    );
    out.assert_code(5);
    out.assert_stderr_all(&[
        "rank 1 (local rank 1, hidden by --local-ranks-filter) failed: exit code 5; its last lines:\n[rank 1] your answer?\n[rank 1] no input: stdin is closed\n",
    ]);
    out.assert_ended_within(10);
}

/// `--redirects 1:2`: local rank 1's stderr goes to its log file only; its stdout and every
/// other stream still reach the console. `--tee` is accepted as torchrun spells it.
#[test]
fn redirected_streams_go_to_the_log_only() {
    let logs = tempfile::tempdir().unwrap();
    let dir = logs.path().to_str().unwrap();
    let script = "echo out $RANK; echo err $RANK >&2";
    let out = run("2", &["--redirects", "1:2", "--log-dir", dir], script);
    out.assert_code(0);
    assert!(out.stdout.contains("[rank 1] out 1"), "{}", out.stdout);
    assert!(out.stderr.contains("[rank 0] err 0"), "{}", out.stderr);
    assert!(!out.stderr.contains("err 1"), "{}", out.stderr);
    let log = std::fs::read_to_string(layout_file(logs.path(), 1, "stderr.log")).unwrap();
    assert_eq!(log, "err 1\n");
    let logs = tempfile::tempdir().unwrap();
    let dir = logs.path().to_str().unwrap();
    run("2", &["-t", "3", "-r", "0", "--log-dir", dir], script).assert_code(0);
    // Without --log-dir, as torchrun: a temporary directory, kept and named at the start.
    let out = run("2", &["--redirects", "2"], script);
    out.assert_code(0);
    let said = out
        .stderr
        .lines()
        .find_map(|l| l.strip_prefix("launch: logs: "))
        .unwrap_or_else(|| panic!("where the logs are is not said:\n{}", out.stderr));
    let run_dir = std::path::PathBuf::from(said.split("/attempt_N/").next().unwrap());
    let log = std::fs::read_to_string(run_dir.join("attempt_0/0/stderr.log")).unwrap();
    assert_eq!(log, "err 0\n");
    std::fs::remove_dir_all(run_dir.parent().unwrap()).unwrap();
}

/// `--rank-logs DIR`: each rank's lines, both streams, appended to `DIR/rank-N.log`.
#[test]
fn rank_logs_hold_both_streams_of_each_rank() {
    let logs = tempfile::tempdir().unwrap();
    let dir = logs.path().to_str().unwrap();
    let script = "echo out $RANK; echo err $RANK >&2";
    for _ in 0..2 {
        run("2", &["--rank-logs", dir], script).assert_code(0);
    }
    for rank in 0..2 {
        let log = std::fs::read_to_string(logs.path().join(format!("rank-{rank}.log"))).unwrap();
        assert_eq!(log.matches(&format!("out {rank}\n")).count(), 2, "{log}");
        assert_eq!(log.matches(&format!("err {rank}\n")).count(), 2, "{log}");
    }
}

#[test]
fn bad_console_flags_are_one_line_errors() {
    for (extra, want) in [
        (
            &["--local-ranks-filter", "2"][..],
            "--local-ranks-filter 2: this node runs local ranks 0..1",
        ),
        (
            &["--local-ranks-filter", "0,x"][..],
            "expected local ranks separated by commas",
        ),
        (
            &["--tee", "5", "--log-dir", "x"][..],
            "expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both)",
        ),
    ] {
        let out = run("2", extra, "true");
        out.assert_code(2);
        out.assert_stderr(want);
        assert_eq!(out.stderr.trim_end().lines().count(), 1, "{}", out.stderr);
    }
}
