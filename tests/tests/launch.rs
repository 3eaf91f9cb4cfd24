//! End-to-end tests of `launch` with real processes: small shell programs as workers, real
//! signals, real sockets. "No process left behind" is checked by looking for processes that
//! carry the run's id in their environment, never assumed.

mod support;

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::process::Command;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use support::*;

const T: Duration = Duration::from_secs(60);

fn sh(script: &str) -> Vec<String> {
    vec!["--".into(), "sh".into(), "-c".into(), script.into()]
}

fn args<'a>(head: &[&'a str], tail: &'a [String]) -> Vec<&'a str> {
    head.iter()
        .copied()
        .chain(tail.iter().map(String::as_str))
        .collect()
}

/// `--num-processes N --master-port 0 EXTRA... -- sh -c SCRIPT`.
fn flags<'a>(n: &'a str, extra: &[&'a str], script: &'a [String]) -> Vec<&'a str> {
    let head = ["--num-processes", n, "--master-port", "0"];
    args(&[&head[..], extra].concat(), script)
}

/// `--num-processes N --master-port 0 --run-id ID -- sh -c SCRIPT`.
fn run_args<'a>(n: &'a str, id: &'a str, script: &'a [String]) -> Vec<&'a str> {
    flags(n, &["--run-id", id], script)
}

/// `launch --num-processes N --master-port 0 EXTRA... --run-id ID -- sh -c SCRIPT`, not started.
fn run_cmd(n: &str, extra: &[&str], id: &str, script: &[String]) -> Command {
    launch_cmd(&flags(n, &[extra, &["--run-id", id]].concat(), script))
}

/// [`run_cmd`] run to its end (killed after [`T`]).
fn launch_run(n: &str, extra: &[&str], id: &str, script: &[String]) -> Output {
    wait_output(
        run_cmd(n, extra, id, script).spawn().expect("start launch"),
        T,
    )
}

/// Panics unless no process of the run is left right now.
#[track_caller]
fn assert_none_left(id: &str, what: &str) {
    assert_eq!(processes_of_run(id), Vec::<i32>::new(), "{what}");
}

/// `launch --num-processes 3 --master-port 0 --run-id ID -- sh -c SCRIPT`.
fn launch_three(id: &str, script: &[String]) -> Output {
    launch(&run_args("3", id, script), T)
}

#[test]
fn three_workers_get_the_torchrun_environment() {
    let id = unique_run_id("env");
    let script = sh("env | grep -E '^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_RANK|ROLE_WORLD_SIZE|ROLE_NAME|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_RESTART_COUNT|TORCHELASTIC_MAX_RESTARTS|TORCHELASTIC_RUN_ID|OMP_NUM_THREADS)='");
    let out = launch_three(&id, &script);
    out.assert_code(0);
    let mut seen: BTreeMap<u32, BTreeMap<String, String>> = BTreeMap::new();
    for (rank, text) in rank_lines(&out.stdout) {
        let (k, v) = text.split_once('=').expect("KEY=VALUE");
        seen.entry(rank).or_default().insert(k.into(), v.into());
    }
    assert_eq!(seen.len(), 3, "{}", out.stdout);
    let port = &seen[&0]["MASTER_PORT"];
    assert_ne!(port, "0", "port 0 must be replaced by a real port");
    for (rank, vars) in &seen {
        let r = rank.to_string();
        let expect = [
            ("RANK", r.as_str()),
            ("LOCAL_RANK", &r),
            ("WORLD_SIZE", "3"),
            ("LOCAL_WORLD_SIZE", "3"),
            ("GROUP_RANK", "0"),
            ("GROUP_WORLD_SIZE", "1"),
            ("ROLE_RANK", &r),
            ("ROLE_WORLD_SIZE", "3"),
            ("ROLE_NAME", "default"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", port),
            ("TORCHELASTIC_RESTART_COUNT", "0"),
            ("TORCHELASTIC_MAX_RESTARTS", "0"),
            ("TORCHELASTIC_RUN_ID", &id),
        ];
        for (k, v) in expect {
            assert_eq!(vars.get(k).map(String::as_str), Some(v), "rank {rank} {k}");
        }
        let threads: usize = vars["OMP_NUM_THREADS"].parse().unwrap();
        assert!(threads >= 1);
    }
}

#[test]
fn user_omp_num_threads_is_kept() {
    let script = sh("echo omp=$OMP_NUM_THREADS");
    let out = launch_cmd(&flags("2", &[], &script))
        .env("OMP_NUM_THREADS", "7")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        rank_lines(&stdout)
            .iter()
            .filter(|(_, t)| t == "omp=7")
            .count(),
        2
    );
}

