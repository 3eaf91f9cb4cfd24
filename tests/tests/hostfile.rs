//! `launch --hostfile` (issue 37, item 4) against real `sshd`s: every host is a network
//! namespace (`support::netns`) running Debian's `sshd` on port 2222 with a config, host key
//! and client key this test makes in a temporary directory; the launching `launch` runs on h0
//! with an ssh config (`--ssh-config`) naming that key. Cases: a tiny training job on two hosts
//! (a third excluded gets no connection at all), a host whose program fails (launch exits with
//! its code, the other host's workers are gone), a host without sshd (255, named in one line).
//! Throughout, no process's command line on any host holds the run id, while the workers'
//! environment does.
//!
//! Only addresses of the namespaces a test made are contacted. Without root, `ip`, `sshd` or
//! `ssh-keygen`, each test prints one `skipping:` line.

mod support;

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use support::netns::Hosts;
use support::*;

const T: Duration = Duration::from_secs(60);
const SSHD: &str = "/usr/sbin/sshd";
const PORT: u16 = 2222;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Hosts with an sshd on some of them, and the files both sides use.
struct Cluster {
    hosts: Hosts,
    dir: tempfile::TempDir,
    /// (host, sshd) per started sshd.
    sshds: Vec<(usize, Live)>,
}

impl Cluster {
    /// `count` hosts, an sshd on each of `with_sshd`; `None` after one `skipping:` line.
    fn new(count: usize, with_sshd: &[usize]) -> Option<Cluster> {
        if !Path::new(SSHD).is_file() {
            eprintln!("skipping: no {SSHD} (Debian's openssh-server; .ci/run installs it)");
            return None;
        }
        let ssh = Command::new("ssh").arg("-V").stderr(Stdio::null()).status();
        if ssh.is_err() {
            eprintln!("skipping: no `ssh` client (Debian's openssh-client)");
            return None;
        }
        let hosts = Hosts::new(count)?;
        let dir = tempfile::Builder::new()
            .prefix("gptrec-ssh-")
            .tempdir()
            .unwrap();
        if let Err(why) = write_keys(dir.path()) {
            eprintln!("skipping: {why}");
            return None;
        }
        // sshd's privilege separation directory (the package makes it at boot, not at install).
        let _ = std::fs::create_dir_all("/run/sshd");
        let mut cluster = Cluster {
            hosts,
            dir,
            sshds: Vec::new(),
        };
        for &i in with_sshd {
            let config = cluster.path("sshd_config");
            let cmd = cluster.hosts.command(i, SSHD, &["-D", "-e", "-f", &config]);
            let live = Live::new(spawn(cmd));
            live.wait_output("Server listening on", T);
            cluster.sshds.push((i, live));
        }
        Some(cluster)
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }

    /// Writes `lines` as the hostfile; its path.
    fn hostfile(&self, lines: &str) -> String {
        std::fs::write(self.dir.path().join("hostfile"), lines).unwrap();
        self.path("hostfile")
    }

    /// `launch --hostfile ... --ssh-config ... ARGS` on h0, with `run_id` in its environment.
    fn launch(&self, hostfile: &str, args: &[&str], run_id: &str) -> Live {
        let config = self.path("ssh_config");
        let mut all = vec!["--hostfile", hostfile, "--ssh-config", &config];
        all.extend_from_slice(args);
        let mut cmd = self.hosts.launch(0, &all);
        cmd.env("LAUNCH_RUN_ID", run_id).env("OMP_NUM_THREADS", "1");
        Live::new(spawn(cmd))
    }

    /// What host `i`'s sshd logged so far.
    fn sshd_log(&self, i: usize) -> String {
        let (_, live) = self.sshds.iter().find(|(h, _)| *h == i).unwrap();
        live.stderr_now()
    }

