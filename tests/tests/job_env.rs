//! The job shape from the environment, end to end: two `launch` processes as two nodes on
//! loopback configured only by torchrun's `PET_*` variables (as Kubeflow's PyTorchJob and TorchX
//! set them), Slurm's variables in a dry run, and `--gpu-ids` on simulated GPUs.

mod support;

use std::time::Duration;

use support::{
    free_port, launch_cmd, rank_lines, tiny_bpr_sets, unique_run_id, wait_no_processes,
    wait_output, Output,
};

const T: Duration = Duration::from_secs(60);

/// `launch ARGS...` without the CUDA_VISIBLE_DEVICES the tests run under, `env` added.
fn run_with_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = launch_cmd(args);
    cmd.env_remove("CUDA_VISIBLE_DEVICES");
    for (k, v) in env {
        cmd.env(k, v);
    }
    wait_output(cmd.spawn().expect("start launch"), T)
}

/// `launch --dry-run -- true` with `env`; asserts it exits 0 and prints every one of `needles`.
#[track_caller]
fn assert_dry_run_prints(env: &[(&str, &str)], needles: &[&str]) {
    let out = run_with_env(&["--dry-run", "--", "true"], env);
    out.assert_code(0);
    out.assert_stdout_all(needles);
}

#[test]
fn two_nodes_from_pet_variables_train_as_one_world() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port().to_string();
    let run_id = unique_run_id("pet");
    let mut args = vec!["configs/default.toml".to_string()];
    args.extend(tiny_bpr_sets(dir.path()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let nodes: Vec<_> = (0..2)
        .map(|node| {
            let rank = node.to_string();
            let mut cmd = launch_cmd(&args);
            cmd.envs([
                ("PET_NNODES", "2"),
                ("PET_NODE_RANK", rank.as_str()),
                ("PET_MASTER_ADDR", "127.0.0.1"),
                ("PET_MASTER_PORT", port.as_str()),
                ("PET_NPROC_PER_NODE", "2"),
                ("PET_RDZV_ID", run_id.as_str()),
            ]);
            cmd.spawn().expect("start launch")
        })
        .collect();
    let outs: Vec<Output> = nodes
        .into_iter()
        .map(|child| wait_output(child, Duration::from_secs(300)))
        .collect();
    for (node, out) in outs.iter().enumerate() {
        assert_eq!(
            out.code(),
            Some(0),
            "node {node}:\n{}\n{}",
            out.stdout,
            out.stderr
        );
        let lines = rank_lines(&out.stdout);
        for local in 0..2u32 {
            let rank = node as u32 * 2 + local;
            let want = format!("worker rank {rank}/4 (local {local}/2, node {node}/2");
            assert!(
                lines
                    .iter()
                    .any(|(r, t)| *r == rank && t.starts_with(&want)),
                "node {node}: no {want:?}:\n{}",
                out.stdout
            );
        }
    }
    // Rank 0 (node 0) wrote the results; node 1's launch ran only ranks 2 and 3.
    assert!(outs[0].stdout.contains("summary:"), "{}", outs[0].stdout);
    assert!(!outs[1].stdout.contains("summary:"), "{}", outs[1].stdout);
    assert!(wait_no_processes(&run_id, Duration::from_secs(10)).is_empty());
}

#[test]
fn dry_run_names_where_each_value_came_from() {
    let pet = [
        ("PET_NNODES", "3"),
        ("PET_NODE_RANK", "2"),
        ("PET_MASTER_ADDR", "trainer-master-0"),
        ("PET_MASTER_PORT", "23456"),
        ("PET_NPROC_PER_NODE", "2"),
    ];
    assert_dry_run_prints(
        &pet,
        &[
            "world size:   6 = 3 node(s) x 2 process(es); this node: rank 2 of 3",
            "nodes:        3  [Kubernetes/TorchX PET_NNODES=3]",
            "node rank:    2  [Kubernetes/TorchX PET_NODE_RANK=2]",
            "master addr:  trainer-master-0  [Kubernetes/TorchX PET_MASTER_ADDR=trainer-master-0]",
            "master port:  23456  [Kubernetes/TorchX PET_MASTER_PORT=23456]",
            "processes:    2 on this node  [Kubernetes/TorchX PET_NPROC_PER_NODE=2]",
            "RANK=4 LOCAL_RANK=0 WORLD_SIZE=6",
        ],
    );
    // A flag wins over the environment.
    let out = run_with_env(&["--dry-run", "--node-rank", "1", "--", "true"], &pet);
    assert!(
        out.stdout.contains("node rank:    1  [flag --node-rank]"),
        "{}",
        out.stdout
    );

    // Slurm's variables (a 2-node `srun --ntasks-per-node=1` step, node 1) win over PET_*.
    let mut slurm = vec![
        ("SLURM_JOB_ID", "4242"),
        ("SLURM_STEP_ID", "0"),
        ("SLURM_NNODES", "2"),
        ("SLURM_STEP_NUM_NODES", "2"),
        ("SLURM_NODEID", "1"),
        ("SLURM_STEP_NUM_TASKS", "2"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_JOB_NODELIST", "gpu-a[07-08]"),
        ("SLURM_STEP_NODELIST", "gpu-a[07-08]"),
        ("SLURM_GPUS_ON_NODE", "2"),
        ("SLURM_STEP_GPUS", "4,6"),
    ];
    slurm.extend(pet);
    assert_dry_run_prints(
        &slurm,
        &[
            "nodes:        2  [Slurm SLURM_STEP_NUM_NODES=2]",
            "node rank:    1  [Slurm SLURM_NODEID=1]",
            "master addr:  gpu-a07  [Slurm first host of SLURM_STEP_NODELIST=gpu-a[07-08]]",
            "[Slurm derived from SLURM_JOB_ID=4242, SLURM_STEP_ID=0]",
            "run id:       slurm-4242.0  [Slurm SLURM_JOB_ID=4242, SLURM_STEP_ID=0]",
            "processes:    2 on this node  [Slurm SLURM_STEP_GPUS=4,6 (GPUs of this step)]",
            "Slurm's GPU 6 on this node",
            "LAUNCH_RUN_ID",
        ],
    );
    // The secret run id never appears in a dry run.
    slurm.push(("LAUNCH_RUN_ID", "slurm-4242-0123456789abcdef"));
    let out = run_with_env(&["--dry-run", "--", "true"], &slurm);
    assert!(!out.stdout.contains("0123456789abcdef"), "{}", out.stdout);
    assert!(
        out.stdout
            .contains("run id:       <hidden: $LAUNCH_RUN_ID>  [environment LAUNCH_RUN_ID]"),
        "{}",
        out.stdout
    );
}

#[test]
fn several_tasks_per_node_in_a_slurm_step_is_a_one_line_error() {
    let env = [
        ("SLURM_JOB_ID", "99"),
        ("SLURM_STEP_ID", "0"),
        ("SLURM_NNODES", "1"),
        ("SLURM_STEP_NUM_NODES", "1"),
        ("SLURM_NODEID", "0"),
        ("SLURM_STEP_NUM_TASKS", "8"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_STEP_NODELIST", "n0"),
    ];
    let out = run_with_env(&["--", "true"], &env);
    out.assert_code(2);
    assert_eq!(out.stderr.lines().count(), 1, "{}", out.stderr);
    out.assert_stderr_all(&["runs 8 tasks on 1 node(s)", "--ntasks-per-node=1"]);
}

#[test]
fn gpu_ids_run_one_worker_per_listed_gpu() {
    let show = "echo \"gpu $LOCAL_RANK $CUDA_VISIBLE_DEVICES $CUDA_DEVICE_ORDER\"";
    let sim = [("GPTREC_SIMULATE_GPUS", "4")];
    let out = run_with_env(&["--gpu-ids", "2,0", "--", "sh", "-c", show], &sim);
    out.assert_code(0);
    let mut lines: Vec<_> = rank_lines(&out.stdout)
        .into_iter()
        .map(|(r, t)| format!("{r}: {t}"))
        .collect();
    lines.sort();
    assert_eq!(
        lines,
        ["0: gpu 0 2,0 PCI_BUS_ID", "1: gpu 1 2,0 PCI_BUS_ID"],
        "{}",
        out.stdout
    );
    // `auto` counts the list; ids index an inherited CUDA_VISIBLE_DEVICES (Slurm's, say).
    let out = run_with_env(
        &[
            "--num-processes",
            "auto",
            "--gpu-ids",
            "0,2",
            "--",
            "sh",
            "-c",
            show,
        ],
        &[
            ("GPTREC_SIMULATE_GPUS", "8"),
            ("CUDA_VISIBLE_DEVICES", "5,6,7"),
        ],
    );
    out.assert_code(0);
    assert!(
        out.stdout.contains("gpu 1 5,7 PCI_BUS_ID"),
        "{}",
        out.stdout
    );
    // The dry run shows each local rank's GPU.
    let out = run_with_env(&["--dry-run", "--gpu-ids", "3,1", "--", "true"], &sim);
    out.assert_code(0);
    out.assert_stdout_all(&[
        "local rank 0: device cuda:0 = GPU 3",
        "local rank 1: device cuda:1 = GPU 1",
        "processes:    2 on this node  [flag --gpu-ids]",
    ]);
}

/// MIG instances named in `CUDA_VISIBLE_DEVICES` (both id forms) are devices CUDA will number:
/// `auto` counts them and `--gpu-ids` passes the chosen one through unchanged.
#[test]
fn mig_instances_in_cuda_visible_devices_are_gpus() {
    let modern = "MIG-4b1a5f0e-8d2c-5a37-9e8f-1c2d3e4f5a6b";
    let legacy = "MIG-GPU-9c1c8a7e-1234-5678-9abc-def012345678/1/0";
    let visible = format!("{modern},{legacy}");
    let env = [
        ("GPTREC_SIMULATE_GPUS", "2"),
        ("CUDA_VISIBLE_DEVICES", visible.as_str()),
    ];
    let show = "echo \"gpu $LOCAL_RANK $CUDA_VISIBLE_DEVICES\"";
    let out = run_with_env(
        &[
            "--num-processes",
            "auto",
            "--gpu-ids",
            "1",
            "--",
            "sh",
            "-c",
            show,
        ],
        &env,
    );
    out.assert_code(0);
    assert!(
        out.stdout.contains(&format!("gpu 0 {legacy}")),
        "{}",
        out.stdout
    );
    let out = run_with_env(
        &["--dry-run", "--num-processes", "auto", "--", "true"],
        &env,
    );
    out.assert_code(0);
    out.assert_stdout_all(&[
        "2 visible GPU(s), starting 2 process(es)".to_string(),
        format!("local rank 0: device cuda:0 = {modern} (MIG instance"),
        format!("local rank 1: device cuda:1 = {legacy} (MIG instance"),
    ]);
}

#[test]
fn gpu_id_conflicts_are_one_line_errors() {
    for (args, env, needle) in [
        (
            &["--gpu-ids", "0,7"][..],
            Some("4"),
            "GPU 7 does not exist; this node has 4 visible GPU(s)",
        ),
        (
            &["--num-processes", "4", "--gpu-ids", "0,1"],
            Some("4"),
            "--num-processes 4 does not match --gpu-ids 0,1",
        ),
        (&["--gpu-ids", "0"], Some("0"), "no GPU is visible"),
    ] {
        let mut all: Vec<&str> = args.to_vec();
        all.extend(["--", "true"]);
        let mut cmd = launch_cmd(&all);
        cmd.env_remove("CUDA_VISIBLE_DEVICES");
        if let Some(n) = env {
            cmd.env("GPTREC_SIMULATE_GPUS", n);
        }
        let out = wait_output(cmd.spawn().unwrap(), T);
        assert_eq!(out.code(), Some(2), "{args:?}: {}", out.stderr);
        assert_eq!(out.stderr.lines().count(), 1, "{args:?}: {}", out.stderr);
        assert!(out.stderr.contains(needle), "{args:?}: {}", out.stderr);
    }
}
