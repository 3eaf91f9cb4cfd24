//! accelerate's FSDP settings (`--use_fsdp`, `--fsdp_*` and the config file's
//! `distributed_type: FSDP` and `fsdp_config`): for a script, the `FSDP_*` variables
//! `accelerate launch` 1.15 sets for it (its `Accelerator` builds its FSDP plugin from them);
//! for our worker, the ZeRO stage that shards as the strategy says (`dist.zero`) and the
//! optimizer's half of parameter offload (`dist.offload`), and one line for each setting
//! without a counterpart.
//!
//! Owns the settings and their mapping; must not parse the command line (`cli`'s) or read the
//! file (the parent's reader hands its `fsdp_config` section here).

use std::collections::BTreeMap;

use yaml_rust2::Yaml;

use crate::cli::Cli;

/// accelerate's variables: (argument, variable, value when not given: `None` sets it only when
/// given), in its order.
const VARIABLES: [(&str, &str, Option<&str>); 16] = [
    ("fsdp_version", "FSDP_VERSION", Some("1")),
    (
        "fsdp_sharding_strategy",
        "FSDP_SHARDING_STRATEGY",
        Some("FULL_SHARD"),
    ),
    (
        "fsdp_reshard_after_forward",
        "FSDP_RESHARD_AFTER_FORWARD",
        Some("true"),
    ),
    ("fsdp_offload_params", "FSDP_OFFLOAD_PARAMS", Some("false")),
    (
        "fsdp_min_num_params",
        "FSDP_MIN_NUM_PARAMS",
        Some("100000000"),
    ),
    ("fsdp_auto_wrap_policy", "FSDP_AUTO_WRAP_POLICY", None),
    (
        "fsdp_transformer_layer_cls_to_wrap",
        "FSDP_TRANSFORMER_CLS_TO_WRAP",
        None,
    ),
    ("fsdp_backward_prefetch", "FSDP_BACKWARD_PREFETCH", None),
    ("fsdp_state_dict_type", "FSDP_STATE_DICT_TYPE", None),
    (
        "fsdp_forward_prefetch",
        "FSDP_FORWARD_PREFETCH",
        Some("false"),
    ),
    ("fsdp_use_orig_params", "FSDP_USE_ORIG_PARAMS", Some("true")),
    (
        "fsdp_cpu_ram_efficient_loading",
        "FSDP_CPU_RAM_EFFICIENT_LOADING",
        Some("true"),
    ),
    (
        "fsdp_sync_module_states",
        "FSDP_SYNC_MODULE_STATES",
        Some("true"),
    ),
    (
        "fsdp_activation_checkpointing",
        "FSDP_ACTIVATION_CHECKPOINTING",
        Some("false"),
    ),
    (
        "fsdp_activation_checkpointing_offload",
        "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD",
        Some("false"),
    ),
    ("fsdp_ignored_modules", "FSDP_IGNORED_MODULES", None),
];

/// The arguments accelerate passes lower-cased (`str(x).lower()`: its booleans).
const LOWERED: [&str; 8] = [
    "fsdp_reshard_after_forward",
    "fsdp_offload_params",
    "fsdp_forward_prefetch",
    "fsdp_use_orig_params",
    "fsdp_cpu_ram_efficient_loading",
    "fsdp_sync_module_states",
    "fsdp_activation_checkpointing",
    "fsdp_activation_checkpointing_offload",
];

/// The arguments our worker applies (the strategy or the resharding, by the version).
const MAPPED: [&str; 2] = ["fsdp_version", "fsdp_offload_params"];

/// The FSDP settings of a line and its config file.
#[derive(Debug, Default, Clone, PartialEq)]
pub(super) struct Fsdp {
    /// `--use_fsdp`, or the file's `distributed_type: FSDP`.
    pub used: bool,
    /// Given values by accelerate's argument name.
    values: BTreeMap<String, String>,
}

impl Fsdp {
    /// The command line's settings over `file`'s.
    pub(super) fn merged(cli: &Cli, mut file: Fsdp) -> Fsdp {
        for (key, value) in cli.fsdp.given() {
            file.values.insert(key.to_string(), value);
        }
        file.used |= cli.fsdp.use_fsdp;
        file
    }

