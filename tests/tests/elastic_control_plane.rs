//! The elastic rows of the control-plane harness (`scripts/bench/control_plane.sh`), small: a
//! real host `launch --nnodes 4:5` whose worker sleeps, and 4 simulated launchers
//! (`control-plane-bench launchers`, which re-codes the launcher's side of the rendezvous). The
//! real coordinator admits them, the first round forms with all 5, and when one simulated
//! launcher dies the 4 left re-form the next round.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use support::*;

const STEP: Duration = Duration::from_secs(30);

/// Stops the host (SIGTERM: it stops its worker) and the simulator (SIGKILL) if the test ends
/// before it stopped them itself.
struct Stop {
    host: nix::unistd::Pid,
    sim: nix::unistd::Pid,
    armed: bool,
}

impl Drop for Stop {
    fn drop(&mut self) {
        if self.armed {
            let _ = kill(self.sim, Signal::SIGKILL);
            let _ = kill(self.host, Signal::SIGTERM);
        }
    }
}

#[test]
fn simulated_launchers_form_a_round_with_the_real_host_and_reform_after_one_dies() {
    let port = free_port();
    let run_id = unique_run_id("elastic-cp");
    let endpoint = format!("127.0.0.1:{port}");
    let host = Live::new(
        launch_cmd(&[
            "--nnodes",
            "4:5",
            "--rdzv-endpoint",
            &endpoint,
            "--rdzv-id",
            &run_id,
            "--nproc-per-node",
            "1",
            "--rdzv-conf",
            "last_call_timeout=600",
            "--max-restarts",
            "3",
            "--grace-period",
            "2",
            "--",
            "sleep",
            "600",
        ])
        .spawn()
        .expect("start the host launch"),
    );
    let mut sim = Command::new(bin("control-plane-bench"))
        .args([
            "launchers",
            "--addr",
            &endpoint,
            "--run-id",
            &run_id,
            "--count",
            "4",
            "--threads",
            "2",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start control-plane-bench launchers");
    let mut stop = Stop {
        host: host.pid(),
        sim: nix::unistd::Pid::from_raw(sim.id() as i32),
        armed: true,
    };
    let (tx, lines) = mpsc::channel();
    let stdout = sim.stdout.take().expect("piped stdout");
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut seen = Vec::new();
    let mut expect = |prefix: &str| -> Vec<String> {
        loop {
            match lines.recv_timeout(STEP) {
                Ok(line) if line.starts_with(prefix) => {
                    return line.split(' ').map(str::to_string).collect()
                }
                Ok(line) => seen.push(line),
                Err(_) => panic!(
                    "the simulator never printed {prefix:?}; it printed {seen:?}\n--- host\n{}",
                    host.stderr_now()
                ),
            }
        }
    };
    let mut stdin = sim.stdin.take().expect("piped stdin");
    expect("ready");
    writeln!(stdin, "go").unwrap();
    let first = expect("round 0 members");
    assert_eq!(
        first[3], "5",
        "round 0 should take the host and the 4 simulated nodes"
    );
    host.wait_stderr("round 0: 5 node(s)", STEP);

    writeln!(stdin, "kill").unwrap();
    let killed = expect("killed");
    expect("round 0 failed");
    let next = expect("round 1 members");
    assert_eq!(next[3], "4", "round 1 should take the 4 nodes left");
    host.wait_stderr("round 1: 4 node(s)", STEP);
    let gone = format!("node id {} (host sim-", killed[1]);
    assert!(
        host.stderr_now().contains(&gone),
        "the host should name the dead node ({gone:?}):\n{}",
        host.stderr_now()
    );

    // EOF: the simulated launchers close their connections and report.
    drop(stdin);
    let report = expect("{");
    assert!(
        report.join(" ").contains("\"errors\":0"),
        "simulated launchers hit store errors: {report:?}"
    );
    let status = sim.wait().expect("wait for the simulator");
    assert!(status.success(), "the simulator ended with {status:?}");

    kill(host.pid(), Signal::SIGTERM).expect("SIGTERM the host");
    let out = host.finish(STEP);
    stop.armed = false;
    assert_eq!(out.code(), Some(143), "host:\n{}", out.all());
    assert!(
        !out.stderr.contains("not admitted"),
        "a simulated node was refused:\n{}",
        out.stderr
    );
    assert_no_processes(&run_id, Duration::from_secs(10));
}
