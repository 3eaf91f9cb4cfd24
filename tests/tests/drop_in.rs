//! `launch` as a drop-in for torchrun with what its users' scripts do: progress bars redrawn
//! with `\r` (real tqdm) move as they are drawn, and a line written in pieces is shown once it
//! has waited, not held until its end; torchrun's and accelerate's command lines (abbreviated
//! flags included) do what the real tools do with them. The Python tests need the venv
//! `scripts/setup.sh` makes (with tqdm); without it they say so and pass as skipped.

mod support;

use std::path::PathBuf;
use std::time::Duration;

use support::*;

/// The venv of scripts/setup.sh with `module` importable; `None`, after a `skipped:` line,
/// without one.
fn venv_with(module: &str) -> Option<PathBuf> {
    let venv = std::env::var_os("GPTREC_TORCH_VENV").map(PathBuf::from);
    let python = venv.as_ref().map(|v| v.join("bin/python"));
    let found = python.filter(|p| {
        std::process::Command::new(p)
            .args(["-c", &format!("import {module}")])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    if found.is_none() {
        eprintln!("skipped: no venv with {module} (run scripts/setup.sh)");
    }
    found
}

/// A real tqdm bar, drawn on stderr with `\r` and no newline until its end, reaches the console
/// while the loop runs: the script waits at 2/5 until the test has seen "2/5" through `launch`
/// (a launch that held the bar until its line ended would never show it).
#[test]
fn a_tqdm_bar_moves_under_launch() {
    let Some(python) = venv_with("tqdm") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let gate = dir.path().join("go");
    let script = [
        "import os, sys, time",
        "from tqdm import tqdm",
        "for i in tqdm(range(5), desc='progress', mininterval=0, ascii=True):",
        "    while i == 2 and not os.path.exists(sys.argv[1]):",
        "        time.sleep(0.02)",
        "print('done', flush=True)",
    ]
    .join("\n");
    let gate_arg = gate.display().to_string();
    let py = python.display().to_string();
    let args = [
        "--num-processes",
        "1",
        "--",
        py.as_str(),
        "-c",
        &script,
        &gate_arg,
    ];
    let job = Live::new(launch_cmd(&args).spawn().expect("start launch"));
    job.wait_stderr("2/5", Duration::from_secs(60));
    assert!(!job.stdout_now().contains("done"), "{}", job.stdout_now());
    std::fs::write(&gate, "").unwrap();
    let out = job.finish(Duration::from_secs(60));
    out.assert_code(0);
    assert!(
        out.stderr.contains("[rank 0] progress:  40%"),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("5/5"), "{}", out.stderr);
    assert!(out.stdout.contains("[rank 0] done"), "{}", out.stdout);
}

/// A prompt-like partial line (no `\r`, no newline) is shown once it has waited, labelled once;
/// its end, written later, completes the same console line.
#[test]
fn a_partial_line_is_shown_while_its_end_is_awaited() {
    let dir = tempfile::tempdir().unwrap();
    let gate = dir.path().join("go");
    let script = format!(
        "printf 'loading... '; while [ ! -e '{}' ]; do sleep 0.02; done; printf 'ok\\n'",
        gate.display()
    );
    let args = ["--num-processes", "1", "--", "sh", "-c", script.as_str()];
    let job = Live::new(launch_cmd(&args).spawn().expect("start launch"));
    job.wait_output("[rank 0] loading... ", Duration::from_secs(60));
    std::fs::write(&gate, "").unwrap();
    let out = job.finish(Duration::from_secs(60));
    out.assert_code(0);
    assert_eq!(out.stdout, "[rank 0] loading... ok\n", "{}", out.all());
}

/// A real PyTorch script whose `main` is wrapped in torchrun's `@record` and raises: the summary's
/// root cause is the exception it recorded in `TORCHELASTIC_ERROR_FILE` (message, failing frame,
/// time), as torchrun's is; with `--log-dir` the file stays in torchrun's layout.
#[test]
fn a_recorded_exception_is_the_root_cause() {
    let Some(python) = venv_with("torch") else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let script = [
        "import os",
        "from torch.distributed.elastic.multiprocessing.errors import record",
        "@record",
        "def main():",
        "    if os.environ['RANK'] == '1':",
        "        raise ValueError('bad batch 3')",
        "main()",
    ]
    .join("\n");
    let py = python.display().to_string();
    let dir = logs.path().display().to_string();
    let args = [
        "--num-processes",
        "2",
        "--log-dir",
        &dir,
        "--",
        &py,
        "-c",
        &script,
    ];
    let out = launch(&args, Duration::from_secs(120));
    out.assert_code(1);
    out.assert_stderr_all(&[
        "  root cause: rank 1 ",
        "  error (recorded by the rank in its error file):",
        "    | ValueError: bad batch 3",
        "    | File \"<string>\", line 6, in main",
        "    | at 20",
    ]);
    let runs: Vec<_> = std::fs::read_dir(logs.path()).unwrap().flatten().collect();
    let error = runs[0].path().join("attempt_0/1/error.json");
    let text = std::fs::read_to_string(&error).unwrap();
    assert!(text.contains("ValueError: bad batch 3"), "{text}");
}

/// torchrun's environment beyond the contract, and every torchrun 2.11 flag accepted in one
/// command line: `--role` is the workers' ROLE_NAME, `--virtual-local-rank` gives each worker
/// LOCAL_RANK 0 and its own device only, and the error file is each rank's own.
#[test]
fn torchruns_environment_and_flags() {
    let script = "echo rank=$RANK local=$LOCAL_RANK cuda=$CUDA_VISIBLE_DEVICES role=$ROLE_NAME \
                  store=$TORCHELASTIC_USE_AGENT_STORE nccl=$TORCH_NCCL_ASYNC_ERROR_HANDLING \
                  signals=$TORCHELASTIC_SIGNALS_TO_HANDLE error=$TORCHELASTIC_ERROR_FILE";
    let args = [
        "--nproc-per-node",
        "2",
        "--monitor-interval",
        "0.5",
        "--start-method",
        "fork",
        "--event-log-handler",
        "null",
        "--role",
        "trainer",
        "--logs-specs",
        "default",
        "--signals-to-handle",
        "SIGTERM,SIGUSR1",
        "--virtual-local-rank",
        "--no-python",
        "sh",
        "-c",
        script,
    ];
    let mut cmd = launch_cmd(&args);
    cmd.env("CUDA_VISIBLE_DEVICES", "4,6")
        .env_remove("TORCH_NCCL_ASYNC_ERROR_HANDLING");
    let out = wait_output(cmd.spawn().unwrap(), Duration::from_secs(60));
    out.assert_code(0);
    let mut lines = rank_lines(&out.stdout);
    lines.sort();
    assert_eq!(lines.len(), 2, "{}", out.all());
    for (rank, line) in &lines {
        let gpu = ["4", "6"][*rank as usize];
        let want = format!(
            "rank={rank} local=0 cuda={gpu} role=trainer store=False nccl=1 signals=SIGTERM,SIGUSR1 error="
        );
        assert!(line.starts_with(&want), "{line}");
        assert!(
            line.ends_with(&format!("/attempt_0/{rank}/error.json")),
            "{line}"
        );
    }
    assert!(!out.stderr.contains("error"), "{}", out.stderr);
}

/// A torchrun line with abbreviated flags, as torchrun's argparse takes them (`--nproc-per 2
/// --max-r 0 --no-py`), runs under `launch` unchanged, the script's own flags after it
/// untouched; where the venv has PyTorch, torchrun's own parser reads the same line the same way.
#[test]
fn torchruns_abbreviated_flags() {
    let script = "echo rank=$RANK world=$WORLD_SIZE args=$*";
    let args = [
        "--nproc-per",
        "2",
        "--max-r",
        "0",
        "--no-py",
        "sh",
        "-c",
        script,
        "s",
        "--nnode",
        "9",
    ];
    let out = wait_output(launch_cmd(&args).spawn().unwrap(), Duration::from_secs(60));
    out.assert_code(0);
    let mut lines = rank_lines(&out.stdout);
    lines.sort();
    let want: Vec<String> = (0..2)
        .map(|r| format!("rank={r} world=2 args=--nnode 9"))
        .collect();
    let got: Vec<&str> = lines.iter().map(|(_, l)| l.trim()).collect();
    assert_eq!(got, want, "{}", out.all());
    let Some(python) = venv_with("torch") else {
        return;
    };
    let read = "import sys; from torch.distributed.run import get_args_parser; \
                a = get_args_parser().parse_args(sys.argv[1:]); \
                print(a.nproc_per_node, a.max_restarts, a.no_python, a.training_script, \
                a.training_script_args)";
    let torchrun = std::process::Command::new(python)
        .args(["-c", read])
        .args(args)
        .output()
        .unwrap();
    assert!(torchrun.status.success(), "{torchrun:?}");
    assert_eq!(
        String::from_utf8_lossy(&torchrun.stdout).trim(),
        format!("2 0 True sh ['-c', '{script}', 's', '--nnode', '9']")
    );
}

/// accelerate's own test script (`accelerate test` runs it) under `launch`, with an accelerate
/// user's command line: `--cpu --num_processes 2 --num_machines 1 --mixed_precision no
/// --main_process_port 0 --num_cpu_threads_per_process 1 SCRIPT`. Every check of the script
/// passes on both processes (MULTI_CPU through gloo, as accelerate's `--cpu` gives).
#[test]
fn accelerates_test_script_passes_under_launch() {
    let Some(python) = venv_with("accelerate") else {
        return;
    };
    let bin = python.parent().unwrap().to_path_buf();
    let site = std::process::Command::new(&python)
        .args([
            "-c",
            "import accelerate, os; print(os.path.dirname(accelerate.__file__))",
        ])
        .output()
        .unwrap();
    let site = String::from_utf8_lossy(&site.stdout).trim().to_string();
    let script = format!("{site}/test_utils/scripts/test_script.py");
    let work = tempfile::tempdir().unwrap();
    let args = [
        "--cpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--main_process_port",
        "0",
        "--num_cpu_threads_per_process",
        "1",
        &script,
    ];
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let run = || {
        let mut cmd = launch_cmd(&args);
        cmd.current_dir(work.path())
            .env("PATH", &path)
            .env("HF_HOME", work.path().join("hf"));
        wait_output(cmd.spawn().unwrap(), Duration::from_secs(300))
    };
    // PyTorch 2.11's own exit race (described in pytorch/pytorch#179291 and #190489): a gloo
    // worker thread that frees its last all-reduce after the interpreter began finalizing
    // takes the GIL and aborts ("terminate called without an active exception"). Seen here in
    // 5 to 25 runs in a hundred, with workers started by a plain `subprocess.Popen` too. Only
    // that abort, after the script's last check, is run again; any other failure, or that
    // one three times, fails the test.
    let mut out = run();
    for _ in 0..2 {
        let upstream_exit_abort = out.code() == Some(134)
            && out.stdout.contains("**Breakpoint trigger test**")
            && out
                .all()
                .contains("terminate called without an active exception");
        if !upstream_exit_abort {
            break;
        }
        eprintln!("PyTorch's exit-time gloo abort (pytorch/pytorch#190489); running again");
        out = run();
    }
    out.assert_code(0);
    out.assert_stdout_all(&[
        "[rank 0] **Initialization**",
        "[rank 0] Training yielded the same results on one CPU or distributed setup with batch split.",
        "[rank 1] FP16 training check.",
        "[rank 0] **Breakpoint trigger test**",
    ]);
}

/// accelerate's config file (as `accelerate config` writes it, found at its default place
/// through HF_HOME, or named by --config_file) fills what the flags leave; its settings reach the
/// workers as accelerate's variables; what launch does not apply is said in one line.
#[test]
fn accelerates_config_file_and_variables() {
    let work = tempfile::tempdir().unwrap();
    let hf = work.path().join("hf");
    std::fs::create_dir_all(hf.join("accelerate")).unwrap();
    std::fs::write(
        hf.join("accelerate/default_config.yaml"),
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nmixed_precision: bf16\nnum_machines: 1\nnum_processes: 3\nuse_cpu: true\nmegatron_lm_config:\n  megatron_lm_tp_degree: 2\n",
    )
    .unwrap();
    let script =
        "echo rank=$RANK of $WORLD_SIZE mp=$ACCELERATE_MIXED_PRECISION cpu=$ACCELERATE_USE_CPU";
    let args = ["--multi_gpu", "--no-python", "sh", "-c", script];
    let mut cmd = launch_cmd(&args);
    cmd.env("HF_HOME", &hf);
    let out = wait_output(cmd.spawn().unwrap(), Duration::from_secs(60));
    out.assert_code(0);
    let mut lines = rank_lines(&out.stdout);
    lines.sort();
    let want: Vec<(u32, String)> = (0..3)
        .map(|r| (r, format!("rank={r} of 3 mp=bf16 cpu=True")))
        .collect();
    assert_eq!(lines, want, "{}", out.all());
    out.assert_stderr("accelerate config megatron_lm_config: not applied by launch");
    // A bad file: one line naming it and the key, exit 2.
    let bad = work.path().join("bad.yaml");
    std::fs::write(&bad, "num_processes: many\n").unwrap();
    let bad_arg = bad.display().to_string();
    let out = launch(
        &["--config_file", &bad_arg, "--", "true"],
        Duration::from_secs(30),
    );
    out.assert_code(2);
    out.assert_stderr_all(&[bad_arg.as_str(), "num_processes"]);
}

/// accelerate's DeepSpeed line under `launch`: a script's own accelerate (the real one) builds
/// its DeepSpeed plugin from the variables launch set, as under `accelerate launch`; our
/// worker takes the same flags as its config keys (ZeRO stage 1, the optimizer offloaded,
/// accumulation, clipping) and trains so, saying what it applied.
#[test]
fn accelerates_deepspeed_line_reaches_the_script_and_our_worker() {
    let work = tempfile::tempdir().unwrap();
    let ds = [
        "--use_deepspeed",
        "--zero_stage",
        "1",
        "--offload_optimizer_device",
        "cpu",
        "--gradient_accumulation_steps",
        "2",
        "--gradient_clipping",
        "0.5",
        "--num_processes",
        "2",
    ];
    let dir = work.path().display().to_string();
    let mut ours: Vec<String> = ds.iter().map(|s| s.to_string()).collect();
    ours.push("configs/default.toml".into());
    ours.extend(tiny_bpr_sets(work.path()));
    for set in [
        "run.name=\"ds\"",
        "batch.global=192",
        "dist.shard_optimizer=false",
    ] {
        ours.extend(["--set".to_string(), set.to_string()]);
    }
    let args: Vec<&str> = ours.iter().map(String::as_str).collect();
    let mut cmd = launch_cmd(&args);
    cmd.env("HF_HOME", work.path().join("hf"));
    let out = wait_output(cmd.spawn().unwrap(), Duration::from_secs(120));
    out.assert_code(0);
    out.assert_stderr_all(&[
        "accelerate DeepSpeed: --zero_stage 1 = --set dist.zero=1, --offload_optimizer_device cpu = --set dist.offload=\"optimizer\", --gradient_accumulation_steps 2 = --set batch.grad_accum=2, --gradient_clipping 0.5 = --set train.max_grad_norm=0.5",
        "micro 48 x grad_accum 2 x world 2 = global 192",
        "ZeRO stage 1 (dist.zero = 1)",
        "AdamW moments in host memory",
    ]);
    let resolved = std::fs::read_to_string(format!("{dir}/ds/config.resolved.toml")).unwrap();
    assert!(
        resolved.lines().any(|l| l == "max_grad_norm = 0.5"),
        "{resolved}"
    );
    assert!(
        resolved.lines().any(|l| l == "offload = \"optimizer\""),
        "{resolved}"
    );
    let Some(python) = venv_with("accelerate") else {
        return;
    };
    let script = work.path().join("ds.py");
    std::fs::write(
        &script,
        "import os\nfrom accelerate.utils import DeepSpeedPlugin\nc = DeepSpeedPlugin().deepspeed_config\nz = c['zero_optimization']\nprint(f\"rank {os.environ['RANK']}: stage {z['stage']} offload {z['offload_optimizer']['device']} accum {c['gradient_accumulation_steps']} clip {c['gradient_clipping']}\")\n",
    )
    .unwrap();
    let python = python.display().to_string();
    let script = script.display().to_string();
    let mut args: Vec<&str> = ds.to_vec();
    args.extend(["--no-python", python.as_str(), script.as_str()]);
    let mut cmd = launch_cmd(&args);
    cmd.env("HF_HOME", work.path().join("hf"));
    let out = wait_output(cmd.spawn().unwrap(), Duration::from_secs(120));
    out.assert_code(0);
    let mut lines = rank_lines(&out.stdout);
    lines.sort();
    let want: Vec<(u32, String)> = (0..2)
        .map(|r| (r, format!("rank {r}: stage 1 offload cpu accum 2 clip 0.5")))
        .collect();
    assert_eq!(lines, want, "{}", out.all());
}

/// The DeepSpeed and FSDP variables a script gets under `launch` are the ones accelerate's own
/// launcher (its `prepare_deepspeed_cmd_env` and `prepare_multi_gpu_env`, run on the same
/// line) makes, defaults included.
#[test]
fn the_deepspeed_and_fsdp_variables_are_accelerates_own() {
    let Some(python) = venv_with("accelerate") else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let hf = work.path().join("hf");
    let picked = |k: &str| {
        k.contains("DEEPSPEED")
            || k.contains("FSDP")
            || k.contains("GRADIENT_")
            || k.contains("DS_FIELDS")
    };
    // accelerate's `launch_command` on the same line: its checks, then its launcher's variables.
    let program = "import json, sys\nfrom accelerate.commands.launch import launch_command_parser, _validate_launch_command\nfrom accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env\nargs, defaults, mp = _validate_launch_command(launch_command_parser().parse_args(json.loads(sys.argv[1])))\nif args.use_deepspeed and not args.cpu:\n    fields = list(defaults.deepspeed_config.keys()) if defaults else []\n    if mp:\n        fields.append('mixed_precision')\n    args.deepspeed_fields_from_accelerate_config = ','.join(fields)\n    env = prepare_deepspeed_cmd_env(args)[1]\nelse:\n    env = prepare_multi_gpu_env(args)\nfor k, v in env.items():\n    print(f'{k}={v}')\n";
    let theirs = |line: &[&str]| -> Vec<String> {
        let mut args: Vec<&str> = line.to_vec();
        args.extend(["--num_processes", "1", "train.py"]);
        let out = std::process::Command::new(&python)
            .args(["-c", program, &serde_json::to_string(&args).unwrap()])
            .env("HF_HOME", &hf)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{line:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut vars: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| picked(l.split('=').next().unwrap_or("")))
            .map(str::to_string)
            .collect();
        vars.sort();
        vars
    };
    let ours = |line: &[&str]| -> Vec<String> {
        let mut args: Vec<&str> = line.to_vec();
        args.extend(["--num_processes", "1", "--no-python", "env"]);
        let mut cmd = launch_cmd(&args);
        cmd.env("HF_HOME", &hf);
        let out = wait_output(cmd.spawn().unwrap(), Duration::from_secs(60));
        out.assert_code(0);
        let mut vars: Vec<String> = (rank_lines(&out.stdout).into_iter())
            .map(|(_, l)| l)
            .filter(|l| picked(l.split('=').next().unwrap_or("")))
            .collect();
        vars.sort();
        vars
    };
    let file = |name: &str, text: &str| {
        let path = work.path().join(name);
        std::fs::write(&path, format!("compute_environment: LOCAL_MACHINE\nmachine_rank: 0\nnum_machines: 1\nnum_processes: 1\n{text}")).unwrap();
        path.display().to_string()
    };
    let fsdp2 = file("fsdp2.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  reshard_after_forward: false\n  activation_checkpointing: true\n  auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  transformer_layer_cls_to_wrap: GPT2Block\n");
    let ds = file("ds.yaml", "distributed_type: DEEPSPEED\nmixed_precision: bf16\ndeepspeed_config:\n  zero_stage: 3\n  offload_optimizer_device: cpu\n  gradient_clipping: 1.0\n");
    let multi = file(
        "multi.yaml",
        "distributed_type: MULTI_GPU\nmixed_precision: bf16\n",
    );
    // The clipping as PyYAML reads it (`1` an int, `1e-5` text to YAML 1.1).
    let ds_int = file(
        "ds_int.yaml",
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  gradient_clipping: 1\n",
    );
    let ds_text = file(
        "ds_text.yaml",
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  gradient_clipping: 1e-5\n",
    );
    let unsynced = "distributed_type: FSDP\nfsdp_config:\n  sync_module_states: false\n";
    // An FSDP 1 file as `accelerate config` writes it (a strategy in reshard_after_forward),
    // and YAML 1.1's yes.
    let fsdp1 = file("fsdp1.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 1\n  fsdp_reshard_after_forward: FULL_SHARD\n  fsdp_offload_params: yes\n  fsdp_state_dict_type: SHARDED_STATE_DICT\n");
    let fsdp_light = file("light.yaml", &format!("{unsynced}  cpu_ram_efficient_loading: false\n  transformer_layer_cls_to_wrap: GPT2Block,Linear\n"));
    let lines: Vec<Vec<&str>> = vec![
        vec![
            "--use_deepspeed",
            "--zero_stage",
            "2",
            "--offload_optimizer_device",
            "cpu",
            "--gradient_accumulation_steps",
            "4",
            "--gradient_clipping",
            "1.0",
        ],
        vec![
            "--use_fsdp",
            "--fsdp_sharding_strategy",
            "SHARD_GRAD_OP",
            "--fsdp_offload_params",
            "true",
            "--fsdp_backward_prefetch",
            "BACKWARD_PRE",
        ],
        vec!["--config_file", &fsdp2],
        vec!["--config_file", &ds],
        vec!["--config_file", &ds, "--use_fsdp"],
        vec!["--config_file", &multi, "--use_deepspeed"],
        vec!["--config_file", &ds_int],
        vec!["--config_file", &ds_text],
        vec!["--use_deepspeed", "--gradient_clipping", "1e-5"],
        vec!["--config_file", &fsdp_light],
        vec!["--config_file", &fsdp1],
        // A flag's text `false` is true to accelerate's check: not refused.
        vec!["--use_fsdp", "--fsdp_sync_module_states", "false"],
    ];
    for line in &lines {
        let want = theirs(line);
        assert!(want.len() >= 2, "{line:?}: {want:?}");
        assert_eq!(ours(line), want, "{line:?}");
    }
    // The file's `false` with the low-memory loading on (its default): both refuse it.
    let refused = file("unsynced.yaml", unsynced);
    let line = ["--config_file", refused.as_str(), "--num_processes", "1"];
    let out = std::process::Command::new(&python)
        .args([
            "-c",
            program,
            &serde_json::to_string(&[&line[..], &["train.py"]].concat()).unwrap(),
        ])
        .env("HF_HOME", &hf)
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("set `--fsdp_sync_module_states` to `True`"),
        "accelerate: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut cmd = launch_cmd(&[&line[..], &["--no-python", "env"]].concat());
    cmd.env("HF_HOME", &hf);
    let out = wait_output(cmd.spawn().unwrap(), Duration::from_secs(60));
    out.assert_code(2);
    out.assert_stderr_all(&[
        refused.as_str(),
        "fsdp_config.sync_module_states False with --fsdp_cpu_ram_efficient_loading true (its default): accelerate refuses this",
    ]);
}

/// The guide's accelerate line (docs/guide.md, "Coming from torchrun or accelerate"), run as a
/// dry run: 16 processes over 2 machines are 8 on this one, node rank 1, the master given, and
/// no secret: the warning.
#[test]
fn the_guides_accelerate_line_plans_as_accelerate_would() {
    const LINE: &str = "launch --multi_gpu --num_machines 2 --machine_rank 1 --main_process_ip 10.0.0.1 --main_process_port 29500 --num_processes 16 --mixed_precision bf16 train.py --lr 3e-4";
    let guide = std::fs::read_to_string(repo_root().join("docs/guide.md")).unwrap();
    let block = guide
        .split("# accelerate's two-machine line, on machine 1\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("the accelerate block in docs/guide.md");
    let line = block.replace("\\\n", " ");
    let words: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(words.join(" "), LINE, "the guide's line changed");
    let work = tempfile::tempdir().unwrap();
    std::fs::write(work.path().join("train.py"), "").unwrap();
    let mut args = vec!["--dry-run"];
    args.extend(&words[1..]);
    let mut cmd = launch_cmd(&args);
    cmd.current_dir(work.path())
        .env("HF_HOME", work.path().join("hf"));
    let out = wait_output(cmd.spawn().unwrap(), Duration::from_secs(60));
    out.assert_code(0);
    out.assert_stdout_all(&[
        "world size:   16 = 2 node(s) x 8 process(es); this node: rank 1 of 2",
        "master addr:  10.0.0.1",
        "master port:  29500",
        "ACCELERATE_MIXED_PRECISION=bf16",
        "traffic is unauthenticated",
    ]);
}

/// A run's metrics as TensorBoard scalars: the event files under `<run dir>/tensorboard`, read
/// back by TensorBoard's own reader (`EventAccumulator`), hold every step record's loss and each
/// evaluation's metrics at their steps, equal to `metrics.jsonl`'s, each step once across a
/// crash and its resume.
#[test]
fn tensorboards_reader_reads_the_runs_scalars() {
    let Some(python) = venv_with("tensorboard") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut args: Vec<String> = vec![
        "--num-processes".into(),
        "2".into(),
        "configs/default.toml".into(),
    ];
    args.extend(tiny_bpr_sets(dir.path()));
    for set in ["train.epochs=2", "checkpoint.every_n_steps=10"] {
        args.extend(["--set".into(), set.into()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // Rank 1 dies before step 25: steps 21-24 were logged after the checkpoint of step 20, and
    // the rerun writes them again; TensorBoard must show each step once.
    let mut cmd = launch_cmd(&args);
    cmd.env("GPTREC_FAULT_DIE", "25@1");
    let out = wait_output(cmd.spawn().unwrap(), Duration::from_secs(300));
    assert_ne!(out.code(), Some(0), "{}", out.all());
    let out = launch(&args, Duration::from_secs(300));
    out.assert_code(0);
    out.assert_stderr("resuming from");
    let run = dir.path().join("default");
    let reader = [
        "import sys, json",
        "from tensorboard.backend.event_processing.event_accumulator import EventAccumulator",
        "ea = EventAccumulator(sys.argv[1]); ea.Reload()",
        "tags = ea.Tags()['scalars']",
        "print(json.dumps({t: [[e.step, e.value] for e in ea.Scalars(t)] for t in tags}))",
    ]
    .join("\n");
    let read = std::process::Command::new(&python)
        .args(["-c", &reader])
        .arg(run.join("tensorboard"))
        .output()
        .unwrap();
    assert!(
        read.status.success(),
        "{}",
        String::from_utf8_lossy(&read.stderr)
    );
    let scalars: serde_json::Value = serde_json::from_slice(&read.stdout).unwrap();
    let records: Vec<serde_json::Value> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let of = |kind: &str, split: Option<&str>| -> Vec<&serde_json::Value> {
        let split_is = |r: &serde_json::Value| split.is_none_or(|s| r["split"] == s);
        records
            .iter()
            .filter(|r| r["kind"] == kind && split_is(r))
            .collect()
    };
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b.abs().max(1.0);
    let losses = scalars["train/loss"].as_array().expect("train/loss");
    let steps = of("step", None);
    assert_eq!(losses.len(), steps.len(), "{scalars}");
    assert!(steps.len() > 25, "{} steps", steps.len());
    for (point, record) in losses.iter().zip(&steps) {
        assert_eq!(point[0], record["step"]);
        assert!(
            close(point[1].as_f64().unwrap(), record["loss"].as_f64().unwrap()),
            "{point} vs {record}"
        );
    }
    for split in ["valid", "test"] {
        let evals = of("eval", Some(split));
        assert!(!evals.is_empty(), "no {split} record");
        let points = scalars[format!("{split}/ndcg@10")].as_array().expect(split);
        assert_eq!(points.len(), evals.len());
        let last = evals.last().unwrap();
        let point = points.last().unwrap();
        assert_eq!(point[0], last["step"]);
        assert!(close(
            point[1].as_f64().unwrap(),
            last["ndcg@10"].as_f64().unwrap()
        ));
    }
    assert!(scalars.get("valid_pop/ndcg@10").is_some(), "{scalars}");
}

/// A rank that was stopped (SIGSTOP) when the teardown began is named as the rank that stopped
/// answering, not only as one that launch killed.
#[test]
fn a_stopped_rank_is_named_as_stopped() {
    let script = "if [ $RANK = 1 ]; then kill -STOP $$; fi; sleep 1; exit 3";
    let args = [
        "--num-processes",
        "2",
        "--grace-period",
        "1",
        "--",
        "sh",
        "-c",
        script,
    ];
    let out = launch(&args, Duration::from_secs(60));
    out.assert_code(3);
    out.assert_stderr_all(&[
        "  root cause: rank 0 ",
        "SIGKILL from launch after the grace period); it was stopped (SIGSTOP) when the teardown began: it had stopped answering",
    ]);
}