    /// Panics unless nothing but its sshd runs on host `i` within `timeout`.
    fn assert_only_sshd(&self, i: usize, timeout: Duration) {
        let sshd = self
            .sshds
            .iter()
            .find(|(h, _)| *h == i)
            .map(|(_, l)| l.pid());
        let start = std::time::Instant::now();
        loop {
            let left: Vec<i32> = (self.hosts.pids(i).into_iter())
                .filter(|p| Some(nix::unistd::Pid::from_raw(*p)) != sshd)
                .collect();
            if left.is_empty() {
                return;
            }
            assert!(
                start.elapsed() < timeout,
                "left on h{i}: {:?}",
                left.iter().map(|p| cmdline(*p)).collect::<Vec<_>>()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (_, live) in &mut self.sshds {
            let _ = live.child.kill();
            let _ = live.child.wait();
        }
        // `Hosts`' own drop then kills whatever is left in the namespaces.
    }
}

fn spawn(mut cmd: Command) -> std::process::Child {
    cmd.stdin(Stdio::null())
        .spawn()
        .expect("start a process on a host")
}

fn cmdline(pid: i32) -> String {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    String::from_utf8_lossy(&raw).replace('\0', " ")
}

/// Host key, client key, authorized keys, the sshd config and the client's ssh config.
fn write_keys(dir: &Path) -> Result<(), String> {
    for key in ["host_key", "id"] {
        let status = Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-C", "gptrec-test", "-f"])
            .arg(dir.join(key))
            .stdout(Stdio::null())
            .status()
            .map_err(|e| format!("no ssh-keygen: {e}"))?;
        if !status.success() {
            return Err(format!("ssh-keygen failed: {status}"));
        }
    }
    let d = dir.display();
    std::fs::copy(dir.join("id.pub"), dir.join("authorized_keys")).map_err(|e| e.to_string())?;
    let sshd = format!(
        "Port {PORT}\nListenAddress 0.0.0.0\nHostKey {d}/host_key\nAuthorizedKeysFile {d}/authorized_keys\nPermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPidFile none\nPrintMotd no\nLogLevel INFO\n"
    );
    let client = format!(
        "Host *\n  User root\n  Port {PORT}\n  IdentityFile {d}/id\n  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  ConnectTimeout 10\n"
    );
    std::fs::write(dir.join("sshd_config"), sshd).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("ssh_config"), client).map_err(|e| e.to_string())
}

/// Watches every process's command line (every host's processes are in /proc) for `run_id`
/// and counts the processes whose environment holds it as TORCHELASTIC_RUN_ID, until dropped.
struct Watch {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<(Vec<String>, usize)>>,
}

impl Watch {
    fn new(run_id: &str) -> Watch {
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, id) = (stop.clone(), run_id.to_string());
        let thread = std::thread::spawn(move || {
            let (mut seen, mut most) = (Vec::new(), 0);
            while !flag.load(Ordering::Relaxed) {
                for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
                    let raw = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
                    let line = String::from_utf8_lossy(&raw).replace('\0', " ");
                    if line.contains(&id) && !seen.contains(&line) {
                        seen.push(line);
                    }
                }
                most = most.max(processes_of_run(&id).len());
                std::thread::sleep(Duration::from_millis(50));
            }
            (seen, most)
        });
        Watch {
            stop,
            thread: Some(thread),
        }
    }

    /// Command lines that held the run id, and the most workers seen at once with it.
    fn end(mut self) -> (Vec<String>, usize) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap()
    }
}

#[test]
fn a_tiny_job_over_two_hosts_is_labelled_by_host_and_the_excluded_host_gets_nothing() {
    let _serial = serial();
    let Some(cluster) = Cluster::new(3, &[0, 1, 2]) else {
        return;
    };
    let out_dir = cluster.dir.path().join("runs");
    let hostfile = cluster.hostfile("# three hosts\nh0 slots=1\nh1 slots=1\n\nh2 slots=1\n");
    let run_id = unique_run_id("hostfile");
    let mut args = vec![
        "--exclude",
        "h2",
        "--grace-period",
        "2",
        "configs/default.toml",
    ];
    let sets = tiny_bpr_sets(&out_dir);
    args.extend(sets.iter().map(String::as_str));
    let watch = Watch::new(&run_id);
    let out = cluster.launch(&hostfile, &args, &run_id).finish(T);
    let (cmdlines, most) = watch.end();
    out.assert_code(0);
    out.assert_stdout_all(&["[h0] [rank 0] ", "[h1] [rank 1] "]);
    out.assert_stderr_all(&["launch: 2 hosts from ", "(h0, h1), master h0:29500"]);
    for line in out.stdout.lines() {
        assert!(
            line.starts_with("[h0] ") || line.starts_with("[h1] "),
            "{line:?}"
        );
    }
    assert!(
        cmdlines.is_empty(),
        "the run id on a command line: {cmdlines:?}"
    );
    assert!(
        most >= 2,
        "the workers of both hosts never held the run id ({most})"
    );
    assert!(cluster.sshd_log(0).contains("Accepted publickey"));
    assert!(
        !cluster.sshd_log(2).contains("Accepted"),
        "{}",
        cluster.sshd_log(2)
    );
    for i in 0..3 {
        cluster.assert_only_sshd(i, Duration::from_secs(10));
    }
}

