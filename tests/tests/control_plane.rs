//! The ranks of the control-plane harness (`scripts/bench/control_plane.sh`), small: a store
//! (`control-plane-bench serve`) and 32 simulated ranks of 4 hosts in two processes replay a
//! job's start-up traffic, then each leaves its will and parks its watch (as
//! `runtime::job_watch` does); one rank's watching connection is closed as its death would close
//! it, and every other rank is told, naming it.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::Duration;

use support::*;

const STEP: Duration = Duration::from_secs(30);

/// A child whose stdout lines arrive on a channel; killed if the test ends first.
struct Piped {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
}

impl Piped {
    fn start(args: &[&str]) -> Piped {
        let mut child = Command::new(bin("control-plane-bench"))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start control-plane-bench");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let stdin = child.stdin.take();
        Piped {
            child,
            stdin,
            lines,
        }
    }

    /// The next line, which must start with `prefix`.
    fn expect(&self, prefix: &str) -> String {
        let line = self
            .lines
            .recv_timeout(STEP)
            .unwrap_or_else(|_| panic!("no line starting {prefix:?}"));
        assert!(
            line.starts_with(prefix),
            "{line:?} does not start {prefix:?}"
        );
        line
    }

    fn say(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        writeln!(stdin, "{line}").expect("write to the child");
    }
}

impl Drop for Piped {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn json(line: &str) -> serde_json::Value {
    serde_json::from_str(line).unwrap_or_else(|e| panic!("{line:?}: {e}"))
}

#[test]
fn simulated_ranks_set_up_and_all_are_told_of_a_death_naming_it() {
    let run_id = unique_run_id("control-plane");
    let server = Piped::start(&["serve", "--run-id", &run_id]);
    let port = server
        .expect("port ")
        .split(' ')
        .nth(1)
        .unwrap()
        .to_string();
    let addr = format!("127.0.0.1:{port}");
    let mut ranks: Vec<Piped> = [0, 16]
        .iter()
        .map(|first| {
            Piped::start(&[
                "ranks",
                "--addr",
                &addr,
                "--run-id",
                &run_id,
                "--world",
                "32",
                "--local",
                "8",
                "--first",
                &first.to_string(),
                "--count",
                "16",
                "--threads",
                "4",
                "--watch",
            ])
        })
        .collect();
    for r in &ranks {
        r.expect("ready");
    }
    for r in &mut ranks {
        r.say("go");
    }
    for r in &ranks {
        let setup = json(&r.expect("{"));
        assert_eq!(setup["ranks"], 16, "{setup}");
        // Every rank's connection, and a second one for each of the 2 leaders.
        assert_eq!(setup["connects"], 18, "{setup}");
        r.expect("watching");
    }
    std::thread::sleep(Duration::from_millis(300));
    for r in &mut ranks {
        r.say("kill 20");
    }
    for (i, r) in ranks.iter().enumerate() {
        let told = json(&r.expect("{"));
        let expected = if i == 1 { 15 } else { 16 };
        assert_eq!(told["answered"], expected, "{told}");
        assert_eq!(told["watchers"], expected, "{told}");
        assert!(
            told["line"].as_str().is_some_and(
                |l| l.starts_with("rank 20 (") && l.ends_with("ended before the job finished")
            ),
            "{told}"
        );
        assert!(told.get("errors").is_none(), "{told}");
        assert_eq!(told.get("kill_unix").is_some(), i == 1, "{told}");
    }
}

/// A store raises its process's soft limit on open descriptors to the hard one (two a rank).
#[test]
fn the_store_raises_its_descriptor_limit_to_the_hard_limit() {
    let run_id = unique_run_id("control-plane-limit");
    let line = format!(
        "ulimit -Sn 256 && exec {} serve --run-id {run_id}",
        bin("control-plane-bench").display()
    );
    let mut child = Command::new("bash")
        .args(["-c", &line])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the store under a low limit");
    let stdout = child.stdout.take().expect("piped stdout");
    let mut first = String::new();
    BufReader::new(stdout).read_line(&mut first).unwrap();
    assert!(first.starts_with("port "), "{first:?}");
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", child.id())).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let row = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("a Max open files row");
    let words: Vec<&str> = row.split_whitespace().collect();
    let (soft, hard) = (words[3], words[4]);
    assert_eq!(soft, hard, "{row}");
    assert_ne!(soft, "256", "{row}");
}
