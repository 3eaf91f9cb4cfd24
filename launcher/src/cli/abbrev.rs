//! torchrun's abbreviated flags: its argparse takes any unambiguous prefix of a long flag
//! (`--nproc-per 2`, `--max-r 3`), and so does `launch` (clap's `infer_long_args`). This module
//! owns the one reading of a word as a flag for every look at the words before clap's parse
//! (where the script starts; which flags a hostfile keeps from the other hosts), so that they and
//! clap agree on what a word names. It must not parse values.

use clap::{Arg, Command};

/// A word of the command line read as a flag.
pub struct Flag<'a> {
    pub arg: &'a Arg,
    /// The word holds the value too (`--flag=V`, `-HV`, `-H=V`).
    pub value_inline: bool,
}

impl Flag<'_> {
    /// Whether the next word is this flag's value.
    pub fn value_follows(&self) -> bool {
        self.arg.get_action().takes_values() && !self.value_inline
    }
}

/// Every long name of `a`: its long flag, then its aliases.
fn names(a: &Arg) -> impl Iterator<Item = &str> {
    (a.get_long().into_iter()).chain(a.get_all_aliases().unwrap_or_default())
}

/// Each argument with a name that starts with `prefix`, and the first such name.
fn starting_with<'a>(command: &'a Command, prefix: &str) -> Vec<(&'a Arg, &'a str)> {
    (command.get_arguments())
        .filter_map(|a| names(a).find(|n| n.starts_with(prefix)).map(|n| (a, n)))
        .collect()
}

/// The flag that `word` names (`--NAME`, `--NAME=V`, a prefix of either as [`long_flag`]
/// resolves it; `-X`, `-XV`), in `command` as built (`Command::build`: with `--help` and
/// `--version`, which clap's prefixes count). `None` for any other word.
pub fn flag<'a>(command: &'a Command, word: &str) -> Option<Flag<'a>> {
    if word.starts_with("--") {
        let arg = long_flag(command, word)?;
        return Some(Flag {
            arg,
            value_inline: word.contains('='),
        });
    }
    let mut chars = word.strip_prefix('-')?.chars();
    let short = chars.next()?;
    let arg = command.get_arguments().find(|a| {
        a.get_short() == Some(short)
            || a.get_all_short_aliases()
                .is_some_and(|s| s.contains(&short))
    })?;
    Some(Flag {
        arg,
        value_inline: chars.next().is_some(),
    })
}

/// The argument that `word` (`--NAME` or `--NAME=VALUE`) names: the one whose long name or
/// alias is NAME, else the only one with a long name or alias that starts with NAME, as clap's
/// `infer_long_args` resolves it. `None` for any other word, an ambiguous prefix included.
pub fn long_flag<'a>(command: &'a Command, word: &str) -> Option<&'a Arg> {
    let name = word.strip_prefix("--")?;
    let name = name.split_once('=').map_or(name, |(name, _)| name);
    if name.is_empty() {
        return None;
    }
    if let Some(exact) = (command.get_arguments()).find(|a| names(a).any(|n| n == name)) {
        return Some(exact);
    }
    match starting_with(command, name)[..] {
        [(only, _)] => Some(only),
        _ => None,
    }
}

/// The flags that `word`, a prefix, could be when it is ambiguous (two or more), each by the
/// name it shares the prefix with; empty otherwise.
pub fn ambiguous(command: &Command, word: &str) -> Vec<String> {
    let name = word.strip_prefix("--").unwrap_or_default();
    if name.is_empty() || name.contains('=') || long_flag(command, word).is_some() {
        return Vec::new();
    }
    // Each flag once, by the first of its names that starts so (`--term-timeout`, an alias).
    let mut could: Vec<String> = (starting_with(command, name).into_iter())
        .map(|(_, n)| format!("--{n}"))
        .collect();
    could.sort();
    if could.len() < 2 {
        could.clear();
    }
    could
}

