//! `accelerate launch`'s command line and config file, mapped onto `launch`'s own flags, so that
//! an accelerate user's line runs unchanged: `--num_processes` counts every process of the job
//! (accelerate's meaning) once `--num_machines` says there are several machines, the machine
//! flags become the node flags, `--mixed_precision` and the other settings reach the workers as
//! the `ACCELERATE_*` variables accelerate sets, and what has no meaning here is said in one line.
//!
//! The config file (`--config_file`, else accelerate's default one) is read when the command
//! line uses an accelerate flag; a flag wins over the file, as in accelerate. Owns the reading
//! and the mapping; must not resolve the job shape (the plan's) or start anything.

use std::path::{Path, PathBuf};

use common::job_shape::NumProcesses;

use crate::cli::{Cli, GpuIds};

mod deepspeed;
mod fsdp;
mod python_text;
use deepspeed::DeepSpeed;
use fsdp::Fsdp;

/// What accelerate's settings did to the command line: the workers' extra variables and the
/// lines to say.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Applied {
    /// `ACCELERATE_*` and the like, for every worker.
    pub env: Vec<(String, String)>,
    /// One line per setting that is not applied (or how it was).
    pub notices: Vec<String>,
}

/// accelerate's settings, from its flags and its config file.
#[derive(Debug, Default, Clone, PartialEq)]
struct Settings {
    num_processes: Option<u32>,
    num_machines: Option<u32>,
    machine_rank: Option<u32>,
    main_process_ip: Option<String>,
    main_process_port: Option<u16>,
    mixed_precision: Option<String>,
    gpu_ids: Option<String>,
    use_cpu: bool,
    debug: bool,
    dynamo_backend: Option<String>,
    deepspeed: DeepSpeed,
    fsdp: Fsdp,
    /// Settings of the file that `launch` does not apply (`megatron_lm_config`, ...).
    not_applied: Vec<String>,
}

/// Whether the command line is accelerate's (uses one of its own flags).
fn is_accelerate_line(cli: &Cli) -> bool {
    cli.config_file.is_some()
        || cli.num_machines.is_some()
        || cli.machine_rank.is_some()
        || cli.main_process_ip.is_some()
        || cli.main_process_port.is_some()
        || cli.mixed_precision.is_some()
        || cli.multi_gpu
        || cli.same_network
        || cli.cpu
        || cli.num_cpu_threads_per_process.is_some()
        || cli.dynamo_backend.is_some()
        || cli.deepspeed != crate::cli::DeepSpeedFlags::default()
        || cli.fsdp != crate::cli::FsdpFlags::default()
        || cli.accelerate_debug
}

/// accelerate's default config file: `$HF_HOME/accelerate/default_config.yaml` (HF_HOME
/// defaulting to `$XDG_CACHE_HOME/huggingface`, then `~/.cache/huggingface`).
fn default_config_file(env: &common::job_shape::Env) -> Option<PathBuf> {
    let hf_home = match (env.get("HF_HOME"), env.get("XDG_CACHE_HOME")) {
        (Some(home), _) => PathBuf::from(home),
        (None, Some(cache)) => Path::new(cache).join("huggingface"),
        (None, None) => Path::new(env.get("HOME")?).join(".cache/huggingface"),
    };
    Some(hf_home.join("accelerate/default_config.yaml"))
}

/// Maps an accelerate command line (and its config file) onto `cli`'s own flags; nothing for
/// any other command line.
pub fn apply(cli: &mut Cli, env: &common::job_shape::Env) -> Result<Applied, String> {
    if !is_accelerate_line(cli) {
        return Ok(Applied::default());
    }
    let mut applied = Applied::default();
    let file = match &cli.config_file {
        Some(path) => Some(read_config(path)?),
        None => match default_config_file(env).filter(|p| p.is_file()) {
            Some(path) => Some(read_config(&path)?),
            None => None,
        },
    };
    let settings = merge(cli, file.unwrap_or_default())?;
    applied.notices.extend(settings.not_applied.iter().cloned());
    applied.notices.extend(shape(cli, &settings)?);
    worker_settings(cli, &settings, &mut applied)?;
    Ok(applied)
}