#[test]
fn failing_worker_gives_its_exit_code_a_summary_and_no_leftovers() {
    let id = unique_run_id("exit3");
    // Rank 1 fails; the others (and a child of each) would run for a minute.
    let script = sh(
        "if [ \"$RANK\" = 1 ]; then sleep 0.3; echo 'about to fail' >&2; echo 'ValueError: boom' >&2; exit 3; fi; sleep 60 & wait",
    );
    let out = launch_run("3", &["--grace-period", "5"], &id, &script);
    out.assert_code(3);
    out.assert_stderr_all(&[
        "root cause: rank 1 (local_rank 1, pid ",
        "exit code 3 after",
        "    | ValueError: boom",
        "launch exits with 3",
    ]);
    // Well-behaved workers end on SIGTERM: teardown must not wait for the grace period.
    out.assert_ended_within(4);
    assert_none_left(&id, "processes left behind");
}

#[test]
fn worker_killed_by_sigkill_is_reported_with_the_signal() {
    let id = unique_run_id("kill9");
    let script = sh("if [ \"$RANK\" = 2 ]; then sleep 0.2; kill -9 $$; fi; sleep 60 & wait");
    let out = launch_three(&id, &script);
    assert_eq!(out.code(), Some(128 + 9), "{}", out.stderr);
    out.assert_stderr_all(&["root cause: rank 2", "killed by SIGKILL"]);
    assert_none_left(&id, "processes left behind");
}

#[test]
fn worker_ignoring_sigterm_is_killed_after_the_grace_period() {
    let id = unique_run_id("grace");
    let dir = tempfile::tempdir().unwrap();
    // Rank 0 fails only once rank 1 has made itself deaf to SIGTERM.
    let script = sh(&format!(
        "if [ \"$RANK\" = 0 ]; then while [ ! -e {0}/deaf ]; do sleep 0.02; done; exit 5; fi; trap '' TERM; touch {0}/deaf; while true; do sleep 0.05; done",
        dir.path().display()
    ));
    let out = launch_run("2", &["--grace-period", "1"], &id, &script);
    out.assert_code(5);
    out.assert_stderr("sending SIGKILL");
    assert!(out.elapsed >= Duration::from_secs(1), "{:?}", out.elapsed);
    out.assert_ended_within(8);
    assert_none_left(&id, "processes left behind");
}

fn signal_test(signal: Signal) {
    let id = unique_run_id(signal.as_str());
    let dir = tempfile::tempdir().unwrap();
    // Each worker records the signal it got, then exits as a well-behaved program does.
    let script = sh(&format!(
        "trap 'echo got-INT > {0}/$RANK; exit 130' INT; trap 'echo got-TERM > {0}/$RANK; exit 143' TERM; trap 'echo got-HUP > {0}/$RANK; exit 129' HUP; echo ready; sleep 60 & wait",
        dir.path().display()
    ));
    let child = launch_cmd(&run_args("3", &id, &script)).spawn().unwrap();
    let pid = Pid::from_raw(child.id() as i32);
    assert_eq!(wait_processes(&id, 6, T).len(), 6, "3 workers + 3 sleeps");
    std::thread::sleep(Duration::from_millis(200)); // let the traps be installed
    kill(pid, signal).unwrap();
    let out = wait_output(child, T);
    assert_eq!(out.code(), Some(128 + signal as i32), "{}", out.stderr);
    let name = &signal.as_str()[3..];
    for rank in 0..3 {
        let got = std::fs::read_to_string(dir.path().join(rank.to_string())).unwrap_or_default();
        assert_eq!(
            got.trim(),
            format!("got-{name}"),
            "rank {rank}: {}",
            out.stderr
        );
    }
    assert_no_processes(&id, Duration::from_secs(3));
}

#[test]
fn sigint_to_launch_is_forwarded() {
    signal_test(Signal::SIGINT);
}

#[test]
fn sigterm_to_launch_is_forwarded() {
    signal_test(Signal::SIGTERM);
}

#[test]
fn sighup_to_launch_is_forwarded() {
    signal_test(Signal::SIGHUP);
}

/// Two workers that ignore `traps` (`INT`, `INT TERM`) under `launch --grace-period GRACE`,
/// running and with their traps set: the child and `launch`'s pid.
fn deaf_workers(id: &str, traps: &str, grace: &str) -> (std::process::Child, Pid) {
    let script = sh(&format!(
        "trap '' {traps}; echo ready; while true; do sleep 0.05; done"
    ));
    let child = run_cmd("2", &["--grace-period", grace], id, &script)
        .spawn()
        .unwrap();
    let pid = Pid::from_raw(child.id() as i32);
    // 2 workers (and, now and then, their `sleep`s).
    assert!(wait_processes(id, 2, T).len() >= 2);
    std::thread::sleep(Duration::from_millis(200)); // let the traps be installed
    (child, pid)
}