    /// The file's `fsdp_config` section (keys with or without their `fsdp_`, as accelerate
    /// reads them); an error names the key.
    pub(super) fn read_section(&mut self, section: &Yaml) -> Result<(), String> {
        for (key, value) in super::section_entries(section)? {
            let name = match key.starts_with("fsdp") {
                true => key.to_string(),
                false => format!("fsdp_{key}"),
            };
            let text = match value {
                Yaml::Null => continue,
                Yaml::String(v) | Yaml::Real(v) => v.clone(),
                Yaml::Integer(v) => v.to_string(),
                Yaml::Boolean(v) => v.to_string(),
                Yaml::Array(items) => (items.iter())
                    .map(|i| i.as_str().map(str::to_string))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| format!("fsdp_config.{key}: expected names"))?
                    .join(","),
                _ => {
                    return Err(format!(
                        "fsdp_config.{key}: expected a value, got {value:?}"
                    ))
                }
            };
            self.values.insert(name, text);
        }
        Ok(())
    }

    fn value(&self, key: &str) -> Option<&str> {
        self.values.get(key).map(String::as_str)
    }

    /// The variables `accelerate launch` sets for an FSDP script (its `prepare_multi_gpu_env`);
    /// none when FSDP is not used.
    pub(super) fn env(&self) -> Vec<(String, String)> {
        if !self.used {
            return Vec::new();
        }
        let mut env = vec![("ACCELERATE_USE_FSDP".to_string(), "true".to_string())];
        for (key, variable, default) in VARIABLES {
            let Some(value) = self.value(key).or(default) else {
                continue;
            };
            let value = match LOWERED.contains(&key) {
                true => value.to_ascii_lowercase(),
                false => value.to_string(),
            };
            env.push((variable.to_string(), value));
        }
        env
    }

    /// Our worker's config keys for these settings (before the user's own `--set`, which win),
    /// with a line saying what was applied and one for each setting that was not.
    pub(super) fn worker_sets(&self, notices: &mut Vec<String>) -> Result<Vec<String>, String> {
        if !self.used {
            return Ok(Vec::new());
        }
        let (mut sets, mut said) = (Vec::new(), Vec::new());
        let (stage, strategy_key) = self.stage()?;
        match stage {
            Ok((flag, stage)) => {
                said.push(format!("{flag} = --set dist.zero={stage}"));
                sets.push(format!("dist.zero={stage}"));
            }
            Err(not_applied) => notices.push(not_applied),
        }
        if self.flag("fsdp_offload_params")? {
            said.push("--fsdp_offload_params true = --set dist.offload=\"optimizer\" (the optimizer's half: the parameters stay on the device)".into());
            sets.push("dist.offload=\"optimizer\"".into());
        }
        for (key, value) in &self.values {
            if MAPPED.contains(&key.as_str()) || key == strategy_key {
                continue;
            }
            let why = match key.as_str() {
                "fsdp_sharding_strategy" => "FSDP 2 shards as fsdp_reshard_after_forward says",
                "fsdp_reshard_after_forward" => {
                    "FSDP 1 shards as fsdp_sharding_strategy says (FULL_SHARD when not given)"
                }
                "fsdp_activation_checkpointing" => {
                    "set model.activation_checkpointing (GPT-2's blocks, in dynamic text mode)"
                }
                "fsdp_state_dict_type" => "our checkpoints hold the whole model at any stage",
                _ => "our worker's units are GPT-2's blocks",
            };
            notices.push(format!("--{key} {value}: not applied to our worker; {why}"));
        }
        if !said.is_empty() {
            notices.push(format!("accelerate FSDP: {}", said.join(", ")));
        }
        Ok(sets)
    }

    /// The stage that shards as FSDP's strategy says, with the flag that says it (FSDP 2:
    /// resharding after forward; FSDP 1: the strategy, `FULL_SHARD` by default), or the line
    /// to say where none does (hybrid sharding); and the setting it read.
    #[allow(clippy::type_complexity)]
    fn stage(&self) -> Result<(Result<(String, u8), String>, &'static str), String> {
        if self.value("fsdp_version") == Some("2") {
            let key = "fsdp_reshard_after_forward";
            let reshard = self.flag_or(key, true)?;
            let flag = format!("--fsdp_version 2 --fsdp_reshard_after_forward {reshard}");
            return Ok((Ok((flag, if reshard { 3 } else { 2 })), key));
        }
        let key = "fsdp_sharding_strategy";
        let strategy = self.value(key).unwrap_or("FULL_SHARD");
        let flag = format!("--fsdp_sharding_strategy {strategy}");
        let stage = match strategy.to_ascii_uppercase().as_str() {
            "FULL_SHARD" | "1" => Ok((flag, 3)),
            "SHARD_GRAD_OP" | "2" => Ok((flag, 2)),
            "NO_SHARD" | "3" => Ok((flag, 0)),
            "HYBRID_SHARD" | "HYBRID_SHARD_ZERO2" | "4" | "5" => Err(format!(
                "{flag}: not applied; our worker's stages shard across every rank (set dist.zero)"
            )),
            _ => return Err(format!(
                "{flag}: expected FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD or HYBRID_SHARD_ZERO2"
            )),
        };
        Ok((stage, key))
    }

    fn flag(&self, key: &str) -> Result<bool, String> {
        self.flag_or(key, false)
    }

    fn flag_or(&self, key: &str, default: bool) -> Result<bool, String> {
        // As accelerate's `str_to_bool`.
        match self.value(key).map(str::to_ascii_lowercase).as_deref() {
            None => Ok(default),
            Some("y" | "yes" | "t" | "true" | "on" | "1") => Ok(true),
            Some("n" | "no" | "f" | "false" | "off" | "0") => Ok(false),
            Some(other) => Err(format!("--{key} {other}: expected true or false")),
        }
    }
}
