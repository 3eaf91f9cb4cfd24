//! Runs a hostfile job: one `ssh HOST launch ...` per node, its environment (run id first)
//! written to ssh's stdin, every line of its output labelled `[HOST] ` and written whole, and
//! the job's end: the first host that fails stops the others (their ssh stdin is closed, so
//! their `launch` ends its workers as on SIGTERM), and the exit code is the worst of the hosts
//! that failed on their own.

use std::io::{BufRead as _, BufReader, Read, Write as _};
use std::process::{ChildStdin, Stdio};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};

use super::plan::{env_block, Fanout};

/// ssh's own exit code for its errors (unreachable host, refused login, lost connection).
const SSH_FAILED: i32 = 255;
/// After the hosts were told to stop, how much longer than the grace period they get before
/// their ssh is sent SIGTERM, then SIGKILL.
const STOP_SLACK: Duration = Duration::from_secs(10);

enum Event {
    Ended(usize, i32),
    Signal(i32),
}

/// One host's ssh while it runs.
struct Remote {
    name: String,
    pid: i32,
    /// Closing it (the end of the job's stdin) stops the host's `launch`.
    stdin: Option<ChildStdin>,
    code: Option<i32>,
}

/// Starts every host and supervises them to the end; the process's exit code.
pub fn run(fanout: &Fanout, run_id: &str, grace: Duration) -> i32 {
    let (tx, rx) = crossbeam_channel::unbounded();
    if let Err(e) = forward_signals(tx.clone()) {
        eprintln!("launch: error: cannot install signal handlers: {e}");
        return 1;
    }
    let mut remotes = Vec::new();
    for (i, node) in fanout.nodes.iter().enumerate() {
        match start(fanout, i, run_id, tx.clone()) {
            Ok(remote) => remotes.push(remote),
            Err(e) => {
                eprintln!(
                    "launch: error: host {}: cannot start ssh: {e}",
                    node.host.name
                );
                stop(&mut remotes);
                wait_all(&mut remotes, &rx, grace);
                return 1;
            }
        }
    }
    supervise(remotes, &rx, grace)
}

fn forward_signals(tx: Sender<Event>) -> std::io::Result<()> {
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            for sig in signals.forever() {
                if tx.send(Event::Signal(sig)).is_err() {
                    break;
                }
            }
        })?;
    Ok(())
}

/// Starts node `i`'s ssh, writes its environment to its stdin (kept open), and starts the
/// threads that label its output and wait for its end.
fn start(fanout: &Fanout, i: usize, run_id: &str, tx: Sender<Event>) -> std::io::Result<Remote> {
    let node = &fanout.nodes[i];
    let mut child = fanout
        .ssh(node)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut stdin = child.stdin.take();
    if let Some(pipe) = stdin.as_mut() {
        // A host that is already gone shows as ssh's exit; its stdin may then be closed.
        let _ = pipe.write_all(&env_block(&fanout.env_of(node, run_id)));
        let _ = pipe.flush();
    }
    let name = node.host.name.clone();
    if let Some(out) = child.stdout.take() {
        label_lines(out, format!("[{name}] "), false)?;
    }
    if let Some(err) = child.stderr.take() {
        label_lines(err, format!("[{name}] "), true)?;
    }
    let pid = child.id() as i32;
    std::thread::Builder::new()
        .name(format!("wait-{name}"))
        .spawn(move || {
            let code = match child.wait() {
                Ok(status) => exit_code(status),
                Err(_) => SSH_FAILED,
            };
            let _ = tx.send(Event::Ended(i, code));
        })?;
    Ok(Remote {
        name,
        pid,
        stdin,
        code: None,
    })
}

fn exit_code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt as _;
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(SSH_FAILED)
}

