//! The c10d client against PyTorch's own `TCPStore` server (torch 2.11.0 from the venv that
//! `scripts/setup.sh` installs, named by GPTREC_TORCH_VENV; without it those tests say so and
//! pass as skipped), both its libuv and its classic backend; and against fake servers that send
//! junk or go silent.

use super::*;
use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// A `TCPStore` server in Python that also obeys commands on stdin (`set KEY HEX`, `get KEY`,
/// `add KEY N`, answered on stdout), so that both sides of the wire are checked.
const SERVER_PY: &str = r#"
import datetime, sys
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      use_libuv=sys.argv[1] == "1", timeout=datetime.timedelta(seconds=10))
print(store.port, flush=True)
for line in sys.stdin:
    op, key, *arg = line.split()
    try:
        if op == "set":
            store.set(key, bytes.fromhex(arg[0] if arg else ""))
            # SET has no answer: a CHECK on the same connection returns once it is applied.
            store.check([key])
            print("ok", flush=True)
        elif op == "get":
            print(store.get(key).hex() or "-", flush=True)
        elif op == "add":
            print(store.add(key, int(arg[0])), flush=True)
    except Exception as e:
        print("error:", str(e).splitlines()[0], flush=True)
"#;

/// PyTorch's server, alive while this test process is (it exits when its stdin closes).
struct PyStore {
    addr: String,
    stdin: ChildStdin,
    lines: Receiver<String>,
    _child: Child,
}

impl PyStore {
    fn start(libuv: bool) -> Option<PyStore> {
        let venv = std::path::PathBuf::from(std::env::var_os("GPTREC_TORCH_VENV")?);
        let python = venv.join("bin/python");
        if !python.is_file() {
            return None;
        }
        let mut child = Command::new(python)
            .args(["-c", SERVER_PY, if libuv { "1" } else { "0" }])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start python");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let port = lines
            .recv_timeout(Duration::from_secs(60))
            .expect("PyTorch's TCPStore started");
        Some(PyStore {
            addr: format!("127.0.0.1:{port}"),
            stdin: child.stdin.take().unwrap(),
            lines,
            _child: child,
        })
    }

    /// Runs one command in the server's own (PyTorch) client and returns its answer.
    fn py(&mut self, command: &str) -> String {
        writeln!(self.stdin, "{command}").unwrap();
        self.lines
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("python answers {command:?}"))
    }
}

/// The shared server of one backend (starting Python costs a second or two), or `None` after a
/// `skipped:` line when there is no venv.
fn py_store(libuv: bool) -> Option<MutexGuard<'static, PyStore>> {
    static STORES: [OnceLock<Option<Mutex<PyStore>>>; 2] = [OnceLock::new(), OnceLock::new()];
    let store = STORES[usize::from(libuv)].get_or_init(|| PyStore::start(libuv).map(Mutex::new));
    match store {
        Some(store) => Some(store.lock().unwrap_or_else(|e| e.into_inner())),
        None => {
            eprintln!("skipped: no PyTorch venv (GPTREC_TORCH_VENV; run scripts/setup.sh)");
            None
        }
    }
}

/// A key prefix no other test uses.
fn unique_prefix(tag: &str) -> String {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("test/{tag}-{n}/")
}

