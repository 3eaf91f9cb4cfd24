//! No strangers in the job, end to end: several nodes need a shared secret (a run id file that
//! node 0 writes), and a flood of silent or oversized connections to a running job's store
//! costs it nothing it needs. (A stranger on the ring is refused in the ring's own tests, which
//! can reach its listening port.)

mod support;

use std::io::Write as _;
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt as _;
use std::time::{Duration, Instant};

use support::*;

fn tiny_args(out: &std::path::Path, extra: &[&str]) -> Vec<String> {
    let mut args = vec!["configs/default.toml".to_string()];
    args.extend(tiny_bpr_sets(out));
    for e in extra {
        args.push("--set".into());
        args.push(e.to_string());
    }
    args
}

/// Two nodes (two `launch` processes on loopback) given only `--run-id-file`: node 0 writes a
/// private secret there, node 1 waits for it, and they train as one world. Without any run id,
/// a multi-node launch refuses in one line that says how to share one.
#[test]
fn several_nodes_share_a_secret_through_a_run_id_file() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port().to_string();
    let id_file = dir.path().join("shared/run-id");
    let id_flag = id_file.display().to_string();
    let args = tiny_args(dir.path(), &[]);
    let nodes: Vec<_> = [1, 0]
        .iter()
        .map(|node: &u32| {
            let rank = node.to_string();
            let mut all: Vec<&str> = vec![
                "--nnodes",
                "2",
                "--node-rank",
                &rank,
                "--num-processes",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                &port,
                "--run-id-file",
                &id_flag,
            ];
            all.extend(args.iter().map(String::as_str));
            let child = launch_cmd(&all).spawn().expect("start launch");
            // Node 1 first: it must wait for node 0 to write the file.
            std::thread::sleep(Duration::from_millis(300));
            child
        })
        .collect();
    for (i, child) in nodes.into_iter().enumerate() {
        let out = wait_output(child, Duration::from_secs(300));
        assert_eq!(out.code(), Some(0), "node {}:\n{}", 1 - i, out.stderr);
    }
    let mode = std::fs::metadata(&id_file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let secret = std::fs::read_to_string(&id_file).unwrap();
    assert_eq!(secret.trim().len(), 64);

    let bare: Vec<&str> = vec!["--nnodes", "2", "--master-addr", "127.0.0.1", "--", "true"];
    let out = launch(&bare, Duration::from_secs(30));
    out.assert_code(2);
    out.assert_stderr_all(&[
        "needs a secret run id shared by every node",
        "--run-id-file",
    ]);
}

/// A running job's store under a flood — 300 silent sockets and 8 that announce 63 MiB frames —
/// with rank 0 allowed only 200 open files: the job finishes, its checkpoints written.
#[test]
fn a_flood_of_strangers_does_not_starve_the_job() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let args = tiny_args(dir.path(), &["train.epochs=25", "eval.patience=0"]);
    let launch_bin = bin("launch").display().to_string();
    let script = format!(
        "ulimit -n 200 && exec {launch_bin} --num-processes 2 --master-port {port} --run-id {} {}",
        unique_run_id("flood"),
        args.iter()
            .map(|a| format!("'{a}'"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let mut cmd = std::process::Command::new("sh");
    cmd.args(["-c", &script])
        .current_dir(repo_root())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let job = Live::new(cmd.spawn().unwrap());
    // Wait for the store, then flood it.
    let started = Instant::now();
    let first = loop {
        if let Ok(s) = TcpStream::connect(("127.0.0.1", port)) {
            break s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no store came up"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut flood = vec![first];
    for _ in 0..300 {
        if let Ok(s) = TcpStream::connect(("127.0.0.1", port)) {
            flood.push(s);
        }
    }
    for _ in 0..8 {
        if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
            let _ = s.write_all(&(63u32 << 20).to_le_bytes());
            let _ = s.write_all(&[0u8; 65536]);
            flood.push(s);
        }
    }
    let out = job.finish(Duration::from_secs(300));
    drop(flood);
    out.assert_code(0);
    assert!(
        !out.stderr.contains("Too many open files"),
        "{}",
        out.stderr
    );
    assert!(dir.path().join("default/checkpoints/latest").is_file());
}

/// A process that claims a rank of a running job with the wrong run id is refused at the store
/// and learns only a fingerprint, never the id; the job goes on.
#[test]
fn a_worker_with_the_wrong_run_id_is_refused_without_learning_the_id() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let secret = unique_run_id("real");
    let args = tiny_args(dir.path(), &["train.epochs=25", "eval.patience=0"]);
    let mut all: Vec<String> = [
        "--num-processes",
        "2",
        "--master-port",
        &port.to_string(),
        "--run-id",
        &secret,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    all.extend(args.iter().cloned());
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    let job = Live::new(launch_cmd(&all).spawn().unwrap());
    job.wait_stderr("epoch 1/25", Duration::from_secs(120));
    let port_text = port.to_string();
    let env = [
        ("RANK", "1"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_WORLD_SIZE", "1"),
        ("GROUP_RANK", "1"),
        ("GROUP_WORLD_SIZE", "2"),
        ("ROLE_RANK", "1"),
        ("ROLE_WORLD_SIZE", "2"),
        ("ROLE_NAME", "default"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", port_text.as_str()),
        ("TORCHELASTIC_RESTART_COUNT", "0"),
        ("TORCHELASTIC_MAX_RESTARTS", "0"),
        ("TORCHELASTIC_RUN_ID", "a-guess"),
    ];
    let stranger = std::process::Command::new(bin("worker"))
        .arg("configs/default.toml")
        .args(tiny_bpr_sets(&dir.path().join("stranger")))
        .current_dir(repo_root())
        .envs(env)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&stranger.stdout),
        String::from_utf8_lossy(&stranger.stderr)
    );
    assert_ne!(stranger.status.code(), Some(0), "{text}");
    assert!(text.contains("belongs to another run"), "{text}");
    assert!(
        !text.contains(&secret),
        "the stranger learned the run id:\n{text}"
    );
    let out = job.finish(Duration::from_secs(300));
    out.assert_code(0);
    assert!(!out.stdout.contains(&secret) && !out.stderr.contains(&secret));
}