/// After Ctrl-C the grace-period line names the signal the workers were sent (SIGINT), not
/// SIGTERM.
#[test]
fn grace_period_after_sigint_names_sigint() {
    let id = unique_run_id("int-grace");
    let (child, pid) = deaf_workers(&id, "INT", "1");
    kill(pid, Signal::SIGINT).unwrap();
    let out = wait_output(child, T);
    out.assert_code(130);
    out.assert_stderr("2 worker(s) still running 1.0 s after SIGINT: sending SIGKILL");
    assert!(!out.stderr.contains("after SIGTERM"), "{}", out.stderr);
    assert_no_processes(&id, Duration::from_secs(3));
}

#[test]
fn second_sigint_kills_at_once() {
    let id = unique_run_id("int2");
    let (child, pid) = deaf_workers(&id, "INT TERM", "30");
    kill(pid, Signal::SIGINT).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    kill(pid, Signal::SIGINT).unwrap();
    let out = wait_output(child, T);
    out.assert_code(130);
    out.assert_ended_within(10);
    out.assert_stderr("killing every worker now");
    assert_no_processes(&id, Duration::from_secs(3));
}

#[test]
fn sigint_during_teardown_keeps_the_root_cause_and_ends_it_now() {
    let id = unique_run_id("int-after-fail");
    let dir = tempfile::tempdir().unwrap();
    let script = sh(&format!(
        "if [ \"$RANK\" = 0 ]; then while [ ! -e {0}/deaf ]; do sleep 0.02; done; echo 'the real error' >&2; exit 7; fi; trap '' TERM INT; touch {0}/deaf; while true; do sleep 0.05; done",
        dir.path().display()
    ));
    let extra = ["--grace-period", "30", "--max-restarts", "3"];
    let live = Live::new(run_cmd("2", &extra, &id, &script).spawn().unwrap());
    live.wait_stderr("rank 0 (pid", T);
    kill(live.pid(), Signal::SIGINT).unwrap();
    let out = live.finish(T);
    out.assert_code(7);
    out.assert_ended_within(20);
    out.assert_stderr_all(&["root cause: rank 0", "| the real error", "not restarting"]);
    assert!(
        !out.stderr.contains("restarting the worker group"),
        "{}",
        out.stderr
    );
    assert_no_processes(&id, Duration::from_secs(3));
}

#[test]
fn last_stderr_line_without_newline_is_kept() {
    let out = launch(
        &[
            "--master-port",
            "0",
            "--",
            "sh",
            "-c",
            "printf 'final words' >&2; exit 1",
        ],
        T,
    );
    out.assert_code(1);
    out.assert_stderr_all(&["[rank 0] final words\n", "    | final words"]);
}

/// Starts `launch` with `flags` on `script` (run id `id`), waits for `expected` processes of the
/// run, SIGKILLs `launch` and checks that nothing of the run is left.
fn sigkill_leaves_nothing(id: &str, flags: &[&str], script: &str, expected: usize, what: &str) {
    sigkill_after(id, flags, script, expected, what, Duration::ZERO)
}

/// [`sigkill_leaves_nothing`], killing `launch` `after` its processes are all there.
fn sigkill_after(
    id: &str,
    flags: &[&str],
    script: &str,
    expected: usize,
    what: &str,
    after: Duration,
) {
    let mut head = vec!["--master-port", "0", "--run-id", id];
    head.extend_from_slice(flags);
    let mut child = launch_cmd(&args(&head, &sh(script))).spawn().unwrap();
    assert_eq!(wait_processes(id, expected, T).len(), expected, "{what}");
    std::thread::sleep(after);
    kill(Pid::from_raw(child.id() as i32), Signal::SIGKILL).unwrap();
    let _ = child.wait();
    assert_eq!(
        wait_no_processes(id, Duration::from_secs(5)),
        Vec::<i32>::new(),
        "orphans survived SIGKILL of launch ({what})"
    );
}

/// A kill a while into the run (the guard long started and told of every group) leaves nothing
/// either (see launcher/src/watchdog.rs).
#[test]
fn sigkill_to_launch_a_second_in_leaves_no_worker_alive() {
    sigkill_after(
        &unique_run_id("orphan-late"),
        &["--num-processes", "2"],
        "trap '' TERM; sleep 60 & sleep 61 & wait",
        6,
        "2 workers + 4 sleeps, killed 1 s in",
        Duration::from_secs(1),
    );
}

#[test]
fn sigkill_to_launch_leaves_no_worker_alive() {
    // Workers with children of their own, ignoring SIGTERM for good measure.
    sigkill_leaves_nothing(
        &unique_run_id("orphan"),
        &["--num-processes", "3"],
        "trap '' TERM; sleep 60 & sleep 61 & wait",
        9,
        "3 workers + 6 sleeps",
    );
}