/// An unknown flag that is a prefix of several: said as torchrun's argparse says it
/// (`ambiguous option: --master could match --master-addr, --master-port`), not as unknown.
pub fn name_ambiguity(command: &mut Command, error: clap::Error) -> clap::Error {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    let word = match error.get(ContextKind::InvalidArg) {
        Some(ContextValue::String(word)) if error.kind() == ErrorKind::UnknownArgument => word,
        _ => return error,
    };
    let could = ambiguous(command, word);
    if could.is_empty() {
        return error;
    }
    let message = format!("ambiguous option: {word} could match {}", could.join(", "));
    command.error(ErrorKind::UnknownArgument, message)
}

/// `Cli`'s command as clap parses with it (built: `--help` and `--version` added).
pub fn built_command() -> Command {
    use clap::CommandFactory;
    let mut command = super::Cli::command();
    command.build();
    command
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{parse_from, Cli, NumProcesses};
    use clap::error::ErrorKind;
    use clap::parser::ValueSource;
    use clap::ArgAction;
    use std::collections::BTreeSet;
    use std::ffi::OsString;

    /// torchrun's long flags (PyTorch 2.11's `torch.distributed.run.get_args_parser()`).
    const TORCHRUN: &[&str] = &[
        "--duplicate-stderr-filters",
        "--duplicate-stdout-filters",
        "--duplicate_stderr_filters",
        "--duplicate_stdout_filters",
        "--event-log-handler",
        "--event_log_handler",
        "--help",
        "--local-addr",
        "--local-ranks-filter",
        "--local_addr",
        "--local_ranks_filter",
        "--log-dir",
        "--log_dir",
        "--logs-specs",
        "--logs_specs",
        "--master-addr",
        "--master-port",
        "--master_addr",
        "--master_port",
        "--max-restarts",
        "--max_restarts",
        "--module",
        "--monitor-interval",
        "--monitor_interval",
        "--nnodes",
        "--no-python",
        "--no_python",
        "--node-rank",
        "--node_rank",
        "--nproc-per-node",
        "--nproc_per_node",
        "--numa-binding",
        "--numa_binding",
        "--rdzv-backend",
        "--rdzv-conf",
        "--rdzv-endpoint",
        "--rdzv-id",
        "--rdzv_backend",
        "--rdzv_conf",
        "--rdzv_endpoint",
        "--rdzv_id",
        "--redirects",
        "--role",
        "--run-path",
        "--run_path",
        "--signals-to-handle",
        "--signals_to_handle",
        "--standalone",
        "--start-method",
        "--start_method",
        "--tee",
        "--virtual-local-rank",
        "--virtual_local_rank",
    ];

    /// Prefixes torchrun takes that are ambiguous here, because `launch` has flags torchrun
    /// has not (`--no-pin`, `--require-secret`, `--run-id`, `--run-id-file`, `--term-timeout`):
    /// refused as ambiguous, naming the flags they could match; one more letter resolves each.
    /// `--h` is torchrun's `--help`; here `--hostfile` shares it.
    const SHADOWED: &[&str] = &[
        "--h", "--t", "--te", "--re", "--no-", "--no-p", "--run-", "--run_",
    ];

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        let args = std::iter::once("launch").chain(args.iter().copied());
        parse_from(args.map(OsString::from).collect())
    }

    #[test]
    fn every_prefix_torchrun_takes_names_the_same_flag_here() {
        let command = built_command();
        let mut checked = 0;
        for full in TORCHRUN {
            let Some(ours) = long_flag(&command, full) else {
                continue; // a flag launch does not have is refused whole or abbreviated
            };
            for end in 3..full.len() {
                let prefix = &full[..end];
                // argparse (Python 3.11): a prefix of exactly one of its option strings.
                if TORCHRUN.iter().filter(|f| f.starts_with(prefix)).count() != 1 {
                    continue;
                }
                let here = long_flag(&command, prefix).map(Arg::get_id);
                if SHADOWED.contains(&prefix) {
                    assert_eq!(here, None, "{prefix} should be ambiguous here");
                } else {
                    assert_eq!(here, Some(ours.get_id()), "{prefix} (torchrun: {full})");
                }
                checked += 1;
            }
        }
        assert!(checked > 300, "only {checked} prefixes checked");
    }

    #[test]
    fn abbreviated_flags_parse_and_the_script_starts_after_their_values() {
        let cli = parse(&[
            "--nproc-per",
            "2",
            "--max-r",
            "3",
            "train.py",
            "--nnode",
            "9",
        ])
        .unwrap();
        assert_eq!(cli.num_processes, Some(NumProcesses::Count(2)));
        assert_eq!(cli.max_restarts, Some(3));
        assert_eq!(cli.script, ["train.py", "--nnode", "9"]);
        let cli = parse(&["--nproc_per=2", "--stand", "c.toml"]).unwrap();
        assert_eq!(cli.num_processes, Some(NumProcesses::Count(2)));
        assert!(cli.standalone);
        // Two flags start with `--master`: refused, as torchrun refuses it, naming both.
        let error = parse(&["--master", "h", "train.py"])
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("ambiguous option: --master could match --master-addr, --master-port"),
            "{error}"
        );
        let error = parse(&["--max-restarts", "1", "--te", "c.toml"])
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("could match --tee, --term-timeout"),
            "{error}"
        );
        let error = parse(&["--tea", "c.toml"]).unwrap_err().to_string();
        assert!(!error.contains("ambiguous"), "{error}");
        let command = built_command();
        assert!(long_flag(&command, "--master").is_none());
        assert!(long_flag(&command, "--").is_none());
        assert!(long_flag(&command, "-n").is_none());
    }

    /// What clap's own parser makes of `word` with launch's flags' names alone (each a switch,
    /// so no value is needed): the id of the flag it sets, `help`, `version`, or `None`.
    fn clap_reads(names_only: &mut Command, word: &str) -> Option<String> {
        match names_only.try_get_matches_from_mut(["launch", word]) {
            Ok(m) => (m.ids())
                .find(|id| m.value_source(id.as_str()) == Some(ValueSource::CommandLine))
                .map(|id| id.to_string()),
            Err(e) if e.kind() == ErrorKind::DisplayHelp => Some("help".into()),
            Err(e) if e.kind() == ErrorKind::DisplayVersion => Some("version".into()),
            Err(_) => None,
        }
    }

    #[test]
    fn every_prefix_of_every_flag_resolves_as_clap_resolves_it() {
        let command = built_command();
        let mut names_only = Command::new("launch").version("0").infer_long_args(true);
        for a in command.get_arguments().filter(|a| a.get_long().is_some()) {
            if matches!(a.get_action(), ArgAction::Help | ArgAction::Version) {
                continue; // clap adds its own
            }
            // clap takes `&'static str` names (without its `string` feature): a test may leak.
            let leak = |name: &str| -> &'static str { Box::leak(name.into()) };
            let mut switch = Arg::new(a.get_id().clone()).action(ArgAction::SetTrue);
            switch = switch.long(leak(a.get_long().unwrap_or_default()));
            for alias in a.get_all_aliases().unwrap_or_default() {
                switch = switch.alias(leak(alias));
            }
            names_only = names_only.arg(switch);
        }
        let mut words = BTreeSet::new();
        for a in command.get_arguments() {
            for name in names(a) {
                words.extend((1..=name.len()).map(|end| format!("--{}", &name[..end])));
            }
        }
        assert!(words.len() > 1000, "{} words", words.len());
        for word in &words {
            let ours = long_flag(&command, word).map(|a| a.get_id().to_string());
            assert_eq!(ours, clap_reads(&mut names_only, word), "{word}");
        }
        // The value stays with the flag it names.
        let hostfile =
            flag(&command, "--hostf=hf").map(|f| (f.arg.get_id().to_string(), f.value_inline));
        assert_eq!(hostfile, Some(("hostfile".into(), true)));
        let short =
            |w: &str| flag(&command, w).map(|f| (f.arg.get_id().to_string(), f.value_inline));
        assert_eq!(short("-H"), Some(("hostfile".into(), false)));
        assert_eq!(short("-Hhf"), Some(("hostfile".into(), true)));
        assert_eq!(short("-H=hf"), Some(("hostfile".into(), true)));
        assert_eq!(short("-"), None);
    }
}
