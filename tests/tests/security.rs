//! No strangers in the job, end to end: several nodes need a shared secret (a run id file that
//! node 0 writes), and a flood of silent or oversized connections to a running job's store (or to
//! an elastic job's rendezvous endpoint) costs it nothing it needs and fills no log. (A stranger on
//! the ring is refused in the ring's own tests, which can reach its listening port.)

mod support;

use std::io::{Read as _, Write as _};
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
/// private secret there, node 1 waits for it, and they train as one world. Asked to require a
/// secret and given none, a multi-node launch refuses in one line that says how to share one.
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

    let bare: Vec<&str> = vec![
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--master-addr",
        "127.0.0.1",
        "--require-secret",
        "--",
        "true",
    ];
    let out = launch(&bare, Duration::from_secs(30));
    out.assert_code(2);
    out.assert_stderr_all(&["traffic is unauthenticated", "--run-id-file"]);
}

/// torchrun's static multi-node line with no secret anywhere (`--nnodes 2 --node-rank R
/// --master-addr --master-port --nproc-per-node 1`): the two nodes train as one world, as under
/// torchrun, and each says once that the run is unauthenticated, naming the endpoint given.
#[test]
fn torchruns_multi_node_line_runs_without_a_secret_and_warns_once_per_node() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port().to_string();
    let args = tiny_args(dir.path(), &[]);
    let nodes: Vec<_> = [0u32, 1]
        .iter()
        .map(|node| {
            let rank = node.to_string();
            let mut all: Vec<&str> = vec![
                "--nnodes",
                "2",
                "--node-rank",
                &rank,
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                &port,
                "--nproc-per-node",
                "1",
            ];
            all.extend(args.iter().map(String::as_str));
            launch_cmd(&all)
                .env_remove("LAUNCH_RUN_ID")
                .spawn()
                .expect("start launch")
        })
        .collect();
    let endpoint = format!("anyone who can reach 127.0.0.1:{port} can join it");
    for (node, child) in nodes.into_iter().enumerate() {
        let out = wait_output(child, Duration::from_secs(300));
        assert_eq!(out.code(), Some(0), "node {node}:\n{}", out.stderr);
        assert_eq!(
            out.stderr.matches("traffic is unauthenticated").count(),
            1,
            "node {node}:\n{}",
            out.stderr
        );
        assert!(
            out.stderr.contains(&endpoint),
            "node {node}:\n{}",
            out.stderr
        );
    }
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

/// A process that claims a rank of a running job with the wrong run id gives up at the store (which
/// cannot prove the stranger's id) and learns only a fingerprint, never the id; the job goes on.
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
    assert!(
        text.contains("does not know this job's run id (it could not prove it)"),
        "{text}"
    );
    assert!(
        !text.contains(&secret),
        "the stranger learned the run id:\n{text}"
    );
    let out = job.finish(Duration::from_secs(300));
    out.assert_code(0);
    assert!(!out.stdout.contains(&secret) && !out.stderr.contains(&secret));
}

/// Holds `count` idle connections to `port` until `stop`: each one the server closes is replaced
/// at once, as a stubborn flooder would. Returns how many it opened.
fn hold_idle_sockets(
    port: u16,
    count: usize,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let mut opened = 0;
        let mut held: Vec<TcpStream> = Vec::new();
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            held.retain(|s| {
                let _ = s.set_nonblocking(true);
                matches!((&*s).read(&mut [0u8; 64]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
            });
            while held.len() < count {
                match TcpStream::connect(("127.0.0.1", port)) {
                    Ok(s) => held.push(s),
                    Err(_) => break,
                }
                opened += 1;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        opened
    })
}

/// An elastic job of two nodes whose rendezvous endpoint is flooded with 40 idle sockets (each
/// one the store closes is reopened) from before the second node joins until the job ends: the
/// second node joins, the job finishes, the host's warnings about the flood are a few gathered
/// lines, and no ANSI escape reaches either node's (non-terminal) stderr.
#[test]
fn idle_sockets_on_the_rendezvous_endpoint_delay_no_joiner_and_fill_no_log() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let run_id = unique_run_id("rdzv-flood");
    let endpoint = format!("127.0.0.1:{port}");
    let node = |out: &str| {
        let mut args: Vec<String> = [
            "--nnodes",
            "2:3",
            "--num-processes",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            &endpoint,
            "--rdzv-id",
            &run_id,
            "--rdzv-conf",
            "last_call_timeout=1",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(tiny_args(
            &dir.path().join(out),
            &["train.epochs=10", "eval.patience=0"],
        ));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut cmd = launch_cmd(&args);
        // The store's debug lines carry fields, which a terminal would show in italics.
        cmd.env("OMP_NUM_THREADS", "1")
            .env("RUST_LOG", "info,store=debug");
        Live::new(cmd.spawn().expect("start launch"))
    };
    let host = node("host");
    let started = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(60) && !host.stderr_now().contains("error:"),
            "the rendezvous store never came up:\n{}",
            host.stderr_now()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood = hold_idle_sockets(port, 40, stop.clone());
    std::thread::sleep(Duration::from_millis(500));
    let joiner = node("joiner");
    let joined = Instant::now();
    host.wait_stderr("round 0: 2 node(s)", Duration::from_secs(120));
    let join_took = joined.elapsed();
    let out = host.finish(Duration::from_secs(300));
    let other = joiner.finish(Duration::from_secs(60));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let opened = flood.join().unwrap();
    out.assert_code(0);
    other.assert_code(0);
    assert!(opened >= 40, "the flood opened {opened} sockets");
    for (name, text) in [("host", &out.stderr), ("joiner", &other.stderr)] {
        assert!(
            !text.contains('\x1b'),
            "an ANSI escape in the {name}'s stderr:\n{text}"
        );
    }
    // One line per 5 s at most (and the first at once), however many sockets were refused.
    let warnings = out
        .stderr
        .lines()
        .filter(|l| l.contains("rendezvous store:"))
        .count();
    let bound = 2 + (out.elapsed.as_secs() / 5) as usize;
    assert!(
        warnings <= bound,
        "{warnings} warning lines in {:?} (at most {bound}), {opened} sockets:\n{}",
        out.elapsed,
        out.stderr
    );
    assert!(
        join_took < Duration::from_secs(20),
        "the joiner took {join_took:?} to form round 0"
    );
}
