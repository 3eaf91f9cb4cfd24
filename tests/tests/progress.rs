//! `launch`'s live progress display, in a real pseudo-terminal: one bar for the job fed by the
//! workers' progress reports (not by their log text), the workers' lines printed above it, and
//! plain lines, without any drawing, when stderr is not a terminal or `GPTREC_PROGRESS=plain`.

mod support;

use std::io::Read;
use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::pty::{openpty, Winsize};
use support::*;

/// Runs a tiny 2-process training under `launch` with stderr on a new pseudo-terminal (160
/// columns); returns the exit code and everything the terminal received.
fn launch_in_terminal(dir: &std::path::Path, env: &[(&str, &str)]) -> (Option<i32>, String) {
    let sets = tiny_bpr_sets(dir);
    let mut args = vec!["--num-processes", "2", "--master-port", "0"];
    args.extend(sets.iter().map(String::as_str));
    args.extend(["--set", "train.epochs=3", "configs/default.toml"]);
    let (mut child, reader) = spawn_in_terminal(&args, env);
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(180),
            "launch did not finish"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let seen = reader.join().unwrap();
    (status.code(), String::from_utf8_lossy(&seen).into_owned())
}

/// Starts `launch ARGS...` with stderr on a new pseudo-terminal (160 columns) and `env` added;
/// returns it and the thread that collects everything the terminal receives until it closes.
fn spawn_in_terminal(
    args: &[&str],
    env: &[(&str, &str)],
) -> (std::process::Child, std::thread::JoinHandle<Vec<u8>>) {
    let size = Winsize {
        ws_row: 40,
        ws_col: 160,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    let pty = openpty(Some(&size), None).expect("a pseudo-terminal");
    let mut cmd = launch_cmd(args);
    cmd.env_remove("GPTREC_PROGRESS").env("TERM", "xterm");
    for (key, value) in env {
        cmd.env(key, value);
    }
    cmd.stdout(Stdio::null()).stderr(Stdio::from(pty.slave));
    let child = cmd.spawn().expect("start launch");
    drop(cmd); // our copy of the terminal's slave side: EOF comes when launch's closes
    let mut master = std::fs::File::from(pty.master);
    let reader = std::thread::spawn(move || {
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        // Linux reports EIO once every slave descriptor is closed.
        while let Ok(n @ 1..) = master.read(&mut buf) {
            seen.extend_from_slice(&buf[..n]);
        }
        seen
    });
    (child, reader)
}

/// Every `step X/Y` the bar drew, in order.
fn bar_steps(screen: &str) -> Vec<(u64, u64)> {
    screen
        .split("] step ")
        .skip(1)
        .filter_map(|rest| {
            let (x, rest) = rest.split_once('/')?;
            let y: String = rest.chars().take_while(char::is_ascii_digit).collect();
            Some((x.parse().ok()?, y.parse().ok()?))
        })
        .collect()
}

/// Every `ETA ...` the bar drew, in seconds (`12s`, `3m05s`, `1h02m`).
fn bar_etas(screen: &str) -> Vec<u64> {
    screen
        .split("ETA ")
        .skip(1)
        .filter_map(|rest| {
            let text: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric())
                .collect();
            let (mut secs, mut number) = (0, 0);
            for c in text.chars() {
                match c {
                    '0'..='9' => number = number * 10 + c.to_digit(10)? as u64,
                    'h' => (secs, number) = (secs + number * 3600, 0),
                    'm' => (secs, number) = (secs + number * 60, 0),
                    's' => (secs, number) = (secs + number, 0),
                    _ => return None,
                }
            }
            Some(secs)
        })
        .collect()
}

#[test]
fn a_terminal_gets_one_live_bar_for_the_job_with_worker_lines_above_it() {
    let dir = tempfile::tempdir().unwrap();
    let (code, screen) = launch_in_terminal(dir.path(), &[]);
    assert_eq!(code, Some(0), "{screen}");
    let steps = bar_steps(&screen);
    let total = steps.last().map(|s| s.1).expect("a bar was drawn");
    assert!(total > 3, "{steps:?}");
    // It moved forward to the end, redrawn in place (cursor and erase-line sequences).
    assert!(steps.windows(2).all(|w| w[0].0 <= w[1].0), "{steps:?}");
    assert!(steps.contains(&(total, total)), "{steps:?}");
    assert!(steps.iter().any(|s| s.0 < total), "{steps:?}");
    assert!(screen.contains("\x1b[2K"), "{screen}");
    // "/3 loss ": the bar's loss (a log line says "epoch 1/3 step ... loss").
    for want in ["epoch 3/3", "/3 loss ", "samples/s", "ETA"] {
        assert!(screen.contains(want), "{want} missing: {screen}");
    }
    // The ETA is the run's pace, not indicatif's guess (minutes for a run of seconds).
    let etas = bar_etas(&screen);
    assert!(
        !etas.is_empty() && etas.iter().all(|&s| s <= 60),
        "{etas:?}"
    );
    // The workers' and the launcher's lines are all there, whole.
    for want in [
        "[rank 0]  INFO epoch 3/3 done in",
        "launch: configs/default.toml: micro",
    ] {
        assert!(screen.contains(want), "{want} missing: {screen}");
    }
    assert!(dir.path().join("default/best").exists());
}