/// The program on node 1 fails with 42 after a while; node 0's sleeps until it is stopped.
const FAILING: &str = "echo \"hello from node $GROUP_RANK\"; if [ \"$GROUP_RANK\" = 1 ]; then sleep 3; exit 42; fi; exec sleep 600";

#[test]
fn a_failing_host_sets_the_exit_code_and_the_other_hosts_workers_are_gone() {
    let _serial = serial();
    let Some(cluster) = Cluster::new(2, &[0, 1]) else {
        return;
    };
    let hostfile = cluster.hostfile("h0 slots=1\nh1 slots=1\n");
    let run_id = unique_run_id("hostfile-fail");
    let watch = Watch::new(&run_id);
    let args = ["--grace-period", "2", "--", "sh", "-c", FAILING];
    let out = cluster.launch(&hostfile, &args, &run_id).finish(T);
    let (cmdlines, most) = watch.end();
    out.assert_code(42);
    out.assert_stdout_all(&[
        "[h0] [rank 0] hello from node 0",
        "[h1] [rank 1] hello from node 1",
    ]);
    out.assert_stderr_all(&[
        "launch: stopping the other hosts (h0)",
        "launch: error: host h1 failed with exit code 42",
    ]);
    assert!(
        cmdlines.is_empty(),
        "the run id on a command line: {cmdlines:?}"
    );
    assert!(
        most >= 2,
        "the workers of both hosts never held the run id ({most})"
    );
    cluster.assert_only_sshd(0, Duration::from_secs(10));
    cluster.assert_only_sshd(1, Duration::from_secs(10));
    assert_no_processes(&run_id, Duration::from_secs(5));
}

#[test]
fn a_host_without_sshd_is_ssh_s_255_named_in_one_line() {
    let _serial = serial();
    let Some(cluster) = Cluster::new(2, &[0]) else {
        return;
    };
    let hostfile = cluster.hostfile("h0 slots=1\nh1 slots=1\n");
    let run_id = unique_run_id("hostfile-down");
    let args = ["--grace-period", "2", "--", "sleep", "600"];
    let out = cluster.launch(&hostfile, &args, &run_id).finish(T);
    out.assert_code(255);
    let named: Vec<&str> = (out.stderr.lines())
        .filter(|l| l.starts_with("launch: error: host h1: ssh failed with exit code 255"))
        .collect();
    assert_eq!(named.len(), 1, "{}", out.stderr);
    out.assert_stderr("[h1] ssh: connect to host h1 port 2222: Connection refused");
    cluster.assert_only_sshd(0, Duration::from_secs(10));
    assert_no_processes(&run_id, Duration::from_secs(5));
}

#[test]
fn a_dropped_ssh_connection_ends_that_hosts_workers_and_the_job() {
    let _serial = serial();
    let Some(cluster) = Cluster::new(2, &[0, 1]) else {
        return;
    };
    let hostfile = cluster.hostfile("h0 slots=1\nh1 slots=1\n");
    let run_id = unique_run_id("hostfile-drop");
    let args = [
        "--grace-period",
        "2",
        "--",
        "sh",
        "-c",
        "echo up; exec sleep 600",
    ];
    let live = cluster.launch(&hostfile, &args, &run_id);
    live.wait_output("[h0] [rank 0] up", T);
    live.wait_output("[h1] [rank 1] up", T);
    // h1's ssh client, on h0, dies: sshd on h1 sees the connection close.
    let ssh: Vec<i32> = (cluster.hosts.pids(0).into_iter())
        .filter(|p| cmdline(*p).starts_with("ssh ") && cmdline(*p).contains(" h1 sh -c "))
        .collect();
    assert_eq!(ssh.len(), 1, "{ssh:?}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(ssh[0]),
        nix::sys::signal::SIGKILL,
    )
    .unwrap();
    let out = live.finish(T);
    out.assert_code(128 + 9);
    out.assert_stderr("launch: error: host h1 failed with exit code 137");
    cluster.assert_only_sshd(1, Duration::from_secs(10));
    cluster.assert_only_sshd(0, Duration::from_secs(10));
    assert_no_processes(&run_id, Duration::from_secs(5));
}

