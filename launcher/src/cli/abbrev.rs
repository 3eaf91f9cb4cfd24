//! torchrun's abbreviated flags: its argparse takes any unambiguous prefix of a long flag
//! (`--nproc-per 2`, `--max-r 3`), and so does `launch` (clap's `infer_long_args`). This module
//! owns the one reading of a word as a flag for every look at the words before clap's parse
//! (where the script starts; which flags a hostfile keeps from the other hosts), so that they and
//! clap agree on what a word names. It must not parse values.

use clap::{Arg, Command};

/// The argument that `word` (`--NAME` or `--NAME=VALUE`) names: the one whose long name or
/// alias is NAME, else the only one with a long name or alias that starts with NAME, as clap's
/// `infer_long_args` resolves it. `None` for any other word, an ambiguous prefix included.
pub fn long_flag<'a>(command: &'a Command, word: &str) -> Option<&'a Arg> {
    let name = word.strip_prefix("--")?;
    let name = name.split_once('=').map_or(name, |(name, _)| name);
    if name.is_empty() {
        return None;
    }
    let names =
        |a: &'a Arg| (a.get_long().into_iter()).chain(a.get_all_aliases().unwrap_or_default());
    if let Some(exact) = command
        .get_arguments()
        .find(|a| names(a).any(|n| n == name))
    {
        return Some(exact);
    }
    let mut found = (command.get_arguments()).filter(|a| names(a).any(|n| n.starts_with(name)));
    match (found.next(), found.next()) {
        (Some(only), None) => Some(only),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{parse_from, Cli, NumProcesses};
    use clap::CommandFactory;
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
    /// refused with clap's error, as an ambiguous prefix is; one more letter resolves each.
    const SHADOWED: &[&str] = &["--t", "--te", "--re", "--no-", "--no-p", "--run-", "--run_"];

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        let args = std::iter::once("launch").chain(args.iter().copied());
        parse_from(args.map(OsString::from).collect())
    }

    #[test]
    fn every_prefix_torchrun_takes_names_the_same_flag_here() {
        let command = Cli::command();
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
        // Two flags start with `--master`: refused, as torchrun refuses it.
        assert!(parse(&["--master", "h", "train.py"]).is_err());
        let command = Cli::command();
        assert!(long_flag(&command, "--master").is_none());
        assert!(long_flag(&command, "--").is_none());
        assert!(long_flag(&command, "-n").is_none());
    }
}
