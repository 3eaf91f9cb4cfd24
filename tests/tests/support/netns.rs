//! Separate hosts on one machine for one test: each host is a Linux network namespace with its
//! own address on a private subnet, its own host name (a UTS namespace) and its own `/dev/shm`
//! (a tmpfs in a mount namespace), joined by veth pairs to a bridge that lives in a namespace of
//! its own, so nothing of the machine's own network is reachable from a host (a host has `lo`
//! and `eth0` on the bridge, no default route). Host names resolve through a hosts file that is
//! bind-mounted over `/etc/hosts` in each host (with `/etc/nsswitch.conf` saying `hosts: files`,
//! so no name is ever looked up in DNS). The test process reaches a host only by starting
//! processes inside it ([`Hosts::command`]).
//!
//! Faults: [`Hosts::cut`] / [`Hosts::restore`] take a host's link down / up on the bridge's side
//! (a pulled cable: the host sees silence, not errors), [`Hosts::kill_all`] SIGKILLs every
//! process of a host at once (stopped first, so none of them reacts to the others dying).
//!
//! Everything is named `gptrec-hosts-<pid>-<n>-...`, so tests running at the same time never
//! share a namespace, and removed in `Drop` (every process of the hosts killed, then the
//! namespaces deleted, which deletes their veths and the bridge), even when the test fails. A
//! run that was SIGKILLed leaves its namespaces behind; the next [`Hosts::new`] removes those of
//! test processes that no longer exist.
//!
//! ```ignore
//! let Some(hosts) = Hosts::new(3) else { return }; // printed one "skipping: ..." line
//! let live = Live::new(hosts.launch(0, &args).spawn().unwrap());
//! hosts.cut(2);
//! ```
#![allow(dead_code)]

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::{bin, repo_root};

/// Prefix of every namespace the harness makes.
const PREFIX: &str = "gptrec-hosts-";

static NEXT: AtomicU32 = AtomicU32::new(0);

/// Runs in each host before its program: own host name, `/dev/shm`, hosts file and name
/// service switch; then `exec`s the program. `$1` is the host name, `$2` the directory holding
/// `hosts` and `nsswitch.conf`.
const HOST_INIT: &str = r#"set -e
name=$1; files=$2; shift 2
hostname "$name"
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount --bind "$files/hosts" /etc/hosts
mount --bind "$files/nsswitch.conf" /etc/nsswitch.conf
exec "$@""#;

/// A few hosts of our own, for one test (see the module's documentation).
pub struct Hosts {
    /// `gptrec-hosts-<pid>-<n>`: the namespaces are `<tag>-br` and `<tag>-h<i>`.
    tag: String,
    /// Hosts are `10.231.<subnet>.<i + 1>/24`.
    subnet: u8,
    count: usize,
    /// `hosts` and `nsswitch.conf` of the hosts.
    files: tempfile::TempDir,
}

/// `ip`, found in PATH or the sbin directories.
fn ip_program() -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"])
        .map(|dir| Path::new(dir).join("ip"))
        .find(|p| p.is_file());
    found
}

fn ip() -> Command {
    Command::new(ip_program().unwrap_or_else(|| "ip".into()))
}

