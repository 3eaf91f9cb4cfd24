//! What every worker runs: the `worker` on a CONFIG (with the config's batch plan), or the
//! program after `--`, and the one-line errors for giving neither, both, or a program where the
//! config goes. It resolves no ports, GPUs or ranks: that is the rest of the plan's.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use common::job_shape::Elastic;
use common::train_plan::TrainPlan;

use super::PlanError;
use crate::cli::Cli;

/// The command of every worker, and the config's plan when it runs the worker.
/// An elastic job (`Some((shape, processes per node))`) gets the plan of its largest world that
/// keeps the global batch.
pub(super) fn command_and_config(
    cli: &Cli,
    world_size: u32,
    elastic: Option<(&Elastic, u32)>,
) -> Result<(Vec<OsString>, Option<TrainPlan>), PlanError> {
    if !cli.script.is_empty() || cli.module || cli.no_python {
        return Ok((script_command(cli)?, None));
    }
    match (&cli.config, cli.program.is_empty()) {
        (Some(_), false) => Err(PlanError::Usage(
            "give either CONFIG (runs the worker) or `-- PROGRAM ARGS...`, not both".into(),
        )),
        (None, true) => Err(PlanError::Usage(
            "nothing to run: give a CONFIG (e.g. configs/default.toml) or `-- PROGRAM ARGS...`"
                .into(),
        )),
        (None, false) => {
            if !cli.overrides.is_empty() {
                return Err(PlanError::Usage(
                    "--set overrides a CONFIG value, but no CONFIG was given (the program after `--` gets no config)".into(),
                ));
            }
            if cli.worker.is_some() {
                return Err(PlanError::Usage(
                    "--worker has no effect with `-- PROGRAM`; drop one of them".into(),
                ));
            }
            Ok((cli.program.clone(), None))
        }
        (Some(path), true) => {
            let train = match elastic {
                None => TrainPlan::load(path, &cli.overrides, u64::from(world_size))
                    .map_err(|e| not_a_config(path, e))?,
                Some((shape, nproc)) => {
                    let config = common::config::Config::load(path, &cli.overrides)
                        .map_err(|e| not_a_config(path, e.into()))?;
                    super::elastic::largest_plan(path, config, shape, nproc)?
                }
            };
            let worker = match &cli.worker {
                Some(worker) => worker.clone(),
                None => default_worker()?,
            };
            let mut command = vec![worker.into_os_string()];
            for set in &cli.overrides {
                command.push("--set".into());
                command.push(set.into());
            }
            command.push(path.clone().into_os_string());
            Ok((command, Some(train)))
        }
    }
}

/// The command of a script given torchrun's way: `python3 SCRIPT ARGS...`, `python3 -m MODULE
/// ARGS...` with -m, `SCRIPT ARGS...` with --no-python or for a program that is not a `.py` file
/// (`launch python train.py` runs `python train.py`). A `.py` file that is not there is refused
/// here rather than by every worker.
fn script_command(cli: &Cli) -> Result<Vec<OsString>, PlanError> {
    let usage = |why: &str| Err(PlanError::Usage(why.to_string()));
    let Some(script) = cli.script.first() else {
        return usage("-m and --no-python apply to a script given torchrun's way: launch [OPTIONS] [-m|--no-python] SCRIPT ARGS...");
    };
    if !cli.program.is_empty() {
        return usage("give either SCRIPT ARGS... or `-- PROGRAM ARGS...`, not both");
    }
    if cli.module && cli.no_python {
        return usage("-m runs a Python module with python3; --no-python runs the script itself: give one of them");
    }
    if !cli.overrides.is_empty() {
        return usage("--set overrides a CONFIG value; a script gets no config (give it its own arguments after its name)");
    }
    let python_file = Path::new(script).extension().is_some_and(|e| e == "py");
    let mut command: Vec<OsString> = Vec::new();
    if cli.module {
        command.extend(["python3".into(), "-m".into()]);
    } else if python_file && !cli.no_python {
        if !Path::new(script).is_file() {
            return Err(PlanError::Usage(format!(
                "{}: no such file (launch runs it as `python3 {}` on every worker)",
                Path::new(script).display(),
                Path::new(script).display()
            )));
        }
        command.push("python3".into());
    }
    command.extend(cli.script.iter().cloned());
    Ok(command)
}

/// A CONFIG that does not load: when it is not a `.toml` file, it is most likely a program given
/// the torchrun way (`launch --nproc-per-node 2 train.py`), so say where programs go.
fn not_a_config(path: &Path, error: common::train_plan::TrainPlanError) -> PlanError {
    use common::config::ConfigError;
    use common::train_plan::TrainPlanError;
    let toml = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("toml"));
    let unreadable = match &error {
        TrainPlanError::Config(ConfigError::Syntax { .. }) => true,
        TrainPlanError::Config(ConfigError::Read { source, .. }) => {
            source.kind() == std::io::ErrorKind::InvalidData // not text: a binary
        }
        _ => false,
    };
    if toml || !unreadable {
        return PlanError::Config(error);
    }
    let shown = path.display();
    let run = match path.extension().and_then(|e| e.to_str()) {
        Some("py") => format!("python {shown}"),
        _ => shown.to_string(),
    };
    PlanError::Usage(format!(
        "{shown} is not a TOML config ({error}); to run a program on every worker, put it after `--`: launch [OPTIONS] -- {run}"
    ))
}

/// `worker` next to the `launch` binary.
fn default_worker() -> Result<PathBuf, PlanError> {
    let exe = std::env::current_exe()
        .map_err(|e| PlanError::Usage(format!("cannot locate the launch binary: {e}")))?;
    let worker = exe
        .parent()
        .unwrap_or_else(|| Path::new("."))
        .join("worker");
    if worker.is_file() {
        Ok(worker)
    } else {
        Err(PlanError::Usage(format!(
            "worker binary not found at {} (build it with `cargo build --release`, or pass --worker PATH)",
            worker.display()
        )))
    }
}