fn c10d_client(addr: &str, run_id: &str, prefix: &str) -> StoreClient {
    StoreClient::connect_agent_store(addr, run_id, prefix, Duration::from_secs(5)).unwrap()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Vec<u8> {
    if text == "-" {
        return Vec::new();
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}

fn set_get_add_round_trip(libuv: bool) {
    let Some(mut py) = py_store(libuv) else {
        return;
    };
    let prefix = unique_prefix("ops");
    let mut store = c10d_client(&py.addr, "run-1", &prefix);
    assert!(store.is_agent_store());
    store.set("tcp/secret", b"ring secret").unwrap();
    assert_eq!(
        store.get("tcp/secret").unwrap(),
        Some(b"ring secret".to_vec())
    );
    assert_eq!(store.get("never/set").unwrap(), None);
    // What PyTorch's own client reads under our key: sealed, the plaintext nowhere in it, and
    // it opens under that key with the run's key (so our SET put key and value where PyTorch
    // looks for them).
    let raw = unhex(&py.py(&format!("get {prefix}tcp/secret")));
    assert_eq!(raw.len(), seal::OVERHEAD + 11, "{raw:?}");
    assert!(!raw.windows(11).any(|w| w == b"ring secret"));
    let seal = seal::Seal::new("run-1");
    let opened = seal.open(&format!("/{prefix}tcp/secret"), &raw);
    assert_eq!(opened.as_deref(), Some(&b"ring secret"[..]));
    // A value PyTorch's client writes, sealed by us, reads back through our GET.
    let sealed = seal
        .seal(&format!("/{prefix}from/python"), b"10.0.0.2:4000")
        .unwrap();
    assert_eq!(
        py.py(&format!("set {prefix}from/python {}", hex(&sealed))),
        "ok"
    );
    assert_eq!(
        store.get("from/python").unwrap(),
        Some(b"10.0.0.2:4000".to_vec())
    );
    // Counters: ours and PyTorch's add to the same decimal text.
    assert_eq!(store.add("joined", 5).unwrap(), 5);
    assert_eq!(store.add("joined", -7).unwrap(), -2);
    assert_eq!(py.py(&format!("add {prefix}joined 10")), "8");
    assert_eq!(store.add("joined", 0).unwrap(), 8);
    // A value someone outside the run wrote is refused, and the connection stays usable.
    assert_eq!(
        py.py(&format!("set {prefix}tcp/addr/1 {}", hex(b"6.6.6.6:1"))),
        "ok"
    );
    let err = store.get("tcp/addr/1").unwrap_err();
    assert!(matches!(err, StoreError::Unsealed { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("\"tcp/addr/1\"") && text.contains(&py.addr),
        "{text}"
    );
    let err = store
        .wait(&["tcp/addr/1"], Duration::from_secs(1))
        .unwrap_err();
    assert!(matches!(err, StoreError::Unsealed { .. }), "{err:?}");
    assert_eq!(
        store.get("tcp/secret").unwrap(),
        Some(b"ring secret".to_vec())
    );
}

#[test]
fn c10d_set_get_and_add_agree_with_pytorchs_libuv_server() {
    set_get_add_round_trip(true);
}

#[test]
fn c10d_set_get_and_add_agree_with_pytorchs_classic_server() {
    set_get_add_round_trip(false);
}

fn wait_for_keys_set_later(libuv: bool) {
    let Some(py) = py_store(libuv) else {
        return;
    };
    let addr = py.addr.clone();
    drop(py);
    let prefix = unique_prefix("wait");
    let mut waiter = c10d_client(&addr, "run", &prefix);
    let mut writer = c10d_client(&addr, "run", &prefix);
    let started = Instant::now();
    let setter = thread::spawn(move || {
        thread::sleep(Duration::from_millis(200));
        writer.set("rank/2", b"c").unwrap();
        writer.set("rank/1", b"b").unwrap();
        writer
    });
    let values = waiter
        .wait(&["rank/1", "rank/2"], Duration::from_secs(5))
        .unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(190),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(values, vec![b"b".to_vec(), b"c".to_vec()]);
    setter.join().unwrap();
    // Keys that exist already: at once.
    let started = Instant::now();
    assert_eq!(
        waiter.wait(&["rank/2"], Duration::from_secs(5)).unwrap(),
        vec![b"c".to_vec()]
    );
    assert!(started.elapsed() < Duration::from_millis(500));
    assert_eq!(
        waiter.wait(&[], Duration::from_secs(5)).unwrap(),
        Vec::<Vec<u8>>::new()
    );
}

#[test]
fn c10d_wait_returns_values_set_later_by_another_client_libuv() {
    wait_for_keys_set_later(true);
}

#[test]
fn c10d_wait_returns_values_set_later_by_another_client_classic() {
    wait_for_keys_set_later(false);
}

fn wait_for_a_key_that_never_comes(libuv: bool) {
    let Some(py) = py_store(libuv) else {
        return;
    };
    let addr = py.addr.clone();
    drop(py);
    let prefix = unique_prefix("never");
    let mut store = c10d_client(&addr, "run", &prefix);
    store.set("here", b"x").unwrap();
    let timeout = Duration::from_millis(300);
    let started = Instant::now();
    let err = store.wait(&["here", "never"], timeout).unwrap_err();
    let elapsed = started.elapsed();
    assert!(elapsed >= timeout, "{elapsed:?}");
    assert!(elapsed < timeout + Duration::from_secs(1), "{elapsed:?}");
    let StoreError::WaitTimeout { missing, .. } = &err else {
        panic!("{err:?}");
    };
    assert_eq!(missing, &vec!["never".to_string()]);
    let text = err.to_string();
    assert!(
        text.starts_with("timed out after 0.3 s waiting for store keys [\"never\"]"),
        "{text}"
    );
    // The cancelled wait leaves the connection usable, and no stale answer behind: a key that
    // comes later wakes a new wait, and the next answers line up.
    assert_eq!(store.get("here").unwrap(), Some(b"x".to_vec()));
    let mut other = c10d_client(&addr, "run", &prefix);
    let setter = thread::spawn(move || {
        thread::sleep(Duration::from_millis(100));
        other.set("never", b"late").unwrap();
    });
    let values = store
        .wait(&["never", "here"], Duration::from_secs(5))
        .unwrap();
    assert_eq!(values, vec![b"late".to_vec(), b"x".to_vec()]);
    setter.join().unwrap();
    assert_eq!(store.add("n", 1).unwrap(), 1);
}

#[test]
fn c10d_wait_for_a_key_that_never_comes_times_out_naming_it_libuv() {
    wait_for_a_key_that_never_comes(true);
}

#[test]
fn c10d_wait_for_a_key_that_never_comes_times_out_naming_it_classic() {
    wait_for_a_key_that_never_comes(false);
}

#[test]
fn c10d_values_sealed_with_another_run_id_do_not_open() {
    let Some(py) = py_store(true) else {
        return;
    };
    let addr = py.addr.clone();
    drop(py);
    let prefix = unique_prefix("runs");
    let mut ours = c10d_client(&addr, "run-a", &prefix);
    let mut theirs = c10d_client(&addr, "run-b", &prefix);
    ours.set("tcp/secret", b"s").unwrap();
    let err = theirs.get("tcp/secret").unwrap_err();
    assert!(matches!(err, StoreError::Unsealed { .. }), "{err:?}");
    // Nor does a value moved to another key by someone who can write the store.
    theirs.set("x", b"y").unwrap();
    assert_eq!(ours.get("tcp/secret").unwrap(), Some(b"s".to_vec()));
}

#[test]
fn c10d_ephemeral_keys_are_deleted_when_their_client_is_dropped() {
    let Some(py) = py_store(true) else {
        return;
    };
    let addr = py.addr.clone();
    drop(py);
    let prefix = unique_prefix("ephemeral");
    let mut owner = c10d_client(&addr, "run", &prefix);
    let mut other = c10d_client(&addr, "run", &prefix);
    owner.set_ephemeral("alive/0", b"yes").unwrap();
    owner.set("kept", b"1").unwrap();
    assert_eq!(other.get("alive/0").unwrap(), Some(b"yes".to_vec()));
    drop(owner);
    assert_eq!(other.get("alive/0").unwrap(), None);
    assert_eq!(other.get("kept").unwrap(), Some(b"1".to_vec()));
}

#[test]
fn c10d_keys_and_values_over_the_servers_limits_are_refused_before_sending() {
    let Some(py) = py_store(true) else {
        return;
    };
    let addr = py.addr.clone();
    drop(py);
    let mut store = c10d_client(&addr, "run", &unique_prefix("limits"));
    let long_key = "k".repeat(9 << 10);
    let err = store.set(&long_key, b"v").unwrap_err();
    assert!(matches!(err, StoreError::FrameTooLarge { .. }), "{err:?}");
    let err = store.set("big", &vec![0u8; 8 << 20]).unwrap_err();
    assert!(matches!(err, StoreError::FrameTooLarge { .. }), "{err:?}");
    store.set("small", b"ok").unwrap();
    assert_eq!(store.get("small").unwrap(), Some(b"ok".to_vec()));
    // The largest value the server takes goes through.
    let largest = vec![7u8; (8 << 20) - seal::OVERHEAD];
    store.set("largest", &largest).unwrap();
    assert_eq!(store.get("largest").unwrap(), Some(largest));
}

#[test]
fn rendezvous_under_torchrun_uses_the_agent_store_and_starts_none() {
    let Some(py) = py_store(true) else {
        return;
    };
    let port: u16 = py.addr.rsplit_once(':').unwrap().1.parse().unwrap();
    drop(py);
    let ranks: Vec<_> = (0..2u32)
        .map(|rank| {
            let mut env = worker_env(rank, 2, port, "torchrun-job");
            env.restart_count = 3;
            thread::spawn(move || {
                let (server, mut store) =
                    rendezvous_with(&env, true, Duration::from_secs(5)).unwrap();
                assert!(server.is_none(), "rank {rank} started a store");
                assert!(store.is_agent_store());
                store.set(&format!("rank/{rank}"), b"here").unwrap();
                let all = store
                    .wait(&["rank/0", "rank/1"], Duration::from_secs(5))
                    .unwrap();
                assert_eq!(all, vec![b"here".to_vec(), b"here".to_vec()]);
                // A second connection of the same rank (the leaders' ring does this) speaks
                // PyTorch's protocol again, under the same prefix.
                let mut again =
                    StoreClient::connect(store.addr(), "torchrun-job", Duration::from_secs(5))
                        .unwrap();
                assert!(again.is_agent_store());
                assert_eq!(again.get("rank/1").unwrap(), Some(b"here".to_vec()));
                store
            })
        })
        .collect();
    for rank in ranks {
        rank.join().unwrap();
    }
    // Everything went under this attempt's prefix, where PyTorch's client sees it.
    let mut py = py_store(true).unwrap();
    let raw = unhex(&py.py("get gptrec/attempt-3/rank/0"));
    assert_eq!(raw.len(), seal::OVERHEAD + 4);
}

#[test]
fn the_agent_store_variable_is_read_as_torchrun_writes_it() {
    for yes in ["True", "true", "TRUE", "1", " True\n"] {
        assert!(agent_store_requested(Some(yes)), "{yes:?}");
    }
    for no in ["False", "false", "0", "", "yes", "2"] {
        assert!(!agent_store_requested(Some(no)), "{no:?}");
    }
    assert!(!agent_store_requested(None));
}

/// A listener that accepts one connection, reads VALIDATE and PING, lets `behave` answer (or
/// not), then keeps the socket open until the client hangs up (3 s at most).
fn fake_c10d(behave: fn(&mut TcpStream, [u8; 4])) -> (String, thread::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let handle = thread::spawn(move || {
        let (mut peer, _) = listener.accept().unwrap();
        peer.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut hello = [0u8; 10];
        peer.read_exact(&mut hello).unwrap();
        assert_eq!(
            hello[..5],
            [0, 0xce, 0xf7, 0x85, 0x3c],
            "VALIDATE and its magic"
        );
        assert_eq!(hello[5], 13, "then PING");
        behave(&mut peer, hello[6..].try_into().unwrap());
        let _ = peer.read_to_end(&mut Vec::new());
    });
    (addr, handle)
}

/// Echoes the ping, then reads one query's first bytes.
fn pong_then_read(peer: &mut TcpStream, nonce: [u8; 4]) {
    peer.write_all(&nonce).unwrap();
    let mut query = [0u8; 9];
    peer.read_exact(&mut query).unwrap();
}

#[test]
fn c10d_a_silent_listener_is_given_up_after_the_handshake_timeout() {
    let (addr, fake) = fake_c10d(|_, _| {});
    let started = Instant::now();
    let err = StoreClient::connect_agent_store(&addr, "run", "p/", Duration::from_millis(1500))
        .unwrap_err();
    let elapsed = started.elapsed();
    assert!(matches!(err, StoreError::Silent { .. }), "{err:?}");
    assert!(elapsed < Duration::from_millis(2500), "{elapsed:?}");
    assert!(err.to_string().starts_with(&addr), "{err}");
    fake.join().unwrap();
}

#[test]
fn c10d_a_wrong_ping_answer_is_not_a_store() {
    let (addr, fake) = fake_c10d(|peer, nonce| {
        let wrong = u32::from_le_bytes(nonce).wrapping_add(1);
        peer.write_all(&wrong.to_le_bytes()).unwrap();
    });
    let err =
        StoreClient::connect_agent_store(&addr, "run", "p/", Duration::from_secs(3)).unwrap_err();
    assert!(matches!(err, StoreError::Protocol { .. }), "{err:?}");
    assert!(err.to_string().contains("PyTorch's TCPStore"), "{err}");
    fake.join().unwrap();
}

#[test]
fn c10d_junk_answers_are_errors_and_give_the_connection_up() {
    // A CHECK answered with a byte that is neither READY nor NOT_READY.
    let (addr, fake) = fake_c10d(|peer, nonce| {
        pong_then_read(peer, nonce);
        peer.write_all(&[7]).unwrap();
    });
    let mut store = c10d_client(&addr, "run", "p/");
    let err = store.get("k").unwrap_err();
    assert!(matches!(err, StoreError::Protocol { .. }), "{err:?}");
    assert!(err.to_string().contains("check answered with 7"), "{err}");
    assert!(matches!(
        store.get("k").unwrap_err(),
        StoreError::Broken { .. }
    ));
    drop(store);
    fake.join().unwrap();

    // A value announced at 2^64 - 1 bytes: refused from its length, nothing allocated.
    let (addr, fake) = fake_c10d(|peer, nonce| {
        pong_then_read(peer, nonce);
        peer.write_all(&[READY_BYTE]).unwrap();
        let mut get = [0u8; 9];
        peer.read_exact(&mut get).unwrap();
        peer.write_all(&u64::MAX.to_le_bytes()).unwrap();
    });
    let mut store = c10d_client(&addr, "run", "p/");
    let err = store.get("k").unwrap_err();
    assert!(matches!(err, StoreError::Protocol { .. }), "{err:?}");
    assert!(err.to_string().contains("over the"), "{err}");
    drop(store);
    fake.join().unwrap();
}

/// CHECK's answer for "every key exists".
const READY_BYTE: u8 = 0;

#[test]
fn c10d_a_store_that_stops_answering_is_an_error_within_the_timeout() {
    let (addr, fake) = fake_c10d(pong_then_read);
    let mut store = c10d_client(&addr, "run", "p/");
    store.set_io_timeout(Duration::from_millis(300)).unwrap();
    let started = Instant::now();
    let err = store.set("k", b"v").unwrap_err();
    assert!(matches!(err, StoreError::NoAnswer { .. }), "{err:?}");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    drop(store);
    fake.join().unwrap();
    // A wait whose cancel is never answered ends too.
    let (addr, fake) = fake_c10d(pong_then_read);
    let mut store = c10d_client(&addr, "run", "p/");
    store.set_io_timeout(Duration::from_millis(300)).unwrap();
    let started = Instant::now();
    let err = store.wait(&["k"], Duration::from_millis(200)).unwrap_err();
    assert!(matches!(err, StoreError::NoAnswer { .. }), "{err:?}");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    drop(store);
    fake.join().unwrap();
}

#[test]
fn c10d_client_against_our_own_store_fails_by_the_deadline() {
    let server = server("run");
    let started = Instant::now();
    let err = StoreClient::connect_agent_store(
        &server.local_addr().to_string(),
        "run",
        "p/",
        Duration::from_millis(600),
    )
    .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert!(
        err.to_string().contains(&server.local_addr().to_string()),
        "{err}"
    );
}
