//! accelerate's lines and config files through `apply`, as `launch` sees them.

use super::*;

fn cli(args: &[&str]) -> Cli {
    crate::cli::parse_from(
        std::iter::once("launch")
            .chain(args.iter().copied())
            .map(std::ffi::OsString::from)
            .collect(),
    )
    .unwrap()
}

const CONFIG: &str = "compute_environment: LOCAL_MACHINE\ndebug: false\ndistributed_type: MULTI_GPU\ndowncast_bf16: 'no'\ngpu_ids: all\nmachine_rank: 0\nmain_training_function: main\nmixed_precision: bf16\nnum_machines: 1\nnum_processes: 2\nrdzv_backend: static\nsame_network: true\ntpu_env: []\ntpu_use_cluster: false\ntpu_use_sudo: false\nuse_cpu: false\n";

#[test]
fn accelerates_multi_machine_line_becomes_the_node_flags() {
    let mut c = cli(&[
        "--num_machines",
        "2",
        "--machine_rank",
        "1",
        "--main_process_ip",
        "10.0.0.1",
        "--main_process_port",
        "29611",
        "--num_processes",
        "8",
        "--mixed_precision",
        "bf16",
        "--multi_gpu",
        "train.py",
    ]);
    let applied = apply(&mut c, &Default::default()).unwrap();
    assert_eq!(c.num_processes, Some(NumProcesses::Count(4)));
    assert_eq!(c.nnodes.map(|r| (r.min, r.max)), Some((2, 2)));
    assert_eq!(c.node_rank, Some(1));
    assert_eq!(c.master_addr.as_deref(), Some("10.0.0.1"));
    assert_eq!(c.master_port, Some(29611));
    assert!(
        applied
            .notices
            .iter()
            .any(|n| n.contains("--num_processes 8 = 4 per node")),
        "{:?}",
        applied.notices
    );
    assert!(applied
        .env
        .contains(&("ACCELERATE_MIXED_PRECISION".into(), "bf16".into())));
    let e = apply(
        &mut cli(&["--num_machines", "4", "--num_processes", "6", "x.py"]),
        &Default::default(),
    )
    .unwrap_err();
    assert!(e.contains("must be a multiple of the machines"), "{e}");
    // A torchrun line is left alone.
    let mut c = cli(&["--nproc-per-node", "2", "x.py"]);
    assert_eq!(
        apply(&mut c, &Default::default()).unwrap(),
        Applied::default()
    );
}

#[test]
fn the_config_file_fills_what_the_flags_leave_and_says_what_it_skips() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("default_config.yaml");
    let more = "deepspeed_config:\n  zero_stage: 2\n";
    std::fs::write(&path, format!("{CONFIG}{more}")).unwrap();
    let shown = path.display().to_string();
    let mut c = cli(&["--config_file", &shown, "configs/default.toml"]);
    let applied = apply(&mut c, &Default::default()).unwrap();
    assert_eq!(c.num_processes, Some(NumProcesses::Count(2)));
    assert_eq!(c.gpu_ids, Some(GpuIds::All));
    assert_eq!(c.overrides, vec!["train.bf16=true".to_string()]);
    // As accelerate: a DeepSpeed section without distributed_type DEEPSPEED is not used.
    assert_eq!(applied.notices, Vec::<String>::new());
    assert!(!applied.env.iter().any(|(k, _)| k.contains("DEEPSPEED")));
    // The flag wins; the default file is found through HF_HOME.
    let home = dir.path().join("hf");
    std::fs::create_dir_all(home.join("accelerate")).unwrap();
    std::fs::copy(&path, home.join("accelerate/default_config.yaml")).unwrap();
    let env = common::job_shape::Env::from([("HF_HOME".to_string(), home.display().to_string())]);
    let mut c = cli(&["--multi_gpu", "--num_processes", "3", "x.py"]);
    apply(&mut c, &env).unwrap();
    assert_eq!(c.num_processes, Some(NumProcesses::Count(3)));
    // Bad files: one line naming the file and the key.
    std::fs::write(&path, "num_processes: two\n").unwrap();
    let e = apply(
        &mut cli(&["--config_file", &shown, "x.py"]),
        &Default::default(),
    )
    .unwrap_err();
    assert!(e.contains(&shown) && e.contains("num_processes"), "{e}");
    std::fs::write(&path, "compute_environment: AMAZON_SAGEMAKER\n").unwrap();
    let e = apply(
        &mut cli(&["--config_file", &shown, "x.py"]),
        &Default::default(),
    )
    .unwrap_err();
    assert!(e.contains("SageMaker"), "{e}");
    let missing = dir.path().join("nope.yaml").display().to_string();
    let e = apply(
        &mut cli(&["--config_file", &missing, "x.py"]),
        &Default::default(),
    )
    .unwrap_err();
    assert!(e.contains("nope.yaml"), "{e}");
}

