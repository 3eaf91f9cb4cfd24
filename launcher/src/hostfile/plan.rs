//! The fan-out of a hostfile job: which host is which node, the `ssh` command line of each
//! (which never holds the run id or the environment), and the environment block each host's
//! `launch` reads from ssh's stdin before it starts.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt as _, OsStringExt as _};
use std::path::PathBuf;
use std::process::Command;

use common::job_shape::{DEFAULT_MASTER_PORT, RUN_ID_VAR};

use super::parse::{self, Host, HostfileError};
use crate::cli::Cli;

/// Set in each remote `launch`'s environment: end the job (as on SIGTERM) when stdin, the ssh
/// channel, reaches its end, that is when the launching side closes it or the connection drops.
pub const STOP_ON_EOF_VAR: &str = "LAUNCH_STOP_ON_STDIN_EOF";
/// The path of `launch` on the other hosts when `--launch-path` is not given.
pub const REMOTE_PATH_VAR: &str = "LAUNCH_REMOTE_PATH";
/// Variables passed to every host under their own name, when set here. `PATH` and the active
/// virtual or conda environment too, so that a script's `python3` is the one it runs with here
/// (the hosts share this directory, and so the environment's files, as DeepSpeed's runner
/// assumes).
pub const FORWARDED_VARS: &[&str] = &[
    "PATH",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "CONDA_DEFAULT_ENV",
    "LD_LIBRARY_PATH",
    "OMP_NUM_THREADS",
    "RUST_LOG",
    "RUST_BACKTRACE",
];
/// Variables passed to every host when their names start with one of these.
pub const FORWARDED_PREFIXES: &[&str] = &[
    "NCCL_",
    "GPTREC_",
    "TORCH_",
    "HF_",
    "PYTHON",
    "UCX_",
    "ACCELERATE_",
];
/// Flags of ours that are not passed on: the hostfile's, and those each host gets its own of.
const NOT_FORWARDED: &[&str] = &[
    "hostfile",
    "include",
    "exclude",
    "launch_path",
    "ssh_port",
    "ssh_config",
    "run_id",
    "master_addr",
    "master_port",
    "dry_run",
];

/// One host's part: node `rank` of the job, on `host.slots`.
#[derive(Debug, Clone)]
pub struct Node {
    pub rank: u32,
    pub host: Host,
    /// Fewer slots than the hostfile gave the host (`--include`/`--exclude`): the host's
    /// workers see only these GPUs (`CUDA_VISIBLE_DEVICES`).
    pub subset: bool,
}

/// The whole fan-out (see the module's documentation).
#[derive(Debug)]
pub struct Fanout {
    pub hostfile: PathBuf,
    pub nodes: Vec<Node>,
    /// Hosts of the hostfile that get nothing.
    pub excluded: Vec<String>,
    pub master_addr: String,
    pub master_port: u16,
    pub launch_path: PathBuf,
    pub cwd: PathBuf,
    pub ssh_options: Vec<OsString>,
    /// The user's flags and CONFIG/PROGRAM, as given, less [`NOT_FORWARDED`].
    pub forwarded: Vec<OsString>,
    /// The user's variables every host gets (names and values; the run id is not here).
    pub env: Vec<(String, String)>,
    /// One-line notices (variables that cannot be passed, a run id on the command line).
    pub notices: Vec<String>,
}