#[test]
fn plain_lines_without_a_terminal_or_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let (code, screen) = launch_in_terminal(dir.path(), &[("GPTREC_PROGRESS", "plain")]);
    assert_eq!(code, Some(0), "{screen}");
    assert!(
        bar_steps(&screen).is_empty() && !screen.contains("\x1b["),
        "{screen}"
    );
    assert!(
        screen.contains("[rank 0]  INFO epoch 3/3 done in"),
        "{screen}"
    );

    let dir = tempfile::tempdir().unwrap();
    let sets = tiny_bpr_sets(dir.path());
    let mut args = vec!["--num-processes", "2", "--master-port", "0"];
    args.extend(sets.iter().map(String::as_str));
    args.push("configs/default.toml");
    let out = launch(&args, Duration::from_secs(180));
    out.assert_code(0);
    assert!(
        bar_steps(&out.stderr).is_empty() && !out.stderr.contains("\x1b["),
        "{}",
        out.stderr
    );
}

/// The peak resident memory of process `pid`, in KiB (`VmHWM`).
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("its status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("a VmHWM line")
}

/// Issue 35 item 8: a program that writes 200 MB without a newline to its progress pipe, then
/// a line that is not UTF-8, then records, some of them of 20,000 ranks that are not this
/// node's: `launch` stays small, keeps reading (the program's later writes succeed, it exits
/// 0), draws the good records and never the fake ranks, and says what it skipped.
#[test]
fn a_hostile_progress_pipe_is_drained_in_bounded_memory() {
    let dir = tempfile::tempdir().unwrap();
    let (written, go) = (dir.path().join("written"), dir.path().join("go"));
    let record = |rank: &str, step: u32, total: u32| {
        format!(
            r#"{{"rank":{rank},"phase":"train","epoch":1,"epochs":1,"step":{step},"total_steps":{total}}}"#
        )
    };
    let script = format!(
        "set -e\n\
         head -c 200000000 /dev/zero | tr '\\0' x >&3\n\
         printf '\\n\\377\\376 not UTF-8\\n' >&3\n\
         echo '{good}' >&3\n\
         seq 1000 20999 | sed 's/.*/{fake}/' >&3\n\
         echo '{last}' >&3\n\
         touch '{written}'\n\
         while [ ! -e '{go}' ]; do sleep 0.1; done\n\
         echo 'program done' >&2\n",
        good = record("0", 7, 9),
        fake = record("&", 1, 5),
        last = record("0", 8, 9),
        written = written.display(),
        go = go.display(),
    );
    let args = [
        "--num-processes",
        "1",
        "--master-port",
        "0",
        "--",
        "sh",
        "-c",
        &script,
    ];
    let (mut child, reader) = spawn_in_terminal(&args, &[]);
    let started = Instant::now();
    while !written.exists() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "launch ended before the program wrote everything"
        );
        assert!(started.elapsed() < Duration::from_secs(120), "no progress");
        std::thread::sleep(Duration::from_millis(50));
    }
    let peak = peak_rss_kib(child.id());
    std::thread::sleep(Duration::from_millis(1500)); // a few frames of the display
    std::fs::write(&go, "").unwrap();
    let status = child.wait().unwrap();
    let screen = String::from_utf8_lossy(&reader.join().unwrap()).into_owned();
    assert_eq!(status.code(), Some(0), "{screen}");
    assert!(screen.contains("[rank 0] program done"), "{screen}");
    // 200 MB went through; launch never held more than a capped line of it.
    assert!(peak < 64 * 1024, "launch's peak RSS {peak} KiB");
    let steps = bar_steps(&screen);
    assert_eq!(steps.last(), Some(&(8, 9)), "{steps:?}");
    assert!(steps.iter().all(|&(_, total)| total == 9), "{steps:?}");
    assert!(!screen.contains("rank 20000") && !screen.contains("rank 1000:"));
    for want in [
        "rank 0's progress pipe: skipped 1 line(s) over 64 KiB",
        "line(s) that are not a progress record",
        "record(s) of ranks not started on this node (the first: rank 1000)",
    ] {
        assert!(screen.contains(want), "{want} missing: {screen}");
    }
}