/// accelerate's DeepSpeed settings, from its flags over its config file: our worker gets
/// them as its config keys (before the user's own --set), with a line for what has no
/// counterpart; a script gets the variables `accelerate launch` sets.
#[test]
fn deepspeed_settings_become_our_keys_or_accelerates_variables() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ds.yaml");
    let section = "deepspeed_config:\n  zero_stage: 3\n  offload_optimizer_device: cpu\n  offload_param_device: cpu\n  gradient_accumulation_steps: 4\n  gradient_clipping: 1.0\n  zero3_init_flag: true\n";
    let file = CONFIG.replace("MULTI_GPU", "DEEPSPEED");
    std::fs::write(&path, format!("{file}{section}")).unwrap();
    let shown = path.display().to_string();
    let line = ["--config_file", &shown, "--zero_stage", "2"];
    let mut ours = cli(&[&line[..], &["configs/default.toml", "--set", "dist.zero=1"]].concat());
    let applied = apply(&mut ours, &Default::default()).unwrap();
    assert_eq!(
        ours.overrides,
        [
            "train.bf16=true",
            "dist.zero=2",
            "dist.offload=\"optimizer\"",
            "batch.grad_accum=4",
            "train.max_grad_norm=1.0",
            "dist.zero=1",
        ]
    );
    assert_eq!(
        applied.notices,
        [
            "--offload_param_device cpu: not applied; our worker does not offload parameters (dist.zero = 3 shards them)",
            "--zero3_init_flag true: not applied; our worker builds the model once and shards it as dist.zero says",
            "accelerate DeepSpeed: --zero_stage 2 = --set dist.zero=2, --offload_optimizer_device cpu = --set dist.offload=\"optimizer\", --gradient_accumulation_steps 4 = --set batch.grad_accum=4, --gradient_clipping 1.0 = --set train.max_grad_norm=1.0",
        ]
    );
    // A script: accelerate's variables, the flag over the file.
    let mut script = cli(&[
        &line[..],
        &["--offload_optimizer_device", "nvme", "train.py"],
    ]
    .concat());
    let applied = apply(&mut script, &Default::default()).unwrap();
    let env: std::collections::BTreeMap<_, _> = applied.env.into_iter().collect();
    let get = |k: &str| env.get(k).map(String::as_str);
    assert_eq!(get("ACCELERATE_USE_DEEPSPEED"), Some("true"));
    assert_eq!(get("ACCELERATE_DEEPSPEED_ZERO_STAGE"), Some("2"));
    assert_eq!(
        get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
        Some("nvme")
    );
    assert_eq!(
        get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"),
        Some("cpu")
    );
    assert_eq!(get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"), Some("4"));
    assert_eq!(get("ACCELERATE_GRADIENT_CLIPPING"), Some("1.0"));
    assert_eq!(get("ACCELERATE_DEEPSPEED_ZERO3_INIT"), Some("true"));
    assert_eq!(
        get("ACCELERATE_CONFIG_DS_FIELDS"),
        Some("zero_stage,offload_optimizer_device,offload_param_device,gradient_accumulation_steps,gradient_clipping,zero3_init_flag,mixed_precision")
    );
    assert_eq!(script.overrides, Vec::<String>::new());
    // Flags alone, and bad values: one line naming the flag or the key.
    let mut flags = cli(&[
        "--use_deepspeed",
        "--offload_optimizer_device",
        "cpu",
        "configs/default.toml",
    ]);
    apply(&mut flags, &Default::default()).unwrap();
    // No --zero_stage: DeepSpeed's default, 2.
    assert_eq!(
        flags.overrides,
        ["dist.zero=2", "dist.offload=\"optimizer\""]
    );
    // One of --cpu, --multi_gpu, --use_deepspeed, --use_fsdp, as accelerate; a line that
    // names one sets the file's DEEPSPEED aside; a precision from the file is a DeepSpeed
    // field when the line asks for DeepSpeed.
    let e = apply(
        &mut cli(&["--use_deepspeed", "--use_fsdp", "x.py"]),
        &Default::default(),
    )
    .unwrap_err();
    assert!(
        e.starts_with("--use_deepspeed and --use_fsdp: accelerate takes only one"),
        "{e}"
    );
    std::fs::write(&path, format!("{file}{section}")).unwrap();
    let applied = apply(
        &mut cli(&["--config_file", &shown, "--multi_gpu", "x.py"]),
        &Default::default(),
    )
    .unwrap();
    assert!(
        !applied.env.iter().any(|(k, _)| k.contains("DEEPSPEED")),
        "{:?}",
        applied.env
    );
    std::fs::write(&path, CONFIG).unwrap();
    let applied = apply(
        &mut cli(&["--config_file", &shown, "--use_deepspeed", "x.py"]),
        &Default::default(),
    )
    .unwrap();
    assert!(
        applied.env.contains(&(
            "ACCELERATE_CONFIG_DS_FIELDS".into(),
            "mixed_precision".into()
        )),
        "{:?}",
        applied.env
    );
    let parse = |args: &[&str]| {
        crate::cli::parse_from(
            std::iter::once("launch")
                .chain(args.iter().copied())
                .map(std::ffi::OsString::from)
                .collect(),
        )
    };
    assert!(parse(&["--zero_stage", "4", "x.py"]).is_err());
    assert!(parse(&["--offload_optimizer_device", "gpu", "x.py"]).is_err());
    std::fs::write(&path, format!("{file}deepspeed_config:\n  zero_stage: 5\n")).unwrap();
    let e = apply(
        &mut cli(&["--config_file", &shown, "x.py"]),
        &Default::default(),
    )
    .unwrap_err();
    assert!(
        e.contains(&shown)
            && e.contains("deepspeed_config: zero_stage: expected 0, 1, 2 or 3, got 5"),
        "{e}"
    );
    let e = apply(
        &mut cli(&[
            "--use_deepspeed",
            "--gradient_clipping",
            "-1",
            "configs/default.toml",
        ]),
        &Default::default(),
    )
    .unwrap_err();
    assert!(
        e.contains("--gradient_clipping -1.0: must be a number above 0"),
        "{e}"
    );
}