/// The orphan guard still stands after a restart (the cleanup of escaped processes leaves the
/// launcher's own children alone): SIGKILL of `launch` in the second round leaves nothing.
#[test]
fn sigkill_to_launch_after_a_restart_leaves_no_worker_alive() {
    sigkill_leaves_nothing(
        &unique_run_id("orphan2"),
        &["--num-processes", "2", "--max-restarts", "1"],
        "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then exit 1; fi; trap '' TERM; sleep 60 & sleep 61 & wait",
        6,
        "second round: 2 workers + 4 sleeps",
    );
}

#[test]
fn max_restarts_restarts_the_group_until_it_succeeds() {
    let id = unique_run_id("restart");
    let script = sh(
        "echo \"round $TORCHELASTIC_RESTART_COUNT of $TORCHELASTIC_MAX_RESTARTS\"; if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 1 ]; then exit 4; fi; sleep 0.2",
    );
    let out = launch_run("2", &["--max-restarts", "2"], &id, &script);
    out.assert_code(0);
    out.assert_stderr_all(&[
        "rank 1 failed (exit code 4)",
        "restarting the worker group (restart 1 of 2, TORCHELASTIC_RESTART_COUNT=1)",
    ]);
    let lines = rank_lines(&out.stdout);
    for rank in 0..2 {
        assert!(
            lines.contains(&(rank, "round 1 of 2".to_string())),
            "{}",
            out.stdout
        );
    }
    assert!(
        !out.stdout.contains("round 2"),
        "only one restart was needed"
    );
}

#[test]
fn max_restarts_exhausted_reports_the_last_failure() {
    let script = sh("exit 6");
    let out = launch(&flags("1", &["--max-restarts", "2"], &script), T);
    out.assert_code(6);
    assert_eq!(out.stderr.matches("restarting the worker group").count(), 2);
    out.assert_stderr("started 3 times");
}

/// A port the user named that is taken is refused in one line naming the process that holds
/// it, never swapped for another.
#[test]
fn a_taken_port_is_refused_naming_its_holder() {
    let holder = TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = holder.local_addr().unwrap().port().to_string();
    let out = launch(
        &args(
            &["--num-processes", "2", "--master-port", &taken],
            &sh("true"),
        ),
        T,
    );
    out.assert_code(2);
    out.assert_stderr(format!(
        "launch: error: master port {taken} (flag --master-port) on 127.0.0.1 is in use by pid {} (",
        std::process::id()
    ));
    out.assert_stderr("pick another, or leave --master-port out for a free one");
    assert_eq!(out.stderr.lines().count(), 1, "{}", out.stderr);
}

/// Without --master-port, single-node jobs take a free port that `launch` binds before
/// anything starts and hands to rank 0's store: jobs started together on one box all succeed
/// (each was refused or crossed into another's store when they all took 29500).
#[test]
fn single_node_jobs_started_together_all_succeed() {
    let dir = tempfile::tempdir().unwrap();
    let sets = tiny_bpr_sets(dir.path());
    let children: Vec<_> = (0..3)
        .map(|i| {
            let name = format!("run.name=\"job{i}\"");
            let mut args = vec!["--num-processes", "2", "configs/default.toml"];
            args.extend(sets.iter().map(String::as_str));
            args.extend(["--set", &name]);
            launch_cmd(&args).spawn().unwrap()
        })
        .collect();
    for child in children {
        let out = wait_output(child, T);
        out.assert_code(0);
        // Rank 0 bound no port itself: the launcher holds it, so a bind would have failed.
        out.assert_stdout_all(&["[rank 0]   test ndcg@10"]);
    }
}

#[test]
fn taken_port_on_a_multi_node_master_is_an_error() {
    let holder = TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = holder.local_addr().unwrap().port().to_string();
    let out = launch(
        &[
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--master-port",
            &taken,
            "--run-id",
            "shared-secret",
            "--",
            "true",
        ],
        T,
    );
    out.assert_code(2);
    out.assert_stderr(format!("is in use by pid {} (", std::process::id()));
    out.assert_stderr("; the other nodes expect it");
}

