//! accelerate's FSDP settings (`--use_fsdp`, `--fsdp_*` and the config file's
//! `distributed_type: FSDP` and `fsdp_config`): for a script, the `FSDP_*` variables
//! `accelerate launch` 1.15 sets for it (its `Accelerator` builds its FSDP plugin from them);
//! for our worker, the ZeRO stage that shards as the strategy says (`dist.zero`) and the
//! optimizer's half of parameter offload (`dist.offload`), and one line for each setting
//! without a counterpart.
//!
//! Owns the settings and their mapping; must not parse the command line (`cli`'s) or read the
//! file (the parent's reader hands its `fsdp_config` section here).

use std::collections::{BTreeMap, BTreeSet};

use yaml_rust2::Yaml;

use super::python_text::python_str;
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
    /// The values that came from the file, with their key as written there (with or without
    /// its `fsdp_`): a line names those as the file's, not as flags.
    from_file: BTreeMap<String, String>,
    /// The values Python reads as false (the file's `false`, `0` or `null`, an empty text):
    /// accelerate's own check tests their truth, not their text.
    falsy: BTreeSet<String>,
    /// The config file read, for the errors about its values.
    pub file: Option<String>,
}

impl Fsdp {
    /// The command line's settings over `file`'s.
    pub(super) fn merged(cli: &Cli, mut file: Fsdp) -> Fsdp {
        for (key, value) in cli.fsdp.given() {
            file.from_file.remove(key);
            match value.is_empty() {
                true => file.falsy.insert(key.to_string()),
                false => file.falsy.remove(key),
            };
            file.values.insert(key.to_string(), value);
        }
        file.used |= cli.fsdp.use_fsdp;
        file
    }