impl Fanout {
    /// The fan-out of `cli` (with `--hostfile`), whose command line was `args`.
    pub fn from_cli(cli: &Cli, args: &[OsString]) -> Result<Fanout, HostfileError> {
        let path = cli.hostfile.clone().unwrap_or_default();
        let all = parse::read(&path)?;
        let kept = parse::filter(&all, cli.include.as_deref(), cli.exclude.as_deref())?;
        let nodes: Vec<Node> = (kept.iter().enumerate())
            .map(|(i, host)| Node {
                rank: i as u32,
                subset: all
                    .iter()
                    .any(|h| h.name == host.name && h.slots != host.slots),
                host: host.clone(),
            })
            .collect();
        let excluded = (all
            .iter()
            .filter(|h| !kept.iter().any(|k| k.name == h.name)))
        .map(|h| h.name.clone())
        .collect();
        uniform(&nodes)?;
        if cli.master_port == Some(0) {
            return Err(HostfileError(
                "--master-port 0 cannot be used with --hostfile: every host must dial the same port".into(),
            ));
        }
        let (env, mut notices) = forwarded_env(std::env::vars_os());
        if cli.run_id.is_some() {
            notices.push(format!("--run-id is on this launch's own command line, where `ps` shows it; export {RUN_ID_VAR} instead (it reaches the hosts through ssh's stdin either way)"));
        }
        let launch_path = match (&cli.launch_path, std::env::var_os(REMOTE_PATH_VAR)) {
            (Some(p), _) => p.clone(),
            (None, Some(p)) => PathBuf::from(p),
            (None, None) => std::env::current_exe().map_err(|e| {
                HostfileError(format!("the path of this launch (give --launch-path): {e}"))
            })?,
        };
        let mut ssh_options: Vec<OsString> = vec!["-o".into(), "BatchMode=yes".into()];
        if let Some(port) = cli.ssh_port {
            ssh_options.extend(["-p".into(), port.to_string().into()]);
        }
        if let Some(config) = &cli.ssh_config {
            ssh_options.extend(["-F".into(), config.clone().into_os_string()]);
        }
        Ok(Fanout {
            hostfile: path,
            master_addr: (cli.master_addr.clone()).unwrap_or_else(|| nodes[0].host.name.clone()),
            master_port: cli.master_port.unwrap_or(DEFAULT_MASTER_PORT),
            nodes,
            excluded,
            launch_path,
            cwd: std::env::current_dir()
                .map_err(|e| HostfileError(format!("the current directory: {e}")))?,
            ssh_options,
            forwarded: forwarded_args(args, cli.script.len()),
            env,
            notices,
        })
    }

    /// `launch` and its arguments on `node`'s host.
    pub fn remote_args(&self, node: &Node) -> Vec<OsString> {
        let mut args: Vec<OsString> = vec![self.launch_path.clone().into_os_string()];
        for (flag, value) in [
            ("--nnodes", self.nodes.len().to_string()),
            ("--node-rank", node.rank.to_string()),
            ("--master-addr", self.master_addr.clone()),
            ("--master-port", self.master_port.to_string()),
            ("--num-processes", node.host.slots.len().to_string()),
        ] {
            args.extend([flag.into(), value.into()]);
        }
        args.extend(self.forwarded.iter().cloned());
        args
    }

    /// The one word ssh runs on `node`'s host: a POSIX shell that enters this directory, exports
    /// the `NAME=value` lines it reads from stdin up to an empty line, then becomes `launch`.
    pub fn remote_command(&self, node: &Node) -> OsString {
        let mut script: Vec<u8> = b"cd ".to_vec();
        script.extend(quote(self.cwd.as_os_str()));
        script.extend(
            b" || exit 2; while IFS= read -r kv && [ -n \"$kv\" ]; do export \"$kv\"; done; exec",
        );
        for arg in self.remote_args(node) {
            script.push(b' ');
            script.extend(quote(&arg));
        }
        let mut command = b"sh -c ".to_vec();
        command.extend(quote(OsStr::from_bytes(&script)));
        OsString::from_vec(command)
    }

    /// `ssh ... HOST COMMAND` for `node`.
    pub fn ssh(&self, node: &Node) -> Command {
        let mut cmd = Command::new("ssh");
        cmd.args(&self.ssh_options)
            .arg(&node.host.name)
            .arg(self.remote_command(node));
        cmd
    }