#[test]
fn lines_are_never_interleaved_and_streams_stay_apart() {
    // Three workers write long lines as fast as they can, to both streams.
    let script = sh(
        "pad=$(printf '%0300d' 0); i=0; while [ $i -lt 400 ]; do echo \"r$RANK l$i $pad\"; echo \"e$RANK l$i\" >&2; i=$((i+1)); done",
    );
    let out = launch(&flags("3", &[], &script), T);
    out.assert_code(0);
    let pad = "0".repeat(300);
    let mut counts = [0usize; 3];
    for line in out.stdout.lines() {
        let (rank, text) = rank_lines(line)
            .pop()
            .unwrap_or_else(|| panic!("bad line {line:?}"));
        let (tag, rest) = text.split_once(" l").unwrap();
        assert_eq!(
            tag,
            format!("r{rank}"),
            "line of rank {rank} carries another rank's text"
        );
        let (_, tail) = rest.split_once(' ').unwrap();
        assert_eq!(tail, pad, "line cut or mixed: {line:?}");
        counts[rank as usize] += 1;
    }
    assert_eq!(counts, [400, 400, 400]);
    let err_lines: Vec<(u32, String)> = rank_lines(&out.stderr);
    assert_eq!(err_lines.len(), 1200, "stderr lines stay on stderr");
    assert!(err_lines
        .iter()
        .all(|(r, t)| t.starts_with(&format!("e{r} l"))));
}

#[test]
fn rank_logs_get_one_file_per_rank() {
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    let script = sh("echo out-$RANK; echo err-$RANK >&2");
    let out = launch(
        &flags("2", &["--rank-logs", logs.to_str().unwrap()], &script),
        T,
    );
    out.assert_code(0);
    for rank in 0..2 {
        let text = std::fs::read_to_string(logs.join(format!("rank-{rank}.log"))).unwrap();
        assert!(text.contains(&format!("out-{rank}\n")), "{text}");
        assert!(text.contains(&format!("err-{rank}\n")), "{text}");
    }
    assert!(
        out.stdout.contains("] out-1"),
        "console still gets the lines"
    );
}

/// The orphan guard leaves with a run that ends normally (`launch` tells it to, and does not
/// wait for it): nothing that carries the launcher's environment outlives the run. (A guard
/// that was not told would sweep `/dev/shm` for 2 s before it leaves.)
#[test]
fn a_finished_run_leaves_no_orphan_guard() {
    let mark = unique_run_id("guard");
    let script = sh("true");
    let mut cmd = launch_cmd(&flags("2", &[], &script));
    let out = wait_output(cmd.env("GPTREC_E2E_MARK", &mark).spawn().unwrap(), T);
    out.assert_code(0);
    let left = support::slurm::wait_no_processes_with_env(
        "GPTREC_E2E_MARK",
        &mark,
        Duration::from_secs(1),
    );
    assert_eq!(
        left,
        Vec::<String>::new(),
        "the orphan guard outlived the run"
    );
}

#[test]
fn program_that_cannot_start_is_reported() {
    let out = launch(&["--master-port", "0", "--", "/nonexistent/program"], T);
    out.assert_code(127);
    out.assert_stderr("cannot start rank 0 (/nonexistent/program)");
}

#[test]
fn dry_run_prints_the_plan_and_starts_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("started");
    let out = launch(
        &[
            "--dry-run",
            "--num-processes",
            "2",
            "--",
            "touch",
            marker.to_str().unwrap(),
        ],
        T,
    );
    out.assert_code(0);
    assert!(
        out.stdout
            .contains("world size:   2 = 1 node(s) x 2 process(es)"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains("local rank 1: device cpu"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains("RANK=1 LOCAL_RANK=1 WORLD_SIZE=2"),
        "{}",
        out.stdout
    );
    std::thread::sleep(Duration::from_millis(100));
    assert!(!marker.exists(), "a dry run started the program");
}

#[test]
fn dry_run_shows_the_batch_derivation_of_the_config() {
    let out = launch(
        &[
            "--dry-run",
            "--num-processes",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--master-addr",
            "10.9.9.9",
            "configs/default.toml",
            "--set",
            "batch.micro=8",
        ],
        T,
    );
    out.assert_code(0);
    assert!(
        out.stdout
            .contains("batch:        micro 8 x grad_accum 6 x world 4 = global 192"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout
            .contains("--set batch.micro=8 configs/default.toml"),
        "{}",
        out.stdout
    );
}

#[test]
fn dry_run_rejects_a_batch_that_does_not_divide() {
    let out = launch(
        &["--dry-run", "--num-processes", "5", "configs/default.toml"],
        T,
    );
    out.assert_code(2);
    let first = out.stderr.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("launch: error: configs/default.toml: batch:"),
        "{}",
        out.stderr
    );
    assert!(first.contains("world 5"), "{first}");
    assert_eq!(
        out.stderr.lines().count(),
        1,
        "one-line error: {}",
        out.stderr
    );
}

#[test]
fn dry_run_rejects_bad_config_input() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[run]\nname = \"x\"\n[batch]\nmicro = 4\nglobal = 8\nmicr = 3\n",
    )
    .unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec![bad.display().to_string()], "bad.toml:6"),
        (
            vec![
                "configs/default.toml".into(),
                "--set".into(),
                "batch.micr=4".into(),
            ],
            "batch.micr=4",
        ),
        (
            vec![
                "configs/default.toml".into(),
                "--set".into(),
                "batch.micro=abc".into(),
            ],
            "batch.micro",
        ),
        (vec!["does/not/exist.toml".into()], "does/not/exist.toml"),
    ];
    for (extra, needle) in cases {
        let mut a = vec!["--dry-run".to_string()];
        a.extend(extra);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let out = launch(&a, T);
        assert_eq!(out.code(), Some(2), "{a:?}: {}", out.stderr);
        assert!(out.stderr.contains(needle), "{a:?}: {}", out.stderr);
        assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
        assert_eq!(
            out.stderr.trim_end().lines().count(),
            1,
            "{a:?}: {}",
            out.stderr
        );
    }
}

