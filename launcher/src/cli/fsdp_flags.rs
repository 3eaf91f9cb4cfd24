//! accelerate's FSDP flags on `launch`'s command line, as `accelerate launch` 1.15 takes them
//! (each a string, booleans as `true`/`false`). Owns their parsing; what they do is
//! `accelerate::fsdp`'s.

/// The FSDP flags of an accelerate line (with `--use_fsdp`, or the config file's
/// `distributed_type: FSDP`), by accelerate's argument name (`fsdp_sharding_strategy`, ...).
#[derive(Debug, Default, Clone, PartialEq, clap::Args)]
pub struct FsdpFlags {
    /// accelerate's `--use_fsdp`: for a script, `ACCELERATE_USE_FSDP=true` and the `FSDP_*`
    /// variables accelerate sets; for our worker, the ZeRO stage that shards as the strategy
    /// says (a line says what was applied).
    #[arg(long = "use_fsdp", alias = "use-fsdp")]
    pub use_fsdp: bool,

    /// accelerate's `--fsdp_version` (`1`, `2`): `FSDP_VERSION`; with `2`,
    /// `--fsdp_reshard_after_forward` says our worker's stage.
    #[arg(long = "fsdp_version", alias = "fsdp-version", value_name = "1|2", value_parser = ["1", "2"])]
    pub fsdp_version: Option<String>,
    /// accelerate's `--fsdp_sharding_strategy` (FSDP 1): `FULL_SHARD` is our worker's
    /// `dist.zero = 3`, `SHARD_GRAD_OP` 2, `NO_SHARD` 0.
    #[arg(
        long = "fsdp_sharding_strategy",
        alias = "fsdp-sharding-strategy",
        value_name = "STRATEGY"
    )]
    pub fsdp_sharding_strategy: Option<String>,
    /// accelerate's `--fsdp_reshard_after_forward` (FSDP 2): `true` is our worker's
    /// `dist.zero = 3`, `false` 2.
    #[arg(
        long = "fsdp_reshard_after_forward",
        alias = "fsdp-reshard-after-forward",
        value_name = "BOOL"
    )]
    pub fsdp_reshard_after_forward: Option<String>,
    /// accelerate's `--fsdp_offload_params`: `true` is our worker's `dist.offload =
    /// "optimizer"` (the optimizer's half: the parameters stay on the device).
    #[arg(
        long = "fsdp_offload_params",
        alias = "fsdp-offload-params",
        value_name = "BOOL"
    )]
    pub fsdp_offload_params: Option<String>,
    /// accelerate's `--fsdp_activation_checkpointing`, for a script (our worker: a line says
    /// to set `model.activation_checkpointing`).
    #[arg(
        long = "fsdp_activation_checkpointing",
        alias = "fsdp-activation-checkpointing",
        value_name = "BOOL"
    )]
    pub fsdp_activation_checkpointing: Option<String>,
    /// accelerate's `--fsdp_min_num_params`, for a script.
    #[arg(
        long = "fsdp_min_num_params",
        alias = "fsdp-min-num-params",
        value_name = "N"
    )]
    pub fsdp_min_num_params: Option<String>,
    /// accelerate's `--fsdp_auto_wrap_policy`, for a script (our worker's units are GPT-2's
    /// blocks).
    #[arg(
        long = "fsdp_auto_wrap_policy",
        alias = "fsdp-auto-wrap-policy",
        value_name = "POLICY"
    )]
    pub fsdp_auto_wrap_policy: Option<String>,
    /// accelerate's `--fsdp_transformer_layer_cls_to_wrap`, for a script.
    #[arg(
        long = "fsdp_transformer_layer_cls_to_wrap",
        alias = "fsdp-transformer-layer-cls-to-wrap",
        value_name = "NAMES"
    )]
    pub fsdp_transformer_layer_cls_to_wrap: Option<String>,
    /// accelerate's `--fsdp_backward_prefetch`, for a script.
    #[arg(
        long = "fsdp_backward_prefetch",
        alias = "fsdp-backward-prefetch",
        value_name = "MODE"
    )]
    pub fsdp_backward_prefetch: Option<String>,
    /// accelerate's `--fsdp_state_dict_type`, for a script (our checkpoints are whole at any
    /// stage).
    #[arg(
        long = "fsdp_state_dict_type",
        alias = "fsdp-state-dict-type",
        value_name = "TYPE"
    )]
    pub fsdp_state_dict_type: Option<String>,
    /// accelerate's `--fsdp_forward_prefetch`, for a script.
    #[arg(
        long = "fsdp_forward_prefetch",
        alias = "fsdp-forward-prefetch",
        value_name = "BOOL"
    )]
    pub fsdp_forward_prefetch: Option<String>,
    /// accelerate's `--fsdp_use_orig_params`, for a script.
    #[arg(
        long = "fsdp_use_orig_params",
        alias = "fsdp-use-orig-params",
        value_name = "BOOL"
    )]
    pub fsdp_use_orig_params: Option<String>,
    /// accelerate's `--fsdp_cpu_ram_efficient_loading`, for a script.
    #[arg(
        long = "fsdp_cpu_ram_efficient_loading",
        alias = "fsdp-cpu-ram-efficient-loading",
        value_name = "BOOL"
    )]
    pub fsdp_cpu_ram_efficient_loading: Option<String>,
    /// accelerate's `--fsdp_sync_module_states`, for a script.
    #[arg(
        long = "fsdp_sync_module_states",
        alias = "fsdp-sync-module-states",
        value_name = "BOOL"
    )]
    pub fsdp_sync_module_states: Option<String>,
    /// accelerate's `--fsdp_activation_checkpointing_offload`, for a script.
    #[arg(
        long = "fsdp_activation_checkpointing_offload",
        alias = "fsdp-activation-checkpointing-offload",
        value_name = "BOOL"
    )]
    pub fsdp_activation_checkpointing_offload: Option<String>,
}

impl FsdpFlags {
    /// The flags given, by accelerate's argument name.
    pub fn given(&self) -> Vec<(&'static str, String)> {
        [
            ("fsdp_version", &self.fsdp_version),
            ("fsdp_sharding_strategy", &self.fsdp_sharding_strategy),
            (
                "fsdp_reshard_after_forward",
                &self.fsdp_reshard_after_forward,
            ),
            ("fsdp_offload_params", &self.fsdp_offload_params),
            (
                "fsdp_activation_checkpointing",
                &self.fsdp_activation_checkpointing,
            ),
            ("fsdp_min_num_params", &self.fsdp_min_num_params),
            ("fsdp_auto_wrap_policy", &self.fsdp_auto_wrap_policy),
            (
                "fsdp_transformer_layer_cls_to_wrap",
                &self.fsdp_transformer_layer_cls_to_wrap,
            ),
            ("fsdp_backward_prefetch", &self.fsdp_backward_prefetch),
            ("fsdp_state_dict_type", &self.fsdp_state_dict_type),
            ("fsdp_forward_prefetch", &self.fsdp_forward_prefetch),
            ("fsdp_use_orig_params", &self.fsdp_use_orig_params),
            (
                "fsdp_cpu_ram_efficient_loading",
                &self.fsdp_cpu_ram_efficient_loading,
            ),
            ("fsdp_sync_module_states", &self.fsdp_sync_module_states),
            (
                "fsdp_activation_checkpointing_offload",
                &self.fsdp_activation_checkpointing_offload,
            ),
        ]
        .into_iter()
        .filter_map(|(k, v)| v.clone().map(|v| (k, v)))
        .collect()
    }
}