/// accelerate's FSDP settings: our worker gets the stage that shards as the strategy says
/// (FSDP 1's strategy, FSDP 2's resharding), the optimizer's half of parameter offload and
/// activation checkpointing, with lines for the rest; a script gets the variables
/// `accelerate launch` sets, its defaults included.
#[test]
fn fsdp_settings_become_our_stage_or_accelerates_variables() {
    let line = [
        "--use_fsdp",
        "--fsdp_sharding_strategy",
        "SHARD_GRAD_OP",
        "--fsdp_offload_params",
        "true",
        "--fsdp_backward_prefetch",
        "BACKWARD_PRE",
    ];
    let mut ours = cli(&[&line[..], &["configs/default.toml"]].concat());
    let applied = apply(&mut ours, &Default::default()).unwrap();
    assert_eq!(
        ours.overrides,
        ["dist.zero=2", "dist.offload=\"optimizer\""]
    );
    assert_eq!(
        applied.notices,
        [
            "--fsdp_backward_prefetch BACKWARD_PRE: not applied to our worker; our worker's units are GPT-2's blocks",
            "accelerate FSDP: --fsdp_sharding_strategy SHARD_GRAD_OP = --set dist.zero=2, --fsdp_offload_params true = --set dist.offload=\"optimizer\" (the optimizer's half: the parameters stay on the device)",
        ]
    );
    let mut script = cli(&[&line[..], &["train.py"]].concat());
    let applied = apply(&mut script, &Default::default()).unwrap();
    let env: Vec<(&str, &str)> = (applied.env.iter())
        .filter(|(k, _)| k.contains("FSDP"))
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    assert_eq!(
        env,
        [
            ("ACCELERATE_USE_FSDP", "true"),
            ("FSDP_VERSION", "1"),
            ("FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP"),
            ("FSDP_RESHARD_AFTER_FORWARD", "true"),
            ("FSDP_OFFLOAD_PARAMS", "true"),
            ("FSDP_MIN_NUM_PARAMS", "100000000"),
            ("FSDP_BACKWARD_PREFETCH", "BACKWARD_PRE"),
            ("FSDP_FORWARD_PREFETCH", "false"),
            ("FSDP_USE_ORIG_PARAMS", "true"),
            ("FSDP_CPU_RAM_EFFICIENT_LOADING", "true"),
            ("FSDP_SYNC_MODULE_STATES", "true"),
            ("FSDP_ACTIVATION_CHECKPOINTING", "false"),
            ("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "false"),
        ]
    );
    // The file: FSDP 2 without resharding is stage 2; keys without their fsdp_.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fsdp.yaml");
    let section = "fsdp_config:\n  fsdp_version: 2\n  reshard_after_forward: false\n  activation_checkpointing: true\n  transformer_layer_cls_to_wrap: [GPT2Block]\n";
    std::fs::write(
        &path,
        format!("{}{section}", CONFIG.replace("MULTI_GPU", "FSDP")),
    )
    .unwrap();
    let shown = path.display().to_string();
    let mut c = cli(&["--config_file", &shown, "configs/default.toml"]);
    let applied = apply(&mut c, &Default::default()).unwrap();
    assert_eq!(c.overrides, ["train.bf16=true", "dist.zero=2"]);
    assert_eq!(
        applied.notices,
        [
            "fsdp_config.activation_checkpointing true: not applied to our worker; set model.activation_checkpointing (GPT-2's blocks, in dynamic text mode)",
            "fsdp_config.transformer_layer_cls_to_wrap GPT2Block: not applied to our worker; our worker's units are GPT-2's blocks",
            "accelerate FSDP: fsdp_config.fsdp_version 2 fsdp_config.reshard_after_forward false = --set dist.zero=2",
        ]
    );
    // Hybrid sharding has no counterpart; an unknown strategy or a bad boolean is refused.
    let mut c = cli(&[
        "--use_fsdp",
        "--fsdp_sharding_strategy",
        "HYBRID_SHARD",
        "configs/default.toml",
    ]);
    let applied = apply(&mut c, &Default::default()).unwrap();
    assert!(c.overrides.is_empty(), "{:?}", c.overrides);
    assert_eq!(
        applied.notices,
        ["--fsdp_sharding_strategy HYBRID_SHARD: not applied; our worker's stages shard across every rank (set dist.zero)"]
    );
    for (flag, value, says) in [
        (
            "--fsdp_sharding_strategy",
            "HALF",
            "expected FULL_SHARD, SHARD_GRAD_OP",
        ),
        (
            "--fsdp_offload_params",
            "maybe",
            "--fsdp_offload_params maybe: expected true or false",
        ),
    ] {
        let e = apply(
            &mut cli(&["--use_fsdp", flag, value, "configs/default.toml"]),
            &Default::default(),
        )
        .unwrap_err();
        assert!(e.contains(says), "{e}");
    }
}

/// `ACCELERATE_GRADIENT_CLIPPING` as accelerate writes it: the file's value as PyYAML reads it,
/// a flag's as a Python float.
#[test]
fn gradient_clipping_is_written_as_accelerate_writes_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ds.yaml");
    let shown = path.display().to_string();
    let file = CONFIG.replace("MULTI_GPU", "DEEPSPEED");
    for (file_value, flag, env) in [
        ("1", None, "1"),
        ("1e-5", None, "1e-5"),
        ("1.0e-5", None, "1e-05"),
        ("1", Some("1e-5"), "1e-05"),
    ] {
        let ds = format!("{file}deepspeed_config:\n  gradient_clipping: {file_value}\n");
        std::fs::write(&path, ds).unwrap();
        let mut args = vec!["--config_file", &shown];
        args.extend(
            flag.map(|f| ["--gradient_clipping", f])
                .into_iter()
                .flatten(),
        );
        args.push("x.py");
        let applied = apply(&mut cli(&args), &Default::default()).unwrap();
        assert!(
            (applied.env.iter()).any(|(k, v)| k == "ACCELERATE_GRADIENT_CLIPPING" && v == env),
            "{file_value} {flag:?}: {:?}",
            applied.env
        );
    }
}