/// Copies `from` to our stdout (or stderr) a whole line at a time, each behind `label`.
fn label_lines(from: impl Read + Send + 'static, label: String, err: bool) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name(format!("out{label}"))
        .spawn(move || {
            let mut reader = BufReader::new(from);
            let mut line = Vec::new();
            loop {
                line.clear();
                match reader.read_until(b'\n', &mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
                if !line.ends_with(b"\n") {
                    line.push(b'\n');
                }
                let mut whole = label.as_bytes().to_vec();
                whole.extend_from_slice(&line);
                // One write under the stream's lock: lines of hosts never mix.
                let _ = if err {
                    std::io::stderr().lock().write_all(&whole)
                } else {
                    std::io::stdout().lock().write_all(&whole)
                };
            }
        })?;
    Ok(())
}

/// Closes every host's stdin: each `launch` ends its workers and exits.
fn stop(remotes: &mut [Remote]) {
    for r in remotes.iter_mut() {
        r.stdin = None;
    }
}

/// Sends `signal` to the ssh of every host that has not ended.
fn signal_running(remotes: &[Remote], signal: Signal) {
    for r in remotes.iter().filter(|r| r.code.is_none()) {
        let _ = kill(Pid::from_raw(r.pid), signal);
    }
}

/// Waits for the hosts to end after [`stop`]: SIGTERM to their ssh after the grace period and
/// some slack, SIGKILL as long again later.
fn wait_all(remotes: &mut [Remote], rx: &Receiver<Event>, grace: Duration) {
    let stopped = Instant::now();
    let mut sent = 0;
    while remotes.iter().any(|r| r.code.is_none()) {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(Event::Ended(i, code)) => remotes[i].code = Some(code),
            Ok(Event::Signal(_)) => signal_running(remotes, Signal::SIGKILL),
            Err(_) => {}
        }
        let late = stopped.elapsed().saturating_sub(grace + STOP_SLACK);
        if sent == 0 && late > Duration::ZERO {
            signal_running(remotes, Signal::SIGTERM);
            sent = 1;
        } else if sent == 1 && late > STOP_SLACK {
            signal_running(remotes, Signal::SIGKILL);
            sent = 2;
        }
    }
}

/// Waits for the first host to fail (or a signal, or every host to succeed), stops the others,
/// and returns the job's exit code.
fn supervise(mut remotes: Vec<Remote>, rx: &Receiver<Event>, grace: Duration) -> i32 {
    let mut failed: Vec<usize> = Vec::new();
    let mut signal = None;
    while remotes.iter().any(|r| r.code.is_none()) {
        match rx.recv() {
            Ok(Event::Ended(i, code)) => {
                remotes[i].code = Some(code);
                if code != 0 {
                    failed.push(i);
                    break;
                }
            }
            Ok(Event::Signal(sig)) => {
                signal = Some(sig);
                break;
            }
            Err(_) => break,
        }
    }
    if remotes.iter().any(|r| r.code.is_none()) {
        let others: Vec<&str> = (remotes.iter().filter(|r| r.code.is_none()))
            .map(|r| r.name.as_str())
            .collect();
        eprintln!("launch: stopping the other hosts ({})", others.join(", "));
        // Hosts that ended before they were told to stop failed on their own, too.
        while let Ok(Event::Ended(i, code)) = rx.try_recv() {
            remotes[i].code = Some(code);
            if code != 0 {
                failed.push(i);
            }
        }
        stop(&mut remotes);
        wait_all(&mut remotes, rx, grace);
    }
    finish(&remotes, &failed, signal)
}

/// The exit code: the worst of the hosts that failed on their own, else 128 + the signal that
/// stopped the job, else 0; one line for each failed host.
fn finish(remotes: &[Remote], failed: &[usize], signal: Option<i32>) -> i32 {
    for &i in failed {
        let r = &remotes[i];
        match r.code {
            Some(SSH_FAILED) => eprintln!(
                "launch: error: host {}: ssh failed with exit code 255 (host unreachable, login refused, or connection lost; its lines above say which)",
                r.name
            ),
            Some(code) => eprintln!("launch: error: host {} failed with exit code {code}", r.name),
            None => {}
        }
    }
    let worst = failed.iter().filter_map(|&i| remotes[i].code).max();
    match (worst, signal) {
        (Some(code), _) => code,
        (None, Some(sig)) => 128 + sig,
        (None, None) => remotes.iter().filter_map(|r| r.code).max().unwrap_or(0),
    }
}
