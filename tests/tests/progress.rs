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
    let size = Winsize {
        ws_row: 40,
        ws_col: 160,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    let pty = openpty(Some(&size), None).expect("a pseudo-terminal");
    let sets = tiny_bpr_sets(dir);
    let mut args = vec!["--num-processes", "2", "--master-port", "0"];
    args.extend(sets.iter().map(String::as_str));
    args.extend(["--set", "train.epochs=3", "configs/default.toml"]);
    let mut cmd = launch_cmd(&args);
    cmd.env_remove("GPTREC_PROGRESS").env("TERM", "xterm");
    for (key, value) in env {
        cmd.env(key, value);
    }
    cmd.stdout(Stdio::null()).stderr(Stdio::from(pty.slave));
    let mut child = cmd.spawn().expect("start launch");
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
    for want in ["epoch 3/3", "samples/s", "ETA", "loss 0."] {
        assert!(screen.contains(want), "{want} missing: {screen}");
    }
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