    /// The variables `node`'s `launch` gets, the run id first (names and values).
    pub fn env_of(&self, node: &Node, run_id: &str) -> Vec<(String, String)> {
        let mut env = vec![
            (RUN_ID_VAR.to_string(), run_id.to_string()),
            (STOP_ON_EOF_VAR.to_string(), "1".to_string()),
        ];
        if node.subset {
            let ids: Vec<String> = node.host.slots.iter().map(u32::to_string).collect();
            env.push(("CUDA_VISIBLE_DEVICES".into(), ids.join(",")));
        }
        env.extend(self.env.iter().cloned());
        env
    }
}

/// Every node runs as many workers (a static job's world size is nodes x processes per node).
fn uniform(nodes: &[Node]) -> Result<(), HostfileError> {
    let first = &nodes[0].host;
    match nodes.iter().find(|n| n.host.slots.len() != first.slots.len()) {
        Some(n) => Err(HostfileError(format!(
            "every host must get the same number of slots: {} gets {}, {} gets {} (narrow them with --include/--exclude)",
            first.name,
            first.slots.len(),
            n.host.name,
            n.host.slots.len()
        ))),
        None => Ok(()),
    }
}

/// What goes to ssh's stdin: `NAME=value` lines and an empty line.
pub fn env_block(env: &[(String, String)]) -> Vec<u8> {
    let mut block = Vec::new();
    for (name, value) in env {
        block.extend(format!("{name}={value}\n").as_bytes());
    }
    block.push(b'\n');
    block
}

/// The user's variables that every host gets ([`FORWARDED_VARS`], [`FORWARDED_PREFIXES`]),
/// sorted; and a notice for each that cannot travel as one line of text.
fn forwarded_env(
    vars: impl Iterator<Item = (OsString, OsString)>,
) -> (Vec<(String, String)>, Vec<String>) {
    let mut env = Vec::new();
    let mut notices = Vec::new();
    for (name, value) in vars {
        let Some(name) = name.to_str().map(str::to_string) else {
            continue;
        };
        let wanted = FORWARDED_VARS.contains(&name.as_str())
            || FORWARDED_PREFIXES.iter().any(|p| name.starts_with(p));
        if !wanted || !valid_name(&name) {
            continue;
        }
        // One line each: no newline (it would start another variable), no other control
        // character but the tab.
        match value.into_string() {
            Ok(v) if !v.chars().any(|c| c.is_control() && c != '\t') => env.push((name, v)),
            _ => notices.push(format!(
                "{name} is not passed to the hosts: its value is not one line of UTF-8 text"
            )),
        }
    }
    env.sort();
    (env, notices)
}

fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// `args` (program name first) less the program name and the flags in [`NOT_FORWARDED`] (with
/// their values), up to `--` or the script (the last `script_len` words), which pass as they are.
pub fn forwarded_args(args: &[OsString], script_len: usize) -> Vec<OsString> {
    let command = crate::cli::abbrev::built_command();
    let options_end = args.len().saturating_sub(script_len);
    let mut out = Vec::new();
    let mut i = 1;
    while i < args.len() {
        let word = args[i].to_string_lossy();
        if i >= options_end || word == "--" {
            out.extend(args[i..].iter().cloned());
            break;
        }
        // Read as clap reads it: an abbreviation (`--master-p 7`) or a short flag (`-H FILE`).
        let kept_back = crate::cli::abbrev::flag(&command, &word)
            .filter(|f| NOT_FORWARDED.contains(&f.arg.get_id().as_str()));
        match kept_back.map(|f| f.value_follows()) {
            Some(true) => i += 2,
            Some(_) => i += 1,
            None => {
                out.push(args[i].clone());
                i += 1;
            }
        }
    }
    out
}