#[test]
fn a_run_id_that_would_break_the_environment_block_is_refused_before_any_ssh() {
    // A newline in the run id would end its line of each host's environment block: the rest
    // would be exported as variables of their own, and an empty line would end the block
    // early. Refused in one line, exit 2, before any host is contacted (no sshd needed).
    let dir = tempfile::tempdir().unwrap();
    let hostfile = dir.path().join("hosts");
    std::fs::write(&hostfile, "h0 slots=1\nh1 slots=1\n").unwrap();
    let hostfile = hostfile.display().to_string();
    for (flag, env) in [(true, None), (false, Some("sec\nEVIL=1\n\nX=2"))] {
        let mut args = vec!["--hostfile", hostfile.as_str()];
        if flag {
            args.extend(["--run-id", "sec\nEVIL=1\n\nX=2"]);
        }
        args.extend(["--", "true"]);
        let mut cmd = launch_cmd(&args);
        if let Some(value) = env {
            cmd.env("LAUNCH_RUN_ID", value);
        }
        let out = wait_output(cmd.spawn().expect("start launch"), T);
        out.assert_code(2);
        let from = if flag { "--run-id" } else { "LAUNCH_RUN_ID" };
        out.assert_stderr(format!(
            "launch: error: {from}: the run id holds a control character"
        ));
        // "launch: 2 hosts from ..." comes just before the first ssh starts.
        assert!(!out.stderr.contains(" hosts from "), "{}", out.stderr);
        assert!(!out.all().contains("[h0]"), "{}", out.all());
    }
}

#[test]
fn ipv6_hosts_are_named_in_include_and_the_master_is_bracketed() {
    // IPv6 hosts could be listed but not named in --include / --exclude (`fd00::1:1` read as
    // host `fd00`), and the master printed as `::1:29500`. A dry run: no host is contacted.
    let dir = tempfile::tempdir().unwrap();
    let hostfile = dir.path().join("hosts");
    std::fs::write(&hostfile, "fd00::1 slots=2\n::1 slots=1\n").unwrap();
    let hostfile = hostfile.display().to_string();
    let args = [
        "--hostfile",
        hostfile.as_str(),
        "--dry-run",
        "--master-addr",
        "::1",
        "--master-port",
        "29500",
        "--include",
        "[fd00::1]:1@::1",
        "--",
        "true",
    ];
    let out = wait_output(launch_cmd(&args).spawn().expect("start launch"), T);
    out.assert_code(0);
    assert!(
        out.stdout
            .contains("2 nodes, 2 processes in all, master [::1]:29500"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains("node 0: fd00::1 slots 1 (1 processes)"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains("node 1: ::1 slots 0 (1 processes)"),
        "{}",
        out.stdout
    );
}

#[test]
fn a_short_or_abbreviated_hostfile_line_keeps_its_own_flags_from_the_hosts() {
    // `-H FILE` and `--master-p PORT` (torchrun's abbreviation) are this side's: each host's
    // command line gets the per-host flags instead, and the user's others as typed. Before,
    // `-H FILE` went on, and every host refused `--hostfile` with `--nnodes`. A dry run.
    let dir = tempfile::tempdir().unwrap();
    let hostfile = dir.path().join("hosts");
    std::fs::write(&hostfile, "ha slots=1\nhb slots=1\n").unwrap();
    let hostfile = hostfile.display().to_string();
    let args = [
        "-H",
        &hostfile,
        "--dry-run",
        "--master-p",
        "29511",
        "--max-r",
        "1",
        "--",
        "true",
    ];
    let out = wait_output(launch_cmd(&args).spawn().expect("start launch"), T);
    out.assert_code(0);
    let lines: Vec<&str> = (out.stdout.lines())
        .filter(|l| l.contains("ssh "))
        .collect();
    assert_eq!(lines.len(), 2, "{}", out.stdout);
    for (node, line) in lines.iter().enumerate() {
        let want = format!(
            "--nnodes 2 --node-rank {node} --master-addr ha --master-port 29511 \
             --num-processes 1 --max-r 1 -- true'"
        );
        assert!(line.ends_with(&want), "{line}");
        assert!(!line.contains(&hostfile) && !line.contains("-H "), "{line}");
    }
}