#[test]
fn bad_cli_input_is_rejected_without_panic() {
    for (a, needle) in [
        (&["--num-processes", "0", "--", "true"][..], "at least 1"),
        (
            &["--num-processes", "x", "--", "true"],
            "expected a positive number",
        ),
        (&["--nnodes", "3:1", "--", "true"], "above the maximum"),
        (
            &["--nnodes", "1:3", "--require-secret", "--", "true"],
            "traffic is unauthenticated",
        ),
        (
            &["--nnodes", "2", "--", "true"],
            "2 nodes (flag --nnodes) but no node rank: give each node its own --node-rank (0..1)",
        ),
        (&["--frobnicate", "--", "true"], "--frobnicate"),
        (&[][..], "nothing to run"),
        (
            &["--nnodes", "2", "--node-rank", "5", "--", "true"],
            "out of range",
        ),
        (&["--master-port", "99999", "--", "true"], "99999"),
        (
            &["--grace-period", "soon", "--", "true"],
            "expected seconds",
        ),
        (
            &["--num-processes", "-1", "--", "true"],
            "invalid value '-1' for '--num-processes",
        ),
        (
            &["--grace-period", "-1", "--", "true"],
            "invalid value '-1' for '--grace-period",
        ),
    ] {
        let out = launch(a, T);
        assert_eq!(out.code(), Some(2), "{a:?}: {}", out.stderr);
        assert!(out.stderr.contains(needle), "{a:?}: {}", out.stderr);
        assert!(!out.stderr.contains("panicked"), "{a:?}: {}", out.stderr);
    }
}

/// A program given where the config goes (torchrun's habit) is told to go after `--`.
/// torchrun's own command lines run unchanged: a script and its arguments (`python3` unless
/// `--no-python`), a module with `-m`, a program named where the script goes; the script's own
/// options are its own, not `launch`'s.
#[test]
fn torchrun_command_lines_run_scripts_and_modules() {
    let dir = tempfile::tempdir().unwrap();
    let show = "import os, sys\nprint('rank', os.environ['RANK'], sys.argv[1:])\n";
    std::fs::write(dir.path().join("train.py"), show).unwrap();
    std::fs::create_dir(dir.path().join("pkg")).unwrap();
    std::fs::write(dir.path().join("pkg/__init__.py"), "").unwrap();
    std::fs::write(dir.path().join("pkg/train.py"), show).unwrap();
    let script = dir.path().join("train.py").display().to_string();
    let run = |args: &[&str]| {
        let mut all = vec!["--nproc-per-node", "2", "--master-port", "0"];
        all.extend(args);
        let mut cmd = launch_cmd(&all);
        cmd.current_dir(dir.path());
        wait_output(cmd.spawn().unwrap(), T)
    };
    let want = |out: &Output, args: &str| {
        out.assert_code(0);
        for rank in 0..2 {
            let line = format!("[rank {rank}] rank {rank} {args}");
            assert!(
                out.stdout.contains(&line),
                "{line}: {}{}",
                out.stdout,
                out.stderr
            );
        }
    };
    want(
        &run(&[&script, "--lr", "3e-4", "--set", "x"]),
        "['--lr', '3e-4', '--set', 'x']",
    );
    want(
        &run(&["-m", "pkg.train", "--epochs", "2"]),
        "['--epochs', '2']",
    );
    want(&run(&["python3", &script, "-v"]), "['-v']");
    want(&run(&["--no-python", "python3", &script]), "[]");
    let missing = run(&["missing.py"]);
    missing.assert_code(2);
    missing.assert_stderr("launch: error: missing.py: no such file (launch runs it as `python3 missing.py` on every worker)");
    let out = launch(&["--gpu-ids", "all", "--", "true"], T);
    out.assert_code(2);
    out.assert_stderr("launch: error: --gpu-ids all: no GPU is visible on this node");
}