    /// The file's `fsdp_config` section (keys with or without their `fsdp_`, as accelerate
    /// reads them, the last of a key winning); an error names the key. The values are checked
    /// when FSDP is used, as accelerate checks them (an FSDP 1 file's
    /// `fsdp_reshard_after_forward` holds a strategy, not a boolean).
    pub(super) fn read_section(&mut self, section: &Yaml) -> Result<(), String> {
        for (key, value) in super::section_entries(section)? {
            let name = match key.starts_with("fsdp") {
                true => key.to_string(),
                false => format!("fsdp_{key}"),
            };
            let text = match value {
                // accelerate sets `None`: false, written `none` where it has a default, not
                // written where it sets the variable only when given.
                Yaml::Null => match VARIABLES.iter().any(|(k, _, d)| *k == name && d.is_some()) {
                    true => "None".to_string(),
                    false => {
                        self.values.remove(&name);
                        self.from_file.remove(&name);
                        self.falsy.remove(&name);
                        continue;
                    }
                },
                // Python's `str` of it (`True`; the variables of booleans are lower-cased).
                Yaml::String(_) | Yaml::Real(_) | Yaml::Integer(_) | Yaml::Boolean(_) => {
                    python_str(value)
                }
                // accelerate would pass Python's text of the list (`['GPT2Block']`), which its
                // own plugin cannot split; the names joined as its flag takes them can.
                Yaml::Array(items) => (items.iter())
                    .map(|i| i.as_str().map(str::to_string))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| format!("{key}: expected names"))?
                    .join(","),
                _ => return Err(format!("{key}: expected a value, got {value:?}")),
            };
            let falsy = match value {
                Yaml::Null => true,
                Yaml::Boolean(v) => !v,
                Yaml::Integer(v) => *v == 0,
                Yaml::Real(v) => v.parse::<f64>().is_ok_and(|x| x == 0.0),
                _ => text.is_empty(),
            };
            match falsy {
                true => self.falsy.insert(name.clone()),
                false => self.falsy.remove(&name),
            };
            self.from_file.insert(name.clone(), key.to_string());
            self.values.insert(name, text);
        }
        Ok(())
    }

    /// accelerate's own refusal (`launch`'s check, before any process starts): loading with
    /// little CPU memory needs the module states synchronised. Like accelerate, it tests the
    /// values' truth: the file's `false`, not a flag's text `false`.
    pub(super) fn refusal(&self) -> Result<(), String> {
        let (loading, sync) = ("fsdp_cpu_ram_efficient_loading", "fsdp_sync_module_states");
        // Both are `true` unless given.
        let loading_on = !self.falsy.contains(loading);
        if !(self.used && loading_on && self.falsy.contains(sync)) {
            return Ok(());
        }
        let loading_said = match self.value(loading) {
            Some(v) => format!("{} {}", self.named(loading), shown(v)),
            None => format!("--{loading} true (its default)"),
        };
        Err(format!(
            "{}{} {} with {loading_said}: accelerate refuses this (loading with little CPU memory needs the module states synchronised); set it to true",
            self.source(sync),
            self.named(sync),
            shown(self.value(sync).unwrap_or_default()),
        ))
    }

    /// A setting as the user gave it: accelerate's flag, or the file's key.
    fn named(&self, key: &str) -> String {
        match self.from_file.get(key) {
            Some(written) => format!("fsdp_config.{written}"),
            None => format!("--{key}"),
        }
    }

    /// Where a value came from, for an error: the file's path, or nothing for a flag.
    fn source(&self, key: &str) -> String {
        match (self.from_file.contains_key(key), &self.file) {
            (true, Some(file)) => format!("accelerate config {file}: "),
            _ => String::new(),
        }
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
            let named = self.named(key);
            let value = match LOWERED.contains(&key.as_str()) {
                true => value.to_ascii_lowercase(),
                false => value.clone(),
            };
            notices.push(format!("{named} {value}: not applied to our worker; {why}"));
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
        let version = self.value("fsdp_version").unwrap_or("1");
        if !matches!(version, "1" | "2") {
            let key = "fsdp_version";
            return Err(format!(
                "{}{} {}: expected 1 or 2",
                self.source(key),
                self.named(key),
                shown(version)
            ));
        }
        if version == "2" {
            let key = "fsdp_reshard_after_forward";
            let reshard = self.flag_or(key, true)?;
            let flag = format!(
                "{} 2 {} {reshard}",
                self.named("fsdp_version"),
                self.named(key)
            );
            return Ok((Ok((flag, if reshard { 3 } else { 2 })), key));
        }
        let key = "fsdp_sharding_strategy";
        let strategy = self.value(key).unwrap_or("FULL_SHARD");
        let flag = format!("{} {}", self.named(key), shown(strategy));
        let stage = match strategy_stage(strategy) {
            Some(Some(stage)) => Ok((flag, stage)),
            Some(None) => Err(format!(
                "{flag}: not applied; our worker's stages shard across every rank (set dist.zero)"
            )),
            None => return Err(format!(
                "{}{flag}: expected FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD or HYBRID_SHARD_ZERO2",
                self.source(key)
            )),
        };
        Ok((stage, key))
    }

    fn flag(&self, key: &str) -> Result<bool, String> {
        self.flag_or(key, false)
    }

    fn flag_or(&self, key: &str, default: bool) -> Result<bool, String> {
        match self.value(key) {
            None => Ok(default),
            Some(text) => truth(text).ok_or_else(|| {
                format!(
                    "{}{} {}: expected true or false",
                    self.source(key),
                    self.named(key),
                    shown(text)
                )
            }),
        }
    }
}

/// A value in a line: an empty one quoted.
fn shown(value: &str) -> &str {
    match value.is_empty() {
        true => "\"\"",
        false => value,
    }
}

/// A boolean's text as accelerate's `str_to_bool` reads it.
fn truth(text: &str) -> Option<bool> {
    match text.to_ascii_lowercase().as_str() {
        "y" | "yes" | "t" | "true" | "on" | "1" => Some(true),
        "n" | "no" | "f" | "false" | "off" | "0" => Some(false),
        _ => None,
    }
}

/// FSDP 1's strategy as our worker's stage (`Some(None)`: hybrid sharding, which has none);
/// `None` for a strategy accelerate does not know.
fn strategy_stage(strategy: &str) -> Option<Option<u8>> {
    match strategy.to_ascii_uppercase().as_str() {
        "FULL_SHARD" | "1" => Some(Some(3)),
        "SHARD_GRAD_OP" | "2" => Some(Some(2)),
        "NO_SHARD" | "3" => Some(Some(0)),
        "HYBRID_SHARD" | "HYBRID_SHARD_ZERO2" | "4" | "5" => Some(None),
        _ => None,
    }
}
