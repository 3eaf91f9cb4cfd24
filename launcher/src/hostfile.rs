//! `launch --hostfile FILE`: DeepSpeed's multi-host launch, one `launch` per host over `ssh`.
//! `parse` reads the hostfile and `--include`/`--exclude`, `plan` makes each host's ssh command
//! and environment, `run` starts and supervises them. The run id and the user's variables
//! travel on ssh's stdin, never on a command line. On the other side, [`stop_on_stdin_eof`]
//! ends the job when that stdin ends (the launching side stopped it, or the connection dropped).

mod parse;
mod plan;
mod run;

use std::ffi::OsString;
use std::io::{Read as _, Write as _};

use common::job_shape::RUN_ID_VAR;

use crate::cli::Cli;
use plan::Fanout;

/// Runs (or, with `--dry-run`, shows) the hostfile job of `cli`; the process's exit code.
pub fn main(cli: &Cli) -> i32 {
    let args: Vec<OsString> = std::env::args_os().collect();
    let fanout = match Fanout::from_cli(cli, &args) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("launch: error: {e}");
            return 2;
        }
    };
    for notice in &fanout.notices {
        eprintln!("launch: warning: {notice}");
    }
    if cli.dry_run {
        let _ = std::io::stdout()
            .lock()
            .write_all(describe(&fanout).as_bytes());
        return 0;
    }
    let run_id = match run_id(cli) {
        Ok(id) => id,
        Err(RunIdError::Usage(e)) => {
            eprintln!("launch: error: {e}");
            return 2;
        }
        Err(RunIdError::Failed(e)) => {
            eprintln!("launch: error: {e}");
            return 1;
        }
    };
    let hosts: Vec<&str> = fanout.nodes.iter().map(|n| n.host.name.as_str()).collect();
    eprintln!(
        "launch: {} hosts from {} ({}), master {}",
        hosts.len(),
        fanout.hostfile.display(),
        hosts.join(", "),
        common::hostlist::join_host_port(&fanout.master_addr, fanout.master_port)
    );
    run::run(&fanout, &run_id, cli.grace_period)
}

/// Why there is no run id to send: a given one that cannot travel (exit 2), or no fresh one.
enum RunIdError {
    Usage(String),
    Failed(String),
}

/// The job's run id: `--run-id`, `LAUNCH_RUN_ID`, or a fresh secret. A given one travels as
/// one `NAME=value` line of each host's environment block: a control character in it (a
/// newline would end the line and start another variable, an empty line the block) is refused.
fn run_id(cli: &Cli) -> Result<String, RunIdError> {
    let given = match &cli.run_id {
        Some(id) => Some((id.clone(), "--run-id")),
        None => std::env::var(RUN_ID_VAR)
            .ok()
            .filter(|id| !id.trim().is_empty())
            .map(|id| (id, RUN_ID_VAR)),
    };
    match given {
        Some((id, from)) if id.chars().any(char::is_control) => Err(RunIdError::Usage(format!(
            "{from}: the run id holds a control character (a newline, a tab, ...), which cannot be sent to the hosts as one line; use letters, digits and punctuation (e.g. openssl rand -hex 16)"
        ))),
        Some((id, _)) => Ok(id),
        None => crate::secret::fresh_run_id().map_err(RunIdError::Failed),
    }
}

/// `--dry-run` with a hostfile: each node's host, slots and ssh command line, and the names
/// of the variables it gets on stdin (the run id's value is never shown).
fn describe(f: &Fanout) -> String {
    let total: usize = f.nodes.iter().map(|n| n.host.slots.len()).sum();
    let mut out = format!(
        "hostfile {}: {} nodes, {total} processes in all, master {}\n",
        f.hostfile.display(),
        f.nodes.len(),
        common::hostlist::join_host_port(&f.master_addr, f.master_port)
    );
    if !f.excluded.is_empty() {
        out.push_str(&format!("excluded: {}\n", f.excluded.join(", ")));
    }
    for node in &f.nodes {
        let slots: Vec<String> = node.host.slots.iter().map(u32::to_string).collect();
        out.push_str(&format!(
            "node {}: {} slots {} ({} processes)\n",
            node.rank,
            node.host.name,
            slots.join(","),
            slots.len()
        ));
        let mut line: Vec<u8> = b"  ".to_vec();
        for word in std::iter::once(OsString::from("ssh"))
            .chain(f.ssh_options.iter().cloned())
            .chain([node.host.name.clone().into()])
        {
            line.extend(plan::quote(&word));
            line.push(b' ');
        }
        // ssh hands the rest to the host's shell as it is: shown unquoted, it is shell text.
        line.extend(f.remote_command(node).as_encoded_bytes());
        out.push_str(String::from_utf8_lossy(&line).trim_end());
        let names: Vec<String> = (f.env_of(node, "").into_iter())
            .map(|(k, v)| match k.as_str() {
                RUN_ID_VAR => format!("{k}=<secret>"),
                "CUDA_VISIBLE_DEVICES" | plan::STOP_ON_EOF_VAR => format!("{k}={v}"),
                _ => k,
            })
            .collect();
        out.push_str(&format!("\n  on ssh's stdin: {}\n", names.join(" ")));
    }
    out
}

/// In a `launch` started by a hostfile job (`LAUNCH_STOP_ON_STDIN_EOF=1`): a thread that
/// waits for the end of stdin, the ssh channel, and then sends this process SIGTERM, so the job
/// ends as on a signal (workers torn down, exit code 143). Call after the orphan guard started.
pub fn stop_on_stdin_eof() {
    if std::env::var_os(plan::STOP_ON_EOF_VAR).is_none_or(|v| v != "1") {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("stdin-eof".into())
        .spawn(|| {
            let mut buf = [0u8; 256];
            let mut stdin = std::io::stdin().lock();
            loop {
                match stdin.read(&mut buf) {
                    Ok(0) => break,
                    Ok(_) => continue,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(_) => break,
                }
            }
            let _ = nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::SIGTERM);
        });
    if let Err(e) = spawned {
        eprintln!("launch: warning: cannot watch stdin for the end of the ssh connection: {e}");
    }
}