/// accelerate's FSDP values from the file, read as it reads them (YAML 1.1, the last of a key
/// winning, `null` false) and checked when FSDP is used.
#[test]
fn fsdp_file_values_are_read_and_refused_as_accelerate_does() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fsdp.yaml");
    let shown = path.display().to_string();
    // For our worker, a bad value in the file is refused naming the file and its key;
    // accelerate's own refusal of loading without synchronised states, on the file's `false`,
    // `no` or `null` (a flag's text `false` is true to accelerate's check, as there), for a
    // script too. The last of a key wins.
    let fsdp_file = |section: &str| {
        let config = CONFIG.replace("MULTI_GPU", "FSDP");
        std::fs::write(&path, format!("{config}fsdp_config:\n{section}")).unwrap();
    };
    let refused = "fsdp_config.sync_module_states False with --fsdp_cpu_ram_efficient_loading true (its default): accelerate refuses this";
    for (section, target, says) in [
        (
            "  offload_params: maybe\n",
            "configs/default.toml",
            "fsdp_config.offload_params maybe: expected true or false",
        ),
        (
            "  fsdp_sharding_strategy: HALF\n",
            "configs/default.toml",
            "fsdp_config.fsdp_sharding_strategy HALF: expected FULL_SHARD",
        ),
        ("  sync_module_states: false\n", "x.py", refused),
        ("  sync_module_states: no\n", "x.py", refused),
        (
            "  fsdp_sync_module_states: true\n  sync_module_states: null\n",
            "x.py",
            "fsdp_config.sync_module_states None with",
        ),
    ] {
        fsdp_file(section);
        let e = apply(
            &mut cli(&["--config_file", &shown, target]),
            &Default::default(),
        )
        .unwrap_err();
        assert!(e.contains(&shown) && e.contains(says), "{section}: {e}");
    }
    for accepted in [
        "  sync_module_states: false\n  cpu_ram_efficient_loading: false\n",
        "  sync_module_states: false\n  fsdp_sync_module_states: true\n",
        // An FSDP 1 file as `accelerate config` writes it: a strategy in
        // reshard_after_forward, which FSDP 1 does not read.
        "  fsdp_version: 1\n  fsdp_reshard_after_forward: FULL_SHARD\n  fsdp_offload_params: yes\n",
    ] {
        fsdp_file(accepted);
        for target in ["x.py", "configs/default.toml"] {
            let applied = apply(
                &mut cli(&["--config_file", &shown, target]),
                &Default::default(),
            );
            assert!(applied.is_ok(), "{accepted} {target}: {applied:?}");
        }
    }
    let applied = apply(
        &mut cli(&["--config_file", &shown, "x.py"]),
        &Default::default(),
    )
    .unwrap();
    assert!(
        applied
            .env
            .contains(&("FSDP_OFFLOAD_PARAMS".into(), "true".into())),
        "YAML 1.1's yes: {:?}",
        applied.env
    );
    let flags = ["--use_fsdp", "--fsdp_sync_module_states", "false", "x.py"];
    let applied = apply(&mut cli(&flags), &Default::default()).unwrap();
    assert!(applied
        .env
        .contains(&("FSDP_SYNC_MODULE_STATES".into(), "false".into())));
}