/// The flags over the file's settings. As accelerate: one of `--cpu`, `--multi_gpu`,
/// `--use_deepspeed`, `--use_fsdp` at most; a line that names one sets aside the file's
/// `distributed_type`; on the CPU neither DeepSpeed nor FSDP is used.
fn merge(cli: &Cli, mut file: Settings) -> Result<Settings, String> {
    let named: Vec<&str> = [
        ("--cpu", cli.cpu),
        ("--multi_gpu", cli.multi_gpu),
        ("--use_deepspeed", cli.deepspeed.use_deepspeed),
        ("--use_fsdp", cli.fsdp.use_fsdp),
    ]
    .into_iter()
    .filter_map(|(flag, on)| on.then_some(flag))
    .collect();
    if named.len() > 1 {
        return Err(format!(
            "{}: accelerate takes only one of --cpu, --multi_gpu, --use_deepspeed, --use_fsdp",
            named.join(" and ")
        ));
    }
    if !named.is_empty() {
        (file.deepspeed.used, file.fsdp.used) = (false, false);
    }
    let flag_count = match cli.num_processes {
        Some(NumProcesses::Count(n)) => Some(n),
        _ => None,
    };
    let precision_from_file = cli.mixed_precision.is_none() && file.mixed_precision.is_some();
    let mut s = Settings {
        num_processes: flag_count.or(file.num_processes),
        num_machines: cli.num_machines.or(file.num_machines),
        machine_rank: cli.machine_rank.or(file.machine_rank),
        main_process_ip: cli.main_process_ip.clone().or(file.main_process_ip),
        main_process_port: cli.main_process_port.or(file.main_process_port),
        mixed_precision: cli.mixed_precision.clone().or(file.mixed_precision),
        gpu_ids: file.gpu_ids,
        use_cpu: cli.cpu || file.use_cpu,
        debug: cli.accelerate_debug || file.debug,
        dynamo_backend: cli.dynamo_backend.clone().or(file.dynamo_backend),
        deepspeed: DeepSpeed::merged(cli, file.deepspeed),
        fsdp: Fsdp::merged(cli, file.fsdp),
        not_applied: file.not_applied,
    };
    if s.use_cpu {
        (s.deepspeed.used, s.fsdp.used) = (false, false);
    }
    s.fsdp.refusal()?;
    // A precision from the file is one of the fields accelerate tells DeepSpeed about.
    if precision_from_file && s.deepspeed.used {
        s.deepspeed.file_keys.push("mixed_precision".into());
    }
    Ok(s)
}

/// The job shape: machines are nodes, and with several of them `num_processes` is the total;
/// the line that says so (the dry run's sources then name our flags).
fn shape(cli: &mut Cli, s: &Settings) -> Result<Option<String>, String> {
    let machines = s.num_machines.unwrap_or(1);
    if machines == 0 {
        return Err("--num_machines must be at least 1".into());
    }
    // A count the flag gave in another form (`--nproc-per-node auto`) wins over the file's.
    let flag_form = matches!(
        cli.num_processes,
        Some(NumProcesses::Auto | NumProcesses::Cpu)
    );
    if let (Some(total), false) = (s.num_processes, flag_form) {
        if total % machines != 0 || total < machines {
            return Err(format!(
                "--num_processes {total} over --num_machines {machines}: accelerate counts every process of the job, so it must be a multiple of the machines (each runs num_processes / num_machines)"
            ));
        }
        cli.num_processes = Some(NumProcesses::Count(total / machines));
    }
    let said = (machines > 1).then(|| {
        let per_node = s.num_processes.map_or(String::new(), |total| {
            format!(", --num_processes {total} = {} per node", total / machines)
        });
        format!(
            "accelerate: --num_machines {machines} = --nnodes {machines}, --machine_rank {} = --node-rank{per_node}",
            s.machine_rank.unwrap_or(0)
        )
    });
    if machines > 1 && cli.nnodes.is_none() {
        cli.nnodes = Some(common::job_shape::NodeRange {
            min: machines,
            max: machines,
        });
        cli.node_rank = cli.node_rank.or(Some(s.machine_rank.unwrap_or(0)));
    }
    cli.master_addr = cli.master_addr.clone().or(s.main_process_ip.clone());
    // accelerate's 0 is "a free port", as ours.
    cli.master_port = cli.master_port.or(s.main_process_port);
    if cli.gpu_ids.is_none() {
        if let Some(ids) = s.gpu_ids.as_deref().filter(|i| !i.is_empty()) {
            cli.gpu_ids = Some(
                crate::cli::parse_gpu_ids(ids)
                    .map_err(|e| format!("accelerate config gpu_ids {ids:?}: {e}"))?,
            );
        }
    }
    if let Some(GpuIds::List(ids)) = &cli.gpu_ids {
        if cli.num_processes.is_none() {
            cli.num_processes = Some(NumProcesses::Count(ids.len() as u32));
        }
    }
    Ok(said)
}