/// `word` as one word of a POSIX shell: in single quotes, each `'` as `'\''`.
pub fn quote(word: &OsStr) -> Vec<u8> {
    let bytes = word.as_bytes();
    let plain = !bytes.is_empty()
        && (bytes.iter()).all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(b));
    if plain {
        return bytes.to_vec();
    }
    let mut out = vec![b'\''];
    for &b in bytes {
        if b == b'\'' {
            out.extend(b"'\\''");
        } else {
            out.push(b);
        }
    }
    out.push(b'\'');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(words: &[&str]) -> Vec<OsString> {
        words.iter().map(OsString::from).collect()
    }

    #[test]
    fn hostfile_flags_and_per_host_flags_are_not_forwarded() {
        let args = os(&[
            "launch",
            "--hostfile",
            "hf",
            "--include=h0",
            "--run-id",
            "s3cret",
            "--set",
            "a=1",
            "--master-port",
            "7",
            "--grace-period",
            "2",
            "c.toml",
        ]);
        assert_eq!(
            forwarded_args(&args, 0),
            os(&["--set", "a=1", "--grace-period", "2", "c.toml"])
        );
        // Abbreviated as torchrun allows, or short: read as clap reads them.
        let args = os(&[
            "launch",
            "--hostf",
            "hf",
            "--master-p",
            "7",
            "--grace",
            "2",
            "c.toml",
        ]);
        assert_eq!(forwarded_args(&args, 0), os(&["--grace", "2", "c.toml"]));
        let args = os(&["launch", "-H", "hf", "--run_id=s3cret", "--q", "c.toml"]);
        assert_eq!(forwarded_args(&args, 0), os(&["--q", "c.toml"]));
        let args = os(&["launch", "-Hhf", "--run-id", "s3cret", "c.toml"]);
        assert_eq!(forwarded_args(&args, 0), os(&["c.toml"]));
        let args = os(&["launch", "--hostfile=hf", "--", "sh", "--hostfile", "x"]);
        assert_eq!(
            forwarded_args(&args, 0),
            os(&["--", "sh", "--hostfile", "x"])
        );
        let args = os(&["launch", "--hostfile", "hf", "train.py", "--include", "x"]);
        assert_eq!(
            forwarded_args(&args, 3),
            os(&["train.py", "--include", "x"])
        );
    }

    #[test]
    fn words_are_quoted_for_a_posix_shell() {
        assert_eq!(quote(OsStr::new("a/b.toml")), b"a/b.toml");
        assert_eq!(quote(OsStr::new("it's")), b"'it'\\''s'");
        assert_eq!(quote(OsStr::new("")), b"''");
        assert_eq!(quote(OsStr::new("x=\"tiny\"")), b"'x=\"tiny\"'");
    }

    #[test]
    fn only_chosen_one_line_variables_are_forwarded() {
        let vars = [
            ("PYTHONPATH", "/p"),
            ("PATH", "/venv/bin:/usr/bin"),
            ("VIRTUAL_ENV", "/venv"),
            ("NCCL_DEBUG", "INFO"),
            ("HOME", "/root"),
            ("GPTREC_X", "a\nb"),
            ("GPTREC_Y", "a\rb"),
            ("NCCL_TAB", "a\tb"),
            ("LAUNCH_RUN_ID", "secret"),
        ]
        .map(|(k, v)| (OsString::from(k), OsString::from(v)));
        let (env, notices) = forwarded_env(vars.into_iter());
        assert_eq!(
            env,
            vec![
                ("NCCL_DEBUG".to_string(), "INFO".to_string()),
                ("NCCL_TAB".into(), "a\tb".into()),
                ("PATH".into(), "/venv/bin:/usr/bin".into()),
                ("PYTHONPATH".into(), "/p".into()),
                ("VIRTUAL_ENV".into(), "/venv".into())
            ]
        );
        assert_eq!(notices.len(), 2);
        assert!(notices[0].starts_with("GPTREC_X is not passed"));
        assert!(notices[1].starts_with("GPTREC_Y is not passed"));
        assert_eq!(
            env_block(&[("A".into(), "1 2".into())]),
            b"A=1 2\n\n".to_vec()
        );
    }
}
