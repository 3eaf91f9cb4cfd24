//! The two compatibility promises of the environment contract, checked against real PyTorch:
//! a `torch.distributed` script with the default `env://` runs unchanged under `launch`, and our
//! `worker` runs unchanged under `torchrun`, rendezvousing through torchrun's own store (PyTorch's
//! TCPStore protocol on `MASTER_PORT`; no second port). They need the PyTorch that
//! `scripts/setup.sh` installs (found through GPTREC_TORCH_VENV, which setup writes into
//! .cargo/config.toml); without it they say so and pass as skipped.

mod support;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::*;

/// The venv with PyTorch 2.11.0; `None`, after a `skipped:` line, without one.
fn torch_venv() -> Option<PathBuf> {
    let venv = std::env::var_os("GPTREC_TORCH_VENV").map(PathBuf::from);
    let found = venv.filter(|venv| venv.join("bin/python").is_file());
    if found.is_none() {
        eprintln!("skipped: no PyTorch venv (run scripts/setup.sh)");
    }
    found
}

#[test]
fn torch_distributed_script_runs_under_launch() {
    let Some(venv) = torch_venv() else {
        return;
    };
    let python = venv.join("bin/python");
    let script = "import os, torch, torch.distributed as dist\n\
dist.init_process_group('gloo')\n\
t = torch.tensor([float(dist.get_rank() + 1)])\n\
dist.all_reduce(t)\n\
print(f'rank {dist.get_rank()} of {dist.get_world_size()} sum {t.item():.0f}', flush=True)\n\
dist.destroy_process_group()\n";
    let out = launch(
        &[
            "--num-processes",
            "3",
            "--master-port",
            "0",
            "--",
            python.to_str().unwrap(),
            "-c",
            script,
        ],
        Duration::from_secs(180),
    );
    assert_eq!(out.code(), Some(0), "{}\n{}", out.stdout, out.stderr);
    for rank in 0..3u32 {
        assert!(
            rank_lines(&out.stdout).contains(&(rank, format!("rank {rank} of 3 sum 6"))),
            "{}",
            out.stdout
        );
    }
}

/// `torchrun ARGS --no-python --nproc-per-node 2 worker configs/default.toml` on the tiny
/// synthetic data for one epoch, its files in `output_dir`; killed after 120 s.
fn torchrun_worker(venv: &Path, args: &[&str], output_dir: &Path) -> Output {
    torchrun_worker_with(venv, args, output_dir, &[])
}

/// [`torchrun_worker`] with `sets` added to the worker's command line.
fn torchrun_worker_with(venv: &Path, args: &[&str], output_dir: &Path, sets: &[&str]) -> Output {
    let output_dir = format!("run.output_dir={:?}", output_dir.display().to_string());
    let child = Command::new(venv.join("bin/torchrun"))
        .args(args)
        .args(["--nnodes", "1", "--nproc-per-node", "2", "--no-python"])
        .arg(bin("worker"))
        .arg("configs/default.toml")
        .args(["--set", &output_dir])
        .args([
            "--set",
            "data.synthetic=\"tiny\"",
            "--set",
            "train.epochs=1",
        ])
        .args(sets.iter().flat_map(|set| ["--set", set]))
        .current_dir(repo_root())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run torchrun");
    wait_output(child, Duration::from_secs(120))
}

/// What every successful run of [`torchrun_worker`] prints: both ranks, their batch plan, the
/// collective checked, and rank 0's line about torchrun's agent store at `store` (its address,
/// when known).
#[track_caller]
fn assert_trained_through_the_agent_store(out: &Output, store: Option<&str>) {
    let all = out.all();
    assert_eq!(out.code(), Some(0), "{all}");
    for rank in 0..2 {
        let line = format!("worker rank {rank}/2 (local {rank}/2, node 0/1)");
        assert!(out.stdout.contains(&line), "{all}");
    }
    let plan = "micro 96 x grad_accum 1 x world 2 = global 192";
    assert_eq!(out.stdout.matches(plan).count(), 2, "{all}");
    assert!(
        out.stdout.contains("all-reduce over 2 rank(s) checked"),
        "{all}"
    );
    let said = "rendezvous through torchrun's agent store at ";
    assert_eq!(out.stderr.matches(said).count(), 1, "{all}");
    if let Some(store) = store {
        assert!(out.stderr.contains(&format!("{said}{store} ")), "{all}");
    }
}

#[test]
fn worker_runs_under_torchrun() {
    let Some(venv) = torch_venv() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    // torchrun's static rendezvous (its default): the agent serves its store on MASTER_PORT.
    // The next port, where the worker used to start a store of its own, is held by someone
    // else here: the worker needs no port but torchrun's.
    let (port, _next_port_taken) = port_with_the_next_one_taken();
    let master_port = port.to_string();
    let args = ["--master-addr", "127.0.0.1", "--master-port", &master_port];
    let out = torchrun_worker(&venv, &args, dir.path());
    assert_trained_through_the_agent_store(&out, Some(&format!("127.0.0.1:{port}")));
    // torchrun does not set the CUDA allocator's configuration: the worker does, itself.
    let alloc = "PYTORCH_CUDA_ALLOC_CONF expandable_segments:True (set by the worker)";
    assert_eq!(out.stdout.matches(alloc).count(), 2, "{}", out.all());
    // torchrun's default run id is "none", which seals nothing: rank 0 says so, once.
    let warning = "the run id is torchrun's default \"none\"";
    assert_eq!(out.stderr.matches(warning).count(), 1, "{}", out.all());

    // Asked to require a secret, the worker refuses that public id before it joins.
    let dir = tempfile::tempdir().unwrap();
    let master_port = free_port().to_string();
    let args = ["--master-addr", "127.0.0.1", "--master-port", &master_port];
    let out = torchrun_worker_with(&venv, &args, dir.path(), &["dist.require_secret=true"]);
    assert_ne!(out.code(), Some(0), "{}", out.all());
    let refusal = "the run id is \"none\", which anyone can present, and dist.require_secret asks for a secret";
    assert!(out.stderr.contains(refusal), "{}", out.all());
}

/// torchrun's c10d rendezvous (`--standalone`: a free port, a random run id), ten runs in a row:
/// every one must pass (with a store of our own on the next port, about one in five failed).
#[test]
fn worker_runs_under_torchrun_ten_times_in_a_row() {
    let Some(venv) = torch_venv() else {
        return;
    };
    let mut took = Vec::new();
    for run in 1..=10 {
        let dir = tempfile::tempdir().unwrap();
        let started = Instant::now();
        let out = torchrun_worker(&venv, &["--standalone"], dir.path());
        took.push(started.elapsed().as_secs_f64());
        let all = out.all();
        assert_trained_through_the_agent_store(&out, None);
        assert!(!all.contains("torchrun's default"), "run {run}: {all}");
    }
    let total: f64 = took.iter().sum();
    eprintln!("10 of 10 torchrun runs passed in {total:.1} s: {took:.1?}");
}

/// A port below Linux's ephemeral range (32768 and up) that is free now, and a listener holding
/// the port after it.
fn port_with_the_next_one_taken() -> (u16, TcpListener) {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos()
        ^ std::process::id();
    (0..2000u32)
        .map(|i| 20000 + ((seed.wrapping_add(i.wrapping_mul(7919))) % 12000) as u16)
        .find_map(|p| {
            let free = TcpListener::bind(("127.0.0.1", p)).is_ok();
            let next = TcpListener::bind(("0.0.0.0", p + 1)).ok()?;
            free.then_some((p, next))
        })
        .expect("a free port pair in 20000..32001")
}