#[test]
fn worker_under_launch_reads_its_environment_and_config() {
    let dir = tempfile::tempdir().unwrap();
    let sets = ["data.synthetic=\"tiny\"", "train.epochs=1"];
    let out = launch_default_config(dir.path(), "default", None, &[], &sets);
    assert_eq!(out.code(), Some(0), "{}\n{}", out.stdout, out.stderr);
    let lines = rank_lines(&out.stdout);
    for rank in 0..2u32 {
        assert!(
            lines.iter().any(|(r, t)| *r == rank
                && t.starts_with(&format!("worker rank {rank}/2 (local {rank}/2"))),
            "{}",
            out.stdout
        );
        assert!(
            lines
                .iter()
                .any(|(r, t)| *r == rank
                    && t.contains("micro 96 x grad_accum 1 x world 2 = global 192")),
            "{}",
            out.stdout
        );
    }
}

#[test]
fn worker_with_part_of_the_launch_environment_names_the_missing_variable() {
    let out = std::process::Command::new(bin("worker"))
        .arg("configs/default.toml")
        .current_dir(repo_root())
        .env_remove("RANK")
        .env("WORLD_SIZE", "2")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("RANK is not set"), "{stderr}");
}

/// Without any of torchrun's variables the worker trains alone (world 1), as accelerate and
/// Lightning scripts do.
#[test]
fn worker_without_a_launch_environment_trains_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = std::process::Command::new(bin("worker"));
    cmd.arg("configs/default.toml").current_dir(repo_root());
    for set in tiny_bpr_sets(dir.path()) {
        cmd.arg(set);
    }
    for name in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    ] {
        cmd.env_remove(name);
    }
    let out = cmd.output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(stderr.contains("one process, world 1"), "{stderr}");
    assert!(stdout.contains("x world 1 = global"), "{stdout}");
    assert!(dir.path().join("default/best").exists(), "{stdout}");
}

/// Zombies of the launcher (exited processes whose parent is `pid`).
fn zombies_of(pid: i32) -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(Result::ok)
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter(|stat| {
            let mut rest = stat
                .rsplit_once(')')
                .map_or("", |(_, r)| r)
                .split_whitespace();
            rest.next() == Some("Z") && rest.next() == Some(pid.to_string().as_str())
        })
        .count()
}

/// A worker's child that escapes its process group with `setsid` does not survive the
/// teardown, and the orphans a worker leaves while running are reaped as they exit, not piled
/// up as zombies until the end.
#[test]
fn escaped_children_are_stopped_and_orphans_reaped_as_they_go() {
    let id = unique_run_id("escape");
    // 100 short-lived orphans, then an escaped sleeper, then a failure after a while.
    let script = sh(
        "i=0; while [ $i -lt 100 ]; do (sleep 0.01 &); i=$((i+1)); done; setsid sleep 600 & sleep 3; exit 4",
    );
    let live = Live::new(launch_cmd(&run_args("1", &id, &script)).spawn().unwrap());
    std::thread::sleep(Duration::from_millis(2000));
    let piled = zombies_of(live.pid().as_raw());
    let out = live.finish(T);
    out.assert_code(4);
    assert!(piled < 20, "{piled} zombies of launch while it ran");
    out.assert_stderr("left their worker's process group");
    assert_eq!(
        wait_no_processes(&id, Duration::from_secs(5)),
        Vec::<i32>::new(),
        "the escaped sleeper survived"
    );
}

/// A runaway stderr line (50 MB) reaches the console, but the failure summary quotes only a
/// short piece of it.
#[test]
fn a_huge_stderr_line_does_not_flood_the_summary() {
    let script = sh("head -c 50000000 /dev/zero | tr '\\0' x >&2; echo >&2; exit 5");
    let out = launch(&flags("1", &[], &script), T);
    assert_eq!(out.code(), Some(5));
    let summary = out
        .stderr
        .split("launch: worker group failed")
        .nth(1)
        .unwrap_or_else(|| panic!("no summary"));
    assert!(
        summary.len() < 100_000,
        "summary of {} bytes",
        summary.len()
    );
    assert!(
        summary.contains("more bytes of this line not shown"),
        "{}",
        &summary[..summary.len().min(3000)]
    );
}