/// Runs `ip ARGS`; `Err` with its stderr when it fails.
fn run_ip(args: &[&str]) -> Result<String, String> {
    let out = ip()
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Pids of the processes in network namespace `ns` (`ip netns pids`; zombies are not listed).
fn pids_in(ns: &str) -> Vec<i32> {
    run_ip(&["netns", "pids", ns])
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Stops every process in `ns`, then SIGKILLs them all: none of them runs between the first
/// kill and the last. Returns the pids killed.
fn kill_namespace(ns: &str) -> Vec<i32> {
    let mut stopped: Vec<i32> = Vec::new();
    // A process may fork while we stop the others: stop until nothing new appears.
    for _ in 0..50 {
        let new: Vec<i32> = pids_in(ns)
            .into_iter()
            .filter(|p| !stopped.contains(p))
            .collect();
        if new.is_empty() {
            break;
        }
        for &pid in &new {
            let _ = kill(Pid::from_raw(pid), Signal::SIGSTOP);
        }
        stopped.extend(new);
    }
    for &pid in &stopped {
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    }
    stopped
}

/// Kills what is left in `ns` (waiting up to `timeout` for it to go), then deletes it.
fn remove_namespace(ns: &str, timeout: Duration) {
    let start = Instant::now();
    loop {
        kill_namespace(ns);
        if pids_in(ns).is_empty() || start.elapsed() > timeout {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = run_ip(&["netns", "del", ns]);
}

/// Removes the namespaces of earlier test processes that are gone (a test binary that was
/// SIGKILLed never ran its `Drop`). Only names this harness makes are touched.
fn sweep_stale() {
    let Ok(list) = run_ip(&["netns", "list"]) else {
        return;
    };
    for line in list.lines() {
        let Some(name) = line.split_whitespace().next() else {
            continue;
        };
        let Some(pid) = name
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            remove_namespace(name, Duration::from_secs(5));
        }
    }
}

impl Hosts {
    /// `count` hosts `h0`, `h1`, ... on a bridge; `None`, after one `skipping: <why>` line on
    /// stderr, where namespaces cannot be made here (not root, no `ip` or `unshare`, no
    /// permission).
    pub fn new(count: usize) -> Option<Hosts> {
        match Self::try_new(count) {
            Ok(hosts) => Some(hosts),
            Err(why) => {
                eprintln!("skipping: {why}");
                None
            }
        }
    }

    fn try_new(count: usize) -> Result<Hosts, String> {
        assert!((1..=200).contains(&count));
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("separate hosts need root (network namespaces)".into());
        }
        if ip_program().is_none() {
            return Err("no `ip` (iproute2) to make network namespaces".into());
        }
        for program in ["unshare", "hostname", "mount"] {
            let found = Command::new(program)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok();
            if !found {
                return Err(format!("no `{program}` to make separate hosts"));
            }
        }
        sweep_stale();
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let tag = format!("{PREFIX}{pid}-{n}");
        // Namespaces are private networks, so subnets never clash; a distinct one per cluster
        // only keeps logs of parallel tests apart.
        let subnet = ((pid as usize * 7 + n as usize) % 250) as u8 + 1;
        let files = tempfile::Builder::new()
            .prefix("gptrec-hosts-")
            .tempdir()
            .map_err(|e| format!("a temporary directory: {e}"))?;
        let mut hosts_file = String::from("127.0.0.1 localhost\n");
        for i in 0..count {
            hosts_file.push_str(&format!("10.231.{subnet}.{} h{i}\n", i + 1));
        }
        std::fs::write(files.path().join("hosts"), hosts_file).map_err(|e| e.to_string())?;
        std::fs::write(files.path().join("nsswitch.conf"), "hosts: files\n")
            .map_err(|e| e.to_string())?;
        let hosts = Hosts {
            tag,
            subnet,
            count,
            files,
        };
        // From here on, `Drop` removes whatever was made.
        hosts
            .build()
            .map_err(|e| format!("cannot make network namespaces here ({e})"))?;
        let out = hosts
            .command(0, "sh", &["-c", "hostname && ls -A /dev/shm | wc -l"])
            .output()
            .map_err(|e| e.to_string())?;
        let said = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() || said.split_whitespace().collect::<Vec<_>>() != ["h0", "0"] {
            return Err(format!(
                "cannot give a namespace its own host name and /dev/shm ({:?}: {} {})",
                out.status,
                said.trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(hosts)
    }

    fn build(&self) -> Result<(), String> {
        let br = self.bridge_ns();
        run_ip(&["netns", "add", &br])?;
        run_ip(&["-n", &br, "link", "set", "lo", "up"])?;
        run_ip(&["-n", &br, "link", "add", "br0", "type", "bridge"])?;
        run_ip(&["-n", &br, "link", "set", "br0", "up"])?;
        for i in 0..self.count {
            let ns = self.ns(i);
            let port = self.port(i);
            run_ip(&["netns", "add", &ns])?;
            run_ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            // The bridge's end is `h<i>` in the bridge's namespace, the host's is `eth0`.
            run_ip(&[
                "-n", &br, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns",
                &ns,
            ])?;
            run_ip(&["-n", &br, "link", "set", &port, "master", "br0"])?;
            run_ip(&["-n", &br, "link", "set", &port, "up"])?;
            let cidr = format!("{}/24", self.addr(i));
            run_ip(&["-n", &ns, "addr", "add", &cidr, "dev", "eth0"])?;
            run_ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
        }
        Ok(())
    }

    pub fn count(&self) -> usize {
        self.count
    }

    /// Host `i`'s name (`h<i>`), which every host resolves to [`Hosts::addr`].
    pub fn name(&self, i: usize) -> String {
        format!("h{i}")
    }

    /// Host `i`'s address.
    pub fn addr(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 231, self.subnet, i as u8 + 1)
    }

    /// Host `i`'s network namespace.
    pub fn ns(&self, i: usize) -> String {
        format!("{}-h{i}", self.tag)
    }

    fn bridge_ns(&self) -> String {
        format!("{}-br", self.tag)
    }

    /// The bridge's end of host `i`'s link.
    fn port(&self, i: usize) -> String {
        format!("h{i}")
    }

    /// `PROGRAM ARGS...` as a process of host `i` (its network, host name, `/dev/shm` and
    /// hosts file), in the repository root, with piped output and without the job-shape
    /// variables of the environment the tests run in (Slurm's, `PET_*`, `LAUNCH_RUN_ID*`).
    pub fn command(
        &self,
        i: usize,
        program: impl AsRef<std::ffi::OsStr>,
        args: &[&str],
    ) -> Command {
        let mut cmd = ip();
        for (key, _) in std::env::vars_os() {
            let key = key.to_string_lossy();
            if key.starts_with("SLURM_")
                || key.starts_with("PET_")
                || key.starts_with("LAUNCH_RUN_ID")
            {
                cmd.env_remove(key.as_ref());
            }
        }
        cmd.args([
            "netns",
            "exec",
            &self.ns(i),
            "unshare",
            "--mount",
            "--uts",
            "sh",
            "-c",
        ])
        .arg(HOST_INIT)
        .arg("host-init")
        .arg(self.name(i))
        .arg(self.files.path())
        .arg(program)
        .args(args)
        .current_dir(repo_root())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        cmd
    }

    /// `launch ARGS...` on host `i` (see [`Hosts::command`]).
    pub fn launch(&self, i: usize, args: &[&str]) -> Command {
        self.command(i, bin("launch"), args)
    }

    /// Takes host `i`'s link down on the bridge's side: from now on nothing it sends arrives
    /// and nothing reaches it, and neither side is told.
    pub fn cut(&self, i: usize) {
        run_ip(&[
            "-n",
            &self.bridge_ns(),
            "link",
            "set",
            &self.port(i),
            "down",
        ])
        .unwrap_or_else(|e| panic!("cutting h{i}'s link: {e}"));
    }

    /// Brings host `i`'s link up again.
    pub fn restore(&self, i: usize) {
        run_ip(&["-n", &self.bridge_ns(), "link", "set", &self.port(i), "up"])
            .unwrap_or_else(|e| panic!("restoring h{i}'s link: {e}"));
    }

    /// Pids of the processes running on host `i` (zombies are not listed).
    pub fn pids(&self, i: usize) -> Vec<i32> {
        pids_in(&self.ns(i))
    }

    /// SIGKILLs every process of host `i` at once, as a host that loses power; returns them.
    pub fn kill_all(&self, i: usize) -> Vec<i32> {
        kill_namespace(&self.ns(i))
    }

    /// Waits until no process runs on host `i` (or `timeout`), returning what is left, each
    /// with its command line.
    pub fn wait_empty(&self, i: usize, timeout: Duration) -> Vec<String> {
        let start = Instant::now();
        loop {
            let left = self.pids(i);
            if left.is_empty() || start.elapsed() > timeout {
                return left
                    .iter()
                    .map(|p| {
                        let cmdline = std::fs::read(format!("/proc/{p}/cmdline"))
                            .unwrap_or_default()
                            .split(|&b| b == 0)
                            .map(|s| String::from_utf8_lossy(s).into_owned())
                            .collect::<Vec<_>>()
                            .join(" ");
                        format!("{p}: {}", cmdline.trim())
                    })
                    .collect();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Bytes that crossed host `i`'s link so far (both ways, counted at the bridge).
    pub fn link_bytes(&self, i: usize) -> u64 {
        let out = run_ip(&[
            "-n",
            &self.bridge_ns(),
            "-s",
            "-j",
            "link",
            "show",
            "dev",
            &self.port(i),
        ])
        .unwrap_or_else(|e| panic!("h{i}'s link counters: {e}"));
        let v: serde_json::Value = serde_json::from_str(&out).expect("ip -j output");
        let stats = &v[0]["stats64"];
        stats["rx"]["bytes"].as_u64().unwrap_or(0) + stats["tx"]["bytes"].as_u64().unwrap_or(0)
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for i in 0..self.count {
            remove_namespace(&self.ns(i), Duration::from_secs(10));
        }
        // Deleting the bridge's namespace deletes the bridge and the veths' last ends.
        let _ = run_ip(&["netns", "del", &self.bridge_ns()]);
    }
}