/// What reaches the workers: accelerate's variables, our worker's bf16 and DeepSpeed
/// settings, and the lines for what does not apply.
fn worker_settings(cli: &mut Cli, s: &Settings, applied: &mut Applied) -> Result<(), String> {
    let precision = s.mixed_precision.clone().unwrap_or_else(|| "no".into());
    let ours = cli.config.is_some() && cli.script.is_empty();
    if ours {
        // Before the user's own --set, which win.
        let mut sets = s.deepspeed.worker_sets(&mut applied.notices)?;
        sets.extend(s.fsdp.worker_sets(&mut applied.notices)?);
        cli.overrides.splice(0..0, sets);
        match precision.as_str() {
            // Before the user's own --set, which wins.
            "bf16" => cli.overrides.insert(0, "train.bf16=true".into()),
            "no" => {}
            other => applied.notices.push(format!(
                "--mixed_precision {other}: our worker trains in f32 or bf16 (train.bf16); not applied"
            )),
        }
    }
    let mut env = vec![("ACCELERATE_MIXED_PRECISION".to_string(), precision)];
    let dynamo = s.dynamo_backend.clone().unwrap_or_else(|| "no".into());
    env.push((
        "ACCELERATE_DYNAMO_BACKEND".into(),
        dynamo.to_ascii_uppercase(),
    ));
    if s.use_cpu {
        env.push(("ACCELERATE_USE_CPU".into(), "True".into()));
        if ours {
            applied
                .notices
                .push("--cpu: our worker uses the GPUs it sees; hide them with CUDA_VISIBLE_DEVICES= to train on the CPU".into());
        }
    }
    if s.debug {
        env.push(("ACCELERATE_DEBUG_MODE".into(), "true".into()));
    }
    if let Some(threads) = cli.num_cpu_threads_per_process {
        env.push(("OMP_NUM_THREADS".into(), threads.to_string()));
    }
    env.extend(s.deepspeed.env());
    env.extend(s.fsdp.env());
    applied.env = env;
    Ok(())
}

/// accelerate's config file (YAML, or JSON for a `.json` file), as accelerate reads it.
fn read_config(path: &Path) -> Result<Settings, String> {
    let shown = path.display();
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("accelerate config {shown}: {e}"))?;
    let docs = yaml_rust2::YamlLoader::load_from_str(&text)
        .map_err(|e| format!("accelerate config {shown}: not YAML or JSON: {e}"))?;
    let Some(yaml_rust2::Yaml::Hash(map)) = docs.into_iter().next().map(python_text::as_pyyaml)
    else {
        return Err(format!(
            "accelerate config {shown}: expected `key: value` settings (as `accelerate config` writes)"
        ));
    };
    let mut s = Settings::default();
    s.fsdp.file = Some(shown.to_string());
    for (key, value) in &map {
        let Some(key) = key.as_str() else { continue };
        apply_key(&mut s, key, value)
            .map_err(|e| format!("accelerate config {shown}: {key}: {e}"))?;
    }
    Ok(s)
}

