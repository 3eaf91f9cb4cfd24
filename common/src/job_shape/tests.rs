//! Precedence flag > Slurm > PET_* > default, Slurm's step and GPU variables, bad values.

use super::*;

fn env(pairs: &[(&str, &str)]) -> Env {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A 2-node `srun --ntasks-per-node=1` step on node 1 of job 4242, as Slurm 22.05 sets it.
fn slurm_step() -> Vec<(&'static str, &'static str)> {
    vec![
        ("SLURM_JOB_ID", "4242"),
        ("SLURM_STEP_ID", "0"),
        ("SLURM_NNODES", "2"),
        ("SLURM_JOB_NUM_NODES", "2"),
        ("SLURM_STEP_NUM_NODES", "2"),
        ("SLURM_NODEID", "1"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_STEP_NUM_TASKS", "2"),
        ("SLURM_JOB_NODELIST", "gpu-a[07-08]"),
        ("SLURM_STEP_NODELIST", "gpu-a[07-08]"),
    ]
}

fn pet() -> Vec<(&'static str, &'static str)> {
    vec![
        ("PET_NNODES", "3"),
        ("PET_NODE_RANK", "2"),
        ("PET_MASTER_ADDR", "job-master-0"),
        ("PET_MASTER_PORT", "23456"),
        ("PET_NPROC_PER_NODE", "4"),
        ("PET_MAX_RESTARTS", "2"),
    ]
}

fn shape(flags: &Flags, pairs: &[(&str, &str)]) -> JobShape {
    resolve(flags, &env(pairs)).unwrap_or_else(|e| panic!("{e}"))
}

fn error(flags: &Flags, pairs: &[(&str, &str)]) -> String {
    resolve(flags, &env(pairs))
        .expect_err("an error")
        .to_string()
}

/// torchrun's fixed multi-node line without a node rank (`--nnodes 2 --rdzv-endpoint H:P`)
/// forms the job at the endpoint, as an elastic one of exactly 2 nodes; with neither a node rank
/// nor an endpoint it is refused, naming both ways out.
#[test]
fn a_fixed_node_count_without_node_ranks_meets_at_the_endpoint() {
    let flags = Flags {
        nnodes: Some(2),
        rdzv_endpoint: Some("h0:29400".into()),
        run_id: Some("J".into()),
        ..Flags::default()
    };
    let e = shape(&flags, &[])
        .elastic
        .expect("formed by the rendezvous");
    assert_eq!((e.min, e.max), (2, 2));
    assert_eq!(e.endpoint.value, ("h0".to_string(), 29400));
    let k8s = shape(
        &Flags::default(),
        &[
            ("PET_NNODES", "3"),
            ("PET_RDZV_ENDPOINT", "master:29400"),
            ("PET_RDZV_ID", "j"),
        ],
    );
    assert_eq!(k8s.elastic.map(|e| (e.min, e.max)), Some((3, 3)));
    // A node rank given: the static job as before.
    let ranked = Flags {
        node_rank: Some(1),
        ..flags.clone()
    };
    assert!(shape(&ranked, &[]).elastic.is_none());
    let neither = Flags {
        rdzv_endpoint: None,
        ..flags
    };
    let err = error(&neither, &[]);
    assert!(
        err.contains("2 nodes (flag --nnodes) but no node rank: give each node its own --node-rank (0..1), or the same --rdzv-endpoint"),
        "{err}"
    );
}

#[test]
fn defaults_without_flags_or_environment() {
    let s = shape(&Flags::default(), &[]);
    assert_eq!(s.nnodes.value, 1);
    assert_eq!(s.node_rank.value, 0);
    assert_eq!(s.master_addr.value, "127.0.0.1");
    // One node: a free port from the OS (0), so that jobs side by side never clash.
    assert_eq!(s.master_port.value, 0);
    assert_eq!(
        s.master_port.source.to_string(),
        "default (single node: a free port)"
    );
    // Several nodes all dial node 0: a fixed port they can agree on.
    let two = Flags {
        nnodes: Some(2),
        node_rank: Some(1),
        master_addr: Some("h0".into()),
        run_id: Some("r".into()),
        ..Flags::default()
    };
    assert_eq!(shape(&two, &[]).master_port.value, DEFAULT_MASTER_PORT);
    assert_eq!(s.run_id.value, None);
    assert_eq!(s.num_processes.value, NumProcesses::Count(1));
    assert_eq!(s.max_restarts.value, 0);
    assert!(matches!(s.nnodes.source, Source::Default(_)));
    assert!(s.slurm.is_none());
    assert_eq!(s.without_secret(), None);
}

#[test]
fn slurm_gives_the_shape_inside_a_step() {
    let s = shape(&Flags::default(), &slurm_step());
    assert_eq!(s.nnodes.value, 2);
    assert_eq!(
        s.nnodes.source,
        Source::Slurm("SLURM_STEP_NUM_NODES=2".into())
    );
    assert_eq!(s.node_rank.value, 1);
    assert_eq!(s.master_addr.value, "gpu-a07");
    assert_eq!(
        s.master_addr.source.to_string(),
        "Slurm first host of SLURM_STEP_NODELIST=gpu-a[07-08]"
    );
    assert_eq!(s.master_port.value, slurm_port(4242, Some(0)));
    assert_eq!(s.run_id.value.as_deref(), Some("slurm-4242.0"));
    // A run id derived from the job id can be guessed: say so, with the way out.
    let warning = s.without_secret().expect("a derived id is no secret");
    assert!(
        warning.contains(RUN_ID_VAR) && warning.contains("derived from the Slurm job"),
        "{warning}"
    );
    // No GPUs in the job: one process unless a flag says more.
    assert_eq!(s.num_processes.value, NumProcesses::Count(1));
}

#[test]
fn flags_beat_slurm_which_beats_pet_which_beats_defaults() {
    let mut both = slurm_step();
    both.extend(pet());
    let s = shape(&Flags::default(), &both);
    assert_eq!((s.nnodes.value, s.node_rank.value), (2, 1));
    assert_eq!(s.master_addr.value, "gpu-a07");
    assert!(matches!(s.master_port.source, Source::Slurm(_)));
    // Slurm has nothing to say about processes per node without GPUs or restarts: PET_* does.
    assert_eq!(s.num_processes.value, NumProcesses::Count(4));
    assert_eq!(
        s.num_processes.source,
        Source::Pet("PET_NPROC_PER_NODE=4".into())
    );
    assert_eq!(s.max_restarts.value, 2);

    let flags = Flags {
        nnodes: Some(4),
        node_rank: Some(3),
        master_addr: Some("10.0.0.9".into()),
        master_port: Some(1234),
        run_id: Some("mine".into()),
        num_processes: Some(NumProcesses::Count(8)),
        max_restarts: Some(1),
        ..Flags::default()
    };
    let s = shape(&flags, &both);
    assert_eq!(s.nnodes, Sourced::new(4, Source::Flag("--nnodes")));
    assert_eq!(s.node_rank, Sourced::new(3, Source::Flag("--node-rank")));
    assert_eq!(s.master_addr.value, "10.0.0.9");
    assert_eq!(
        s.master_port,
        Sourced::new(1234, Source::Flag("--master-port"))
    );
    assert_eq!(s.run_id.value.as_deref(), Some("mine"));
    assert_eq!(s.num_processes.value, NumProcesses::Count(8));
    assert_eq!(s.max_restarts.source, Source::Flag("--max-restarts"));
    assert_eq!(s.without_secret(), None);

    let s = shape(&Flags::default(), &pet());
    assert_eq!((s.nnodes.value, s.node_rank.value), (3, 2));
    assert_eq!(s.master_addr.value, "job-master-0");
    assert_eq!(
        s.master_port,
        Sourced::new(23456, Source::Pet("PET_MASTER_PORT=23456".into()))
    );
    assert_eq!(
        s.master_addr.source.to_string(),
        "Kubernetes/TorchX PET_MASTER_ADDR=job-master-0"
    );
}

#[test]
fn our_run_id_variable_wins_over_derived_ids() {
    let mut vars = slurm_step();
    vars.push((RUN_ID_VAR, "slurm-4242-5eb63bbbe01eeed093cb22bb8f5acdc3"));
    let s = shape(&Flags::default(), &vars);
    assert_eq!(
        s.run_id.value.as_deref(),
        Some("slurm-4242-5eb63bbbe01eeed093cb22bb8f5acdc3")
    );
    assert_eq!(s.run_id.source, Source::Env(RUN_ID_VAR.into()));
    assert_eq!(s.without_secret(), None);
    let flags = Flags {
        run_id: Some("flag".into()),
        ..Flags::default()
    };
    assert_eq!(shape(&flags, &vars).run_id.value.as_deref(), Some("flag"));
    assert!(error(&Flags::default(), &[(RUN_ID_VAR, " ")]).contains("must not be empty"));
}

#[test]
fn pet_rendezvous_endpoint_and_fixed_elastic_ranges() {
    let s = shape(
        &Flags::default(),
        &[
            ("PET_NNODES", "2:2"),
            ("PET_NODE_RANK", "1"),
            ("PET_RDZV_ENDPOINT", "trainer-0.svc:29400"),
            ("PET_RDZV_ID", "job-7"),
        ],
    );
    assert_eq!(s.nnodes.value, 2);
    assert_eq!(s.master_addr.value, "trainer-0.svc");
    assert_eq!(s.master_port.value, 29400);
    assert_eq!(s.run_id.value.as_deref(), Some("job-7"));
    assert!(error(&Flags::default(), &[("PET_NNODES", "4:1")]).contains("PET_NNODES=\"4:1\""));
}

#[test]
fn multi_node_without_an_id_uses_none_and_says_how_to_share_one() {
    let flags = Flags {
        nnodes: Some(2),
        node_rank: Some(0),
        master_addr: Some("10.1.1.1".into()),
        master_port: Some(29611),
        ..Flags::default()
    };
    let s = shape(&flags, &[]);
    assert_eq!(s.run_id.value, None);
    assert_eq!(s.default_run_id(), Some(PUBLIC_RUN_ID));
    let why = s.without_secret().expect("a multi-node run without an id");
    assert!(
        why.contains("unauthenticated")
            && why.contains("10.1.1.1:29611")
            && why.contains("--run-id-file")
            && why.contains("LAUNCH_RUN_ID")
            && why.contains("--require-secret"),
        "{why}"
    );
    // A run id file, flag or variable satisfies it; one node never needs one.
    let with_file = Flags {
        run_id_file: Some("/shared/id".into()),
        ..flags.clone()
    };
    let s = shape(&with_file, &[]);
    assert_eq!(s.run_id.source, Source::File("/shared/id".into()));
    assert_eq!((s.without_secret(), s.default_run_id()), (None, None));
    assert_eq!(
        shape(&flags, &[("LAUNCH_RUN_ID_FILE", "/x")]).without_secret(),
        None
    );
    assert_eq!(
        shape(&flags, &[("LAUNCH_RUN_ID", "s")]).without_secret(),
        None
    );
    let one = shape(&Flags::default(), &[]);
    assert_eq!((one.without_secret(), one.default_run_id()), (None, None));
    // torchrun's public id given explicitly is no secret either.
    let given = Flags {
        run_id: Some("none".into()),
        ..flags.clone()
    };
    let why = shape(&given, &[]).without_secret().expect("public id");
    assert!(why.contains("torchrun's public default"), "{why}");
}

/// torchrun's c10d form (`--rdzv-endpoint`, no node rank): the warning names that endpoint, not
/// the master defaults.
#[test]
fn the_warning_names_the_rendezvous_endpoint_given() {
    let flags = Flags {
        nnodes: Some(2),
        rdzv_endpoint: Some("127.0.0.1:29615".into()),
        ..Flags::default()
    };
    let why = shape(&flags, &[]).without_secret().unwrap();
    assert!(why.contains("127.0.0.1:29615"), "{why}");
    assert!(!why.contains("29500"), "{why}");
}

#[test]
fn require_secret_reads_its_variable() {
    let env = |v: &str| Env::from([(REQUIRE_SECRET_VAR.to_string(), v.to_string())]);
    assert!(!require_secret_from_env(&Env::new()).unwrap());
    for yes in ["1", "true", "YES", "on"] {
        assert!(require_secret_from_env(&env(yes)).unwrap(), "{yes}");
    }
    for no in ["0", "false", "", "off"] {
        assert!(!require_secret_from_env(&env(no)).unwrap(), "{no}");
    }
    let e = require_secret_from_env(&env("maybe")).unwrap_err().0;
    assert!(e.contains("LAUNCH_REQUIRE_SECRET=\"maybe\""), "{e}");
}

#[test]
fn several_tasks_per_node_are_refused_with_the_fix() {
    let mut vars = slurm_step();
    for (k, v) in vars.iter_mut() {
        match *k {
            "SLURM_NTASKS" | "SLURM_STEP_NUM_TASKS" => *v = "8",
            "SLURM_NNODES" | "SLURM_JOB_NUM_NODES" | "SLURM_STEP_NUM_NODES" => *v = "1",
            "SLURM_NODEID" => *v = "0",
            _ => {}
        }
    }
    let err = error(&Flags::default(), &vars);
    assert!(err.contains("runs 8 tasks on 1 node(s)"), "{err}");
    assert!(err.contains("--ntasks-per-node=1"), "{err}");
}

#[test]
fn batch_script_of_a_multi_node_job_is_refused_but_one_node_is_fine() {
    let batch = [
        ("SLURM_JOB_ID", "77"),
        ("SLURM_NNODES", "2"),
        ("SLURM_NODEID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_JOB_NODELIST", "n[0-1]"),
    ];
    let err = error(&Flags::default(), &batch);
    assert!(err.contains("batch script"), "{err}");
    assert!(err.contains("srun --ntasks-per-node=1"), "{err}");
    let single = [
        ("SLURM_JOB_ID", "77"),
        ("SLURM_NNODES", "1"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_JOB_NODELIST", "n0"),
    ];
    let s = shape(&Flags::default(), &single);
    assert_eq!(s.nnodes.value, 1);
    // One node: the store stays on loopback, not on the node's name, on a free port (no
    // other node needs to know it; two jobs on one node never share one).
    assert_eq!(s.master_addr.value, "127.0.0.1");
    assert_eq!(s.master_port.value, 0);
    assert_eq!(s.run_id.value.as_deref(), Some("slurm-77"));
}

#[test]
fn standalone_ignores_the_job_shape() {
    let flags = Flags {
        standalone: true,
        ..Flags::default()
    };
    let mut vars = slurm_step();
    vars.retain(|(k, _)| *k != "SLURM_NODEID");
    let s = shape(&flags, &vars);
    assert_eq!((s.nnodes.value, s.master_port.value), (1, 0));
    assert_eq!(s.run_id.value, None);
    let flags = Flags {
        standalone: true,
        nnodes: Some(2),
        ..Flags::default()
    };
    assert!(error(&flags, &[]).contains("--standalone"));
}

#[test]
fn slurm_ports_differ_between_jobs_and_steps_and_stay_in_range() {
    let mut seen = std::collections::BTreeSet::new();
    for job in 1000..1000 + 5000 {
        let port = slurm_port(job, Some(0));
        assert!(
            (SLURM_PORT_BASE..SLURM_PORT_BASE + SLURM_PORT_SPAN as u16).contains(&port),
            "{port}"
        );
        assert!(seen.insert(port), "job {job} reuses port {port}");
    }
    assert_ne!(slurm_port(5, Some(0)), slurm_port(5, Some(1)));
    assert_eq!(slurm_port(5, None), slurm_port(5, Some(0)));
    assert!(slurm_port(u64::MAX, Some(u64::MAX)) >= SLURM_PORT_BASE);
}

#[test]
fn slurm_gpus_set_processes_and_map_local_ranks_to_node_ids() {
    let gpus_of = |vars: &[(&str, &str)]| {
        shape(&Flags::default(), vars)
            .slurm
            .and_then(|s| s.gpus)
            .expect("gpus")
    };
    // `srun --gpus-per-task=2`: the node has 4, this task's own list is what it may use.
    let mut vars = slurm_step();
    vars.extend([
        ("SLURM_GPUS_ON_NODE", "4"),
        ("SLURM_STEP_GPUS", "4,6"),
        ("SLURM_JOB_GPUS", "4,5,6,7"),
        ("CUDA_VISIBLE_DEVICES", "0,1"),
    ]);
    let s = shape(&Flags::default(), &vars);
    assert_eq!(s.num_processes.value, NumProcesses::Count(2));
    assert_eq!(
        s.num_processes.source.to_string(),
        "Slurm SLURM_STEP_GPUS=4,6 (GPUs of this step)"
    );
    let gpus = gpus_of(&vars);
    assert_eq!(gpus.physical_of(0), Some("4"));
    assert_eq!(gpus.physical_of(1), Some("6"));
    assert_eq!(gpus.physical_of(2), None);

    // In a step without its own list, the job's list is not this step's: count only.
    let mut vars = slurm_step();
    vars.extend([("SLURM_GPUS_ON_NODE", "2"), ("SLURM_JOB_GPUS", "0,1,2,3")]);
    let gpus = gpus_of(&vars);
    assert_eq!((gpus.count, gpus.physical_of(0)), (2, None));
    // In a one-node batch script, the job's list is the one.
    let batch = [
        ("SLURM_JOB_ID", "8"),
        ("SLURM_NNODES", "1"),
        ("SLURM_JOB_GPUS", "2,3,5"),
        ("SLURM_GPUS_ON_NODE", "3"),
    ];
    let gpus = gpus_of(&batch);
    assert_eq!((gpus.count, gpus.physical_of(2)), (3, Some("5")));
    // No GPUs asked for: no GPU variables, one process.
    assert!(shape(&Flags::default(), &slurm_step())
        .slurm
        .unwrap()
        .gpus
        .is_none());
    // A flag still wins over Slurm's GPU count.
    let flags = Flags {
        num_processes: Some(NumProcesses::Count(1)),
        ..Flags::default()
    };
    let mut vars = slurm_step();
    vars.push(("SLURM_GPUS_ON_NODE", "8"));
    assert_eq!(
        shape(&flags, &vars).num_processes.value,
        NumProcesses::Count(1)
    );
}

#[test]
fn gpu_ids_set_the_process_count_and_conflicts_are_errors() {
    let flags = Flags {
        gpu_ids: Some(vec![0, 2, 5]),
        ..Flags::default()
    };
    let s = shape(&flags, &[]);
    assert_eq!(
        s.num_processes,
        Sourced::new(NumProcesses::Count(3), Source::Flag("--gpu-ids"))
    );
    let flags = Flags {
        gpu_ids: Some(vec![0, 2, 5]),
        num_processes: Some(NumProcesses::Auto),
        ..Flags::default()
    };
    assert_eq!(
        shape(&flags, &[]).num_processes.value,
        NumProcesses::Count(3)
    );
    let flags = Flags {
        gpu_ids: Some(vec![0, 1]),
        num_processes: Some(NumProcesses::Count(4)),
        ..Flags::default()
    };
    let err = error(&flags, &[]);
    assert!(
        err.contains("--num-processes 4 does not match --gpu-ids 0,1"),
        "{err}"
    );
}

#[test]
fn bad_environment_values_name_the_variable() {
    for (pairs, needle) in [
        (vec![("SLURM_JOB_ID", "x1")], "SLURM_JOB_ID=\"x1\""),
        (
            vec![
                ("SLURM_JOB_ID", "1"),
                ("SLURM_STEP_ID", "0"),
                ("SLURM_NODEID", "one"),
            ],
            "SLURM_NODEID=\"one\"",
        ),
        (
            vec![
                ("SLURM_JOB_ID", "1"),
                ("SLURM_STEP_ID", "0"),
                ("SLURM_NNODES", "2"),
                ("SLURM_NODEID", "0"),
                ("SLURM_STEP_NODELIST", "n[0-1"),
            ],
            "SLURM_STEP_NODELIST: bad hostlist",
        ),
        (vec![("PET_NNODES", "two")], "PET_NNODES=\"two\""),
        (
            vec![("PET_MASTER_PORT", "99999")],
            "PET_MASTER_PORT=\"99999\"",
        ),
        (
            vec![("PET_NPROC_PER_NODE", "0")],
            "PET_NPROC_PER_NODE=\"0\"",
        ),
        (
            vec![("PET_NNODES", "2"), ("PET_NODE_RANK", "2")],
            "node rank 2 (Kubernetes/TorchX PET_NODE_RANK=2) is out of range",
        ),
        (
            vec![("PET_NNODES", "2"), ("PET_MASTER_PORT", "0")],
            "master port 0",
        ),
    ] {
        let err = error(&Flags::default(), &pairs);
        assert!(err.contains(needle), "{pairs:?}: {err}");
    }
}

#[test]
fn parsers_of_counts() {
    assert_eq!(parse_num_processes("gpu"), Ok(NumProcesses::Auto));
    assert_eq!(parse_num_processes(" 3 "), Ok(NumProcesses::Count(3)));
    assert!(parse_num_processes("5000").is_err());
    assert_eq!(parse_node_range("4").map(NodeRange::fixed), Ok(Some(4)));
    assert_eq!(parse_node_range("4:4").map(NodeRange::fixed), Ok(Some(4)));
    assert_eq!(parse_node_range("1:4"), Ok(NodeRange { min: 1, max: 4 }));
    assert!(parse_node_range("0").is_err());
}

#[test]
fn an_elastic_range_gives_an_elastic_shape_with_its_endpoint_and_timeouts() {
    let flags = Flags {
        elastic_nnodes: Some(NodeRange { min: 2, max: 3 }),
        rdzv_endpoint: Some("10.0.0.1:4000".into()),
        rdzv_conf: vec![(
            "last_call_timeout".into(),
            std::time::Duration::from_secs(2),
        )],
        run_id: Some("secret".into()),
        ..Flags::default()
    };
    let s = resolve(&flags, &env(&[])).unwrap();
    let e = s.elastic.expect("elastic");
    assert_eq!((e.min, e.max, s.nnodes.value), (2, 3, 3));
    assert_eq!(e.endpoint.value, ("10.0.0.1".to_string(), 4000));
    assert_eq!(e.last_call.value, std::time::Duration::from_secs(2));
    assert_eq!(e.join_timeout.value, std::time::Duration::from_secs(900));
    // torchrun's variables, as an elastic PyTorchJob sets them.
    let s = resolve(
        &Flags::default(),
        &env(&[
            ("PET_NNODES", "1:4"),
            ("PET_RDZV_ENDPOINT", "head"),
            ("PET_RDZV_TIMEOUT", "60"),
            ("PET_RDZV_ID", "job-7"),
        ]),
    )
    .unwrap();
    let e = s.elastic.expect("elastic from PET_NNODES");
    assert_eq!((e.min, e.max), (1, 4));
    assert_eq!(e.endpoint.value, ("head".to_string(), DEFAULT_RDZV_PORT));
    assert_eq!(e.join_timeout.value, std::time::Duration::from_secs(60));
    // A fixed range is not elastic; an elastic one cannot be standalone.
    let fixed = Flags {
        nnodes: Some(1),
        ..Flags::default()
    };
    assert!(resolve(&fixed, &env(&[("PET_NNODES", "2:2")]))
        .unwrap()
        .elastic
        .is_none());
    let standalone = Flags {
        standalone: true,
        elastic_nnodes: Some(NodeRange { min: 1, max: 2 }),
        ..Flags::default()
    };
    assert!(error(&standalone, &[]).contains("--standalone"));
}

/// Every source of a node or process count is bounded, in one line naming the variable, the
/// value and the limit; the limits themselves are accepted.
#[test]
fn counts_from_every_source_are_bounded() {
    let step = [("SLURM_JOB_ID", "7"), ("SLURM_STEP_ID", "0")];
    for (pair, needle) in [
        (
            ("PET_NNODES", "1:4000000000"),
            "PET_NNODES=\"1:4000000000\": 4000000000 nodes is more than launch supports (at most 65536)",
        ),
        (
            ("PET_NNODES", "99999999999999999999999"),
            "99999999999999999999999 nodes is more than launch supports (at most 65536)",
        ),
        (
            ("PET_NPROC_PER_NODE", "1025"),
            "PET_NPROC_PER_NODE=\"1025\": 1025 processes on one node is more than launch supports (at most 1024)",
        ),
        (
            ("SLURM_NNODES", "65537"),
            "SLURM_NNODES=\"65537\" (set by Slurm): 65537 nodes is more than launch supports (at most 65536)",
        ),
        (
            ("SLURM_STEP_NUM_TASKS", "4000000000"),
            "SLURM_STEP_NUM_TASKS=\"4000000000\" (set by Slurm): 4000000000 processes in the job is more than launch supports (at most 1048576)",
        ),
        (
            ("SLURM_GPUS_ON_NODE", "4000000000"),
            "SLURM_GPUS_ON_NODE=\"4000000000\" (set by Slurm): 4000000000 processes on one node is more than launch supports (at most 1024)",
        ),
    ] {
        let mut pairs = step.to_vec();
        if pair.0.starts_with("PET_") {
            pairs.clear();
        }
        pairs.push(pair);
        let err = error(&Flags::default(), &pairs);
        assert!(err.contains(needle), "{pair:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    let list = (0..1025)
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let err = error(
        &Flags::default(),
        &[step[0], step[1], ("SLURM_STEP_GPUS", &list)],
    );
    assert!(
        err.contains("SLURM_STEP_GPUS (set by Slurm) lists 1025 GPUs: 1025 processes on one node"),
        "{err}"
    );
    let s = shape(
        &Flags::default(),
        &[
            ("PET_NNODES", "65536"),
            ("PET_NODE_RANK", "0"),
            ("PET_NPROC_PER_NODE", "1024"),
        ],
    );
    assert_eq!(s.nnodes.value, MAX_NODES);
    assert_eq!(s.num_processes.value, NumProcesses::Count(MAX_PROCESSES));
    let world = check_world(&s.nnodes, 1024, &s.num_processes.source).unwrap_err();
    assert!(
        world.0.starts_with("65536 node(s) (Kubernetes/TorchX PET_NNODES=65536) x 1024 process(es) per node (Kubernetes/TorchX PET_NPROC_PER_NODE=1024): 67108864 processes in the job is more than launch supports (at most 1048576)"),
        "{world}"
    );
    assert_eq!(
        check_world(&s.nnodes, 16, &s.num_processes.source),
        Ok(MAX_WORLD)
    );
    assert_eq!(Count::Nodes.parse("+12"), Ok(12));
    assert_eq!(Count::Nodes.parse("1e3"), Err(CountError::NotANumber));
}
