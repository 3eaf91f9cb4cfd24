//! The two compatibility promises of the environment contract, checked against real PyTorch:
//! a `torch.distributed` script with the default `env://` runs unchanged under `launch`, and our
//! `worker` runs unchanged under `torchrun`. They need the PyTorch that `scripts/setup.sh`
//! installs (found through GPTREC_TORCH_VENV, which setup writes into .cargo/config.toml); without
//! it they say so and pass as skipped.

mod support;

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use support::*;

/// The two tests run one at a time: under torchrun our store takes `MASTER_PORT + 1` (see
/// `runtime::store::store_port`), and the kernel hands out neighbouring ephemeral ports, so the
/// other test's `launch` picking exactly that port while both run is a real, if rare, collision.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn torch_venv() -> Option<PathBuf> {
    let venv = PathBuf::from(std::env::var_os("GPTREC_TORCH_VENV")?);
    venv.join("bin/python").is_file().then_some(venv)
}

/// Waits for the other test to finish (see [`ONE_AT_A_TIME`]) and finds the PyTorch venv: the
/// lock, held until dropped, and the venv; `None`, after a `skipped:` line, without a venv.
fn serial_torch_venv() -> Option<(MutexGuard<'static, ()>, PathBuf)> {
    let serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let Some(venv) = torch_venv() else {
        eprintln!("skipped: no PyTorch venv (run scripts/setup.sh)");
        return None;
    };
    Some((serial, venv))
}

#[test]
fn torch_distributed_script_runs_under_launch() {
    let Some((_serial, venv)) = serial_torch_venv() else {
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

#[test]
fn worker_runs_under_torchrun() {
    let Some((_serial, venv)) = serial_torch_venv() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let output_dir = format!("run.output_dir={:?}", dir.path().display().to_string());
    // torchrun's agent hosts its store on MASTER_PORT and ours takes the next port. With
    // `--standalone` torchrun picks MASTER_PORT among the ephemeral ports, where the next one
    // can be the local port of one of its own client connections (a flake seen in CI); a port
    // pair below the ephemeral range cannot be taken that way.
    let port = port_pair_below_ephemeral();
    let out = Command::new(venv.join("bin/torchrun"))
        .args(["--nnodes", "1", "--nproc-per-node", "2", "--no-python"])
        .args([
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port.to_string(),
        ])
        .arg(bin("worker"))
        .arg("configs/default.toml")
        .args([
            "--set",
            &output_dir,
            "--set",
            "data.synthetic=\"tiny\"",
            "--set",
            "train.epochs=1",
        ])
        .current_dir(repo_root())
        .output()
        .expect("run torchrun");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for rank in 0..2 {
        assert!(
            stdout.contains(&format!("worker rank {rank}/2 (local {rank}/2, node 0/1)")),
            "{stdout}"
        );
    }
    // torchrun does not set the CUDA allocator's configuration: the worker does, itself.
    assert_eq!(
        stdout
            .matches("PYTORCH_CUDA_ALLOC_CONF expandable_segments:True (set by the worker)")
            .count(),
        2,
        "{stdout}"
    );
    assert_eq!(
        stdout
            .matches("micro 96 x grad_accum 1 x world 2 = global 192")
            .count(),
        2,
        "{stdout}"
    );
}

/// A port P below Linux's ephemeral range (32768 and up) such that P and P + 1 are free now.
fn port_pair_below_ephemeral() -> u16 {
    let bindable = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos()
        ^ std::process::id();
    (0..2000u32)
        .map(|i| 20000 + ((seed.wrapping_add(i.wrapping_mul(7919))) % 12000) as u16)
        .find(|&p| bindable(p) && bindable(p + 1))
        .expect("a free port pair in 20000..32001")
}