/// A section of the config file (`deepspeed_config`, `fsdp_config`): its settings with text
/// keys, none for an empty one.
fn section_entries(section: &yaml_rust2::Yaml) -> Result<Vec<(&str, &yaml_rust2::Yaml)>, String> {
    match section {
        yaml_rust2::Yaml::Hash(map) => Ok(map
            .iter()
            .filter_map(|(k, v)| k.as_str().map(|k| (k, v)))
            .collect()),
        yaml_rust2::Yaml::Null => Ok(Vec::new()),
        _ => Err("expected `key: value` settings".into()),
    }
}

/// One setting of the config file.
fn apply_key(s: &mut Settings, key: &str, value: &yaml_rust2::Yaml) -> Result<(), String> {
    use yaml_rust2::Yaml;
    let text = || -> Option<String> {
        match value {
            Yaml::String(v) | Yaml::Real(v) => Some(v.clone()),
            Yaml::Integer(v) => Some(v.to_string()),
            Yaml::Boolean(v) => Some(v.to_string()),
            _ => None,
        }
    };
    let number = |what: &str| -> Result<Option<u64>, String> {
        match value {
            Yaml::Null => Ok(None),
            Yaml::Integer(v) if *v >= 0 => Ok(Some(*v as u64)),
            _ => Err(format!("expected {what}, got {value:?}")),
        }
    };
    let flag = || matches!(value, Yaml::Boolean(true));
    let small = |v: Option<u64>, max: u64| -> Result<Option<u64>, String> {
        match v {
            Some(n) if n > max => Err(format!("{n} is more than {max}")),
            other => Ok(other),
        }
    };
    match key {
        "num_processes" => {
            s.num_processes = small(number("a number")?, u64::from(u32::MAX))?.map(|n| n as u32)
        }
        "num_machines" => s.num_machines = small(number("a number")?, 65_536)?.map(|n| n as u32),
        "machine_rank" => s.machine_rank = small(number("a number")?, 65_535)?.map(|n| n as u32),
        "main_process_port" => {
            s.main_process_port = small(number("a port")?, 65_535)?.map(|n| n as u16)
        }
        "main_process_ip" => s.main_process_ip = text().filter(|t| !t.is_empty()),
        "mixed_precision" => s.mixed_precision = text(),
        "gpu_ids" => s.gpu_ids = text(),
        "use_cpu" => s.use_cpu = flag(),
        "debug" => s.debug = flag(),
        "deepspeed_config" => s.deepspeed.read_section(value)?,
        "fsdp_config" => s.fsdp.read_section(value)?,
        "dynamo_config" => {
            s.dynamo_backend = value["dynamo_backend"].as_str().map(str::to_string);
        }
        "compute_environment" => {
            let env = text().unwrap_or_default();
            if env != "LOCAL_MACHINE" {
                return Err(format!("{env}: launch runs on the machines it is started on (LOCAL_MACHINE); SageMaker is accelerate's own"));
            }
        }
        "distributed_type" => {
            let kind = text().unwrap_or_default();
            s.deepspeed.used |= kind == "DEEPSPEED";
            s.fsdp.used |= kind == "FSDP";
            if !matches!(
                kind.as_str(),
                "NO" | "MULTI_GPU" | "MULTI_CPU" | "DEEPSPEED" | "FSDP" | ""
            ) {
                s.not_applied.push(format!(
                    "accelerate config distributed_type {kind}: not applied; launch starts data-parallel workers (the script's own accelerate reads the rest of the file)"
                ));
            }
        }
        // Accepted as accelerate takes them, with nothing to do here.
        "same_network"
        | "rdzv_backend"
        | "main_training_function"
        | "downcast_bf16"
        | "enable_cpu_affinity"
        | "tpu_env"
        | "tpu_use_cluster"
        | "tpu_use_sudo" => {}
        other if matches!(value, Yaml::Null) || value.as_vec().is_some_and(Vec::is_empty) => {
            let _ = other;
        }
        other => s
            .not_applied
            .push(format!("accelerate config {other}: not applied by launch")),
    }
    Ok(())
}

#[cfg(test)]
mod tests;