/// The rendezvous is bounded by `dist.timeout_s` (no hidden floor), or by
/// `dist.rendezvous_timeout_s` when given, and the message names the key: rank 0 of a world of
/// two whose rank 1 never comes.
#[test]
fn rendezvous_gives_up_after_the_configured_time_naming_its_key() {
    for (set, key, secs) in [
        ("dist.timeout_s=2", "dist.timeout_s", 2),
        (
            "dist.rendezvous_timeout_s=1",
            "dist.rendezvous_timeout_s",
            1,
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port().to_string();
        let mut cmd = std::process::Command::new(bin("worker"));
        cmd.arg("configs/default.toml").current_dir(repo_root());
        for arg in tiny_bpr_sets(dir.path()) {
            cmd.arg(arg);
        }
        cmd.args(["--set", set]);
        for (name, value) in [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", port.as_str()),
        ] {
            cmd.env(name, value);
        }
        let started = std::time::Instant::now();
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        let within = format!("(within {key} = {secs} s)");
        assert!(stderr.contains(&within), "{stderr}");
        assert!(stderr.contains(&format!("after {secs}.0 s")), "{stderr}");
        // Well below the 60 s the set-up used to take at least (start-up included).
        assert!(started.elapsed() < std::time::Duration::from_secs(30));
    }
}

/// `launch ARGS...` with `env`, run by `sh -c 'ulimit -v 2000000; exec launch ...'`: with 2 GB
/// of address space a count that allocates per node aborts (exit 134) instead of eating the
/// machine. The environment is cleaned as [`launch_cmd`] cleans it.
fn launch_under_memory_cap(args: &[&str], env: &[(&str, &str)]) -> Output {
    let base = launch_cmd(args);
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "ulimit -v 2000000 && exec \"$0\" \"$@\""])
        .arg(base.get_program())
        .args(base.get_args())
        .current_dir(repo_root())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for (key, value) in base.get_envs() {
        match value {
            Some(value) => cmd.env(key, value),
            None => cmd.env_remove(key),
        };
    }
    cmd.envs(env.iter().copied());
    wait_output(cmd.spawn().expect("start sh"), T)
}

/// Issue 35 item 7: a huge node or process count, from a flag, a `PET_*` variable or Slurm, is
/// one line naming where it came from, its value and the limit, exit 2, dry run or not, in
/// bounded memory (nothing is allocated per possible node).
#[test]
fn huge_counts_from_flags_pet_and_slurm_are_one_line_in_bounded_memory() {
    let elastic = ["--rdzv-endpoint", "127.0.0.1:29999", "configs/default.toml"];
    let slurm = [("SLURM_JOB_ID", "4242"), ("SLURM_STEP_ID", "0")];
    /// Arguments before the common tail, the environment, the one line expected.
    type Case<'a> = (&'a [&'a str], Vec<(&'a str, &'a str)>, &'a str);
    let cases: [Case; 5] = [
        (
            &["--nnodes", "1:4000000000", "--num-processes", "1"],
            vec![],
            "invalid value '1:4000000000' for '--nnodes <N|MIN:MAX>': 4000000000 nodes is more than launch supports (at most 65536)",
        ),
        (
            &["--num-processes", "1"],
            vec![("PET_NNODES", "1:4000000000")],
            "environment variable PET_NNODES=\"1:4000000000\": 4000000000 nodes is more than launch supports (at most 65536)",
        ),
        (
            &[],
            vec![("PET_NPROC_PER_NODE", "99999999999")],
            "environment variable PET_NPROC_PER_NODE=\"99999999999\": 99999999999 processes on one node is more than launch supports (at most 1024)",
        ),
        (
            &[],
            [&slurm[..], &[("SLURM_NNODES", "4000000000")]].concat(),
            "environment variable SLURM_NNODES=\"4000000000\" (set by Slurm): 4000000000 nodes is more than launch supports (at most 65536)",
        ),
        (
            &[],
            [&slurm[..], &[("SLURM_GPUS_ON_NODE", "4000000000")]].concat(),
            "environment variable SLURM_GPUS_ON_NODE=\"4000000000\" (set by Slurm): 4000000000 processes on one node is more than launch supports (at most 1024)",
        ),
    ];
    for (head, env, line) in &cases {
        for dry_run in [true, false] {
            let mut all: Vec<&str> = dry_run.then_some("--dry-run").into_iter().collect();
            all.extend(head.iter().chain(&elastic));
            let out = launch_under_memory_cap(&all, env);
            let what = format!("{all:?} {env:?}");
            assert_eq!(out.code(), Some(2), "{what}: {}", out.stderr);
            assert_eq!(out.stderr, format!("launch: error: {line}\n"), "{what}");
            out.assert_ended_within(20);
        }
    }
    // The world is bounded too, naming both counts and where they came from.
    let out = launch_under_memory_cap(
        &[
            "--dry-run",
            "--nnodes",
            "65536",
            "--node-rank",
            "0",
            "--run-id",
            "x",
            "--",
            "true",
        ],
        &[("PET_NPROC_PER_NODE", "1024")],
    );
    assert_eq!(out.code(), Some(2), "{}", out.stderr);
    assert_eq!(
        out.stderr,
        "launch: error: 65536 node(s) (flag --nnodes) x 1024 process(es) per node (Kubernetes/TorchX PET_NPROC_PER_NODE=1024): 67108864 processes in the job is more than launch supports (at most 1048576)\n"
    );
}
