//! The handshake: neither side learns or shows the run id, a server that cannot prove it is
//! refused at once, a recorded proof cannot be replayed, and a flood of idle sockets does not
//! delay a real client.

use super::*;
use std::sync::{Arc, Mutex};

/// A run id that stands out in a byte dump.
const SECRET: &str = "secret-run-id-7f3a9c0e51b2d84f";

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Reads one frame as it came (header and body), and the client's nonce if it was a `Hello`.
fn read_hello(peer: &mut TcpStream) -> (Vec<u8>, Option<auth::Nonce>) {
    let mut header = [0u8; 4];
    if peer.read_exact(&mut header).is_err() {
        return (Vec::new(), None);
    }
    let len = (u32::from_le_bytes(header) as usize).min(PRE_HELLO_MAX_FRAME);
    let mut frame = vec![0u8; 4 + len];
    frame[..4].copy_from_slice(&header);
    if peer.read_exact(&mut frame[4..]).is_err() {
        return (frame, None);
    }
    let nonce = match decode_body::<Request>(&frame[4..]) {
        Ok(Request::Hello { nonce, .. }) => Some(nonce),
        _ => None,
    };
    (frame, nonce)
}

/// What a fake server saw: the connections it accepted and every byte they sent it.
type Seen = Arc<Mutex<(usize, Vec<u8>)>>;

/// A listener that is not a store: for each connection, `answer` gets the client's nonce and
/// may write something back; then it records what else the client sends until it hangs up.
fn fake_server(answer: fn(&mut TcpStream, auth::Nonce)) -> (String, Seen, thread::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    listener.set_nonblocking(true).unwrap();
    let seen: Seen = Arc::default();
    let record = Arc::clone(&seen);
    let handle = thread::spawn(move || {
        let until = Instant::now() + Duration::from_secs(4);
        while Instant::now() < until {
            let Ok((mut peer, _)) = listener.accept() else {
                thread::sleep(Duration::from_millis(5));
                continue;
            };
            record.lock().unwrap().0 += 1;
            peer.set_nonblocking(false).unwrap();
            peer.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
            let (hello, nonce) = read_hello(&mut peer);
            if let Some(nonce) = nonce {
                answer(&mut peer, nonce);
            }
            let mut rest = Vec::new();
            let _ = peer.read_to_end(&mut rest);
            let mut seen = record.lock().unwrap();
            seen.1.extend(hello);
            seen.1.extend(rest);
        }
    });
    (addr, seen, handle)
}

#[test]
fn a_fake_server_with_a_random_proof_is_refused_at_once_and_never_retried() {
    let (addr, seen, fake) = fake_server(|peer, _| {
        let challenge = Response::Challenge {
            nonce: auth::nonce().unwrap(),
            proof: auth::nonce().unwrap(),
            fingerprint: run_fingerprint("someone-else"),
        };
        peer.write_all(&encode_frame(&challenge).unwrap()).unwrap();
    });
    let started = Instant::now();
    let err = StoreClient::connect(&addr, SECRET, Duration::from_secs(3)).unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    assert!(matches!(err, StoreError::WrongRun { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.starts_with(&format!(
            "{addr} does not know this job's run id (it could not prove it): another job or an \
             impostor holds that port (it claims run id fingerprint {}; ours is {};",
            run_fingerprint("someone-else"),
            run_fingerprint(SECRET)
        )),
        "{text}"
    );
    assert!(!text.contains('\n'), "{text}");
    fake.join().unwrap();
    let (connections, bytes) = seen.lock().unwrap().clone();
    assert_eq!(connections, 1, "the client retried the impostor");
    // It got the hello and nothing more: no proof, let alone the id.
    assert!(bytes.len() < 60, "{} bytes", bytes.len());
    assert!(!contains(&bytes, SECRET.as_bytes()));
}

#[test]
fn a_silent_listener_is_given_up_after_the_handshake_timeout_not_retried() {
    let (addr, seen, fake) = fake_server(|peer, _| {
        thread::sleep(Duration::from_secs(3));
        let _ = peer.shutdown(Shutdown::Both);
    });
    let started = Instant::now();
    let err = StoreClient::connect(&addr, SECRET, Duration::from_millis(1500)).unwrap_err();
    let elapsed = started.elapsed();
    assert!(elapsed >= Duration::from_millis(900), "{elapsed:?}");
    assert!(elapsed < Duration::from_millis(2500), "{elapsed:?}");
    assert!(matches!(err, StoreError::Silent { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.starts_with(&format!(
            "{addr} accepted the connection but did not answer the rendezvous store's handshake"
        )),
        "{text}"
    );
    assert!(!text.contains('\n'), "{text}");
    fake.join().unwrap();
    let (connections, bytes) = seen.lock().unwrap().clone();
    assert_eq!(connections, 1, "the client retried the silent listener");
    assert!(!contains(&bytes, SECRET.as_bytes()));
}

#[test]
fn a_client_of_another_run_fails_at_once_with_both_fingerprints() {
    let server = server("job-a");
    let addr = server.local_addr().to_string();
    let started = Instant::now();
    let err = StoreClient::connect(&addr, "job-b", Duration::from_secs(5)).unwrap_err();
    // Refused at once, not retried until the deadline.
    assert!(started.elapsed() < Duration::from_secs(1));
    let text = err.to_string();
    assert!(
        text.starts_with(&format!(
            "{addr} does not know this job's run id (it could not prove it): another job or an \
             impostor holds that port (it claims run id fingerprint {}; ours is {};",
            run_fingerprint("job-a"),
            run_fingerprint("job-b")
        )),
        "{text}"
    );
    assert!(!text.contains("job-a"), "{text}");
    assert_ne!(run_fingerprint("job-a"), run_fingerprint("job-b"));
    assert_eq!(run_fingerprint("job-a").len(), "sha256:".len() + 12);
    // The server keeps serving its own run.
    let mut store = client(&server, "job-a");
    store.set("k", b"v").unwrap();
    assert_eq!(store.get("k").unwrap(), Some(b"v".to_vec()));
}

#[test]
fn a_client_that_cannot_prove_the_id_is_refused_and_closed() {
    let server = server(SECRET);
    let mut stream = raw(&server);
    let (client_nonce, server_nonce) = hello(&mut stream, SECRET);
    let wrong = auth::Key::new("a-guess").client_proof(&client_nonce, &server_nonce);
    send(&mut stream, &Request::Proof { proof: wrong });
    assert_eq!(
        receive(&mut stream),
        Response::Refused {
            reason: "the run id was not proven".into()
        }
    );
    assert_closed_by_server(stream);
    // A request instead of the proof is refused too.
    let mut stream = raw(&server);
    hello(&mut stream, SECRET);
    send(&mut stream, &Request::Get { key: "k".into() });
    assert!(matches!(receive(&mut stream), Response::Refused { .. }));
    assert_closed_by_server(stream);
    assert_eq!(server.ungreeted(), 0);
    client(&server, SECRET).set("k", b"v").unwrap();
}

#[test]
fn a_replayed_client_proof_is_refused() {
    let server = server(SECRET);
    // What an observer recorded of a good connection: its hello and its proof.
    let mut first = raw(&server);
    let (client_nonce, first_server_nonce) = hello(&mut first, SECRET);
    let proof = auth::Key::new(SECRET).client_proof(&client_nonce, &first_server_nonce);
    send(&mut first, &Request::Proof { proof });
    assert_eq!(receive(&mut first), Response::Welcome);
    // Replayed on a new connection: the server's nonce is fresh, so the proof does not fit.
    let mut replay = raw(&server);
    send(
        &mut replay,
        &Request::Hello {
            protocol: PROTOCOL,
            nonce: client_nonce,
        },
    );
    let Response::Challenge { nonce, .. } = receive(&mut replay) else {
        panic!("no challenge");
    };
    assert_ne!(nonce, first_server_nonce);
    send(&mut replay, &Request::Proof { proof });
    assert!(matches!(receive(&mut replay), Response::Refused { .. }));
    assert_closed_by_server(replay);
}

/// Relays one connection to `target`, recording what goes each way.
fn observer(target: SocketAddr) -> (String, Arc<Mutex<Vec<u8>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let seen: Arc<Mutex<Vec<u8>>> = Arc::default();
    let record = Arc::clone(&seen);
    thread::spawn(move || {
        let (client, _) = listener.accept().unwrap();
        let server = TcpStream::connect(target).unwrap();
        let pipes = [
            (client.try_clone().unwrap(), server.try_clone().unwrap()),
            (server, client),
        ];
        for (mut from, mut to) in pipes {
            let record = Arc::clone(&record);
            thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = from.read(&mut buf) {
                    record.lock().unwrap().extend_from_slice(&buf[..n]);
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = to.shutdown(Shutdown::Write);
            });
        }
    });
    (addr, seen)
}

#[test]
fn an_observer_of_the_handshake_never_sees_the_run_id() {
    let server = server(SECRET);
    let (addr, seen) = observer(server.local_addr());
    let mut store = StoreClient::connect(&addr, SECRET, Duration::from_secs(2)).unwrap();
    store.set("k", b"v").unwrap();
    assert_eq!(store.get("k").unwrap(), Some(b"v".to_vec()));
    drop(store);
    thread::sleep(Duration::from_millis(100));
    let bytes = seen.lock().unwrap().clone();
    // Hello, challenge, proof and welcome went through, and then the requests.
    assert!(bytes.len() > 150, "{} bytes", bytes.len());
    assert!(!contains(&bytes, SECRET.as_bytes()));
    assert!(!contains(&bytes, &SECRET.as_bytes()[..12]));
    assert!(!contains(&bytes, SECRET.to_uppercase().as_bytes()));
}

#[test]
fn forty_idle_sockets_do_not_delay_a_real_client() {
    let server = server("run");
    let target = server.local_addr();
    let idle: Vec<TcpStream> = (0..40).map(|_| raw(&server)).collect();
    thread::sleep(Duration::from_millis(100));
    // And a flooder that keeps opening more while the real clients connect.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flooding = Arc::clone(&stop);
    let flooder = thread::spawn(move || {
        let mut held = std::collections::VecDeque::new();
        while !flooding.load(std::sync::atomic::Ordering::Relaxed) {
            if let Ok(s) = TcpStream::connect(target) {
                held.push_back(s);
            }
            if held.len() > 40 {
                held.pop_front();
            }
            thread::sleep(Duration::from_millis(2));
        }
    });
    for _ in 0..5 {
        let started = Instant::now();
        let mut store =
            StoreClient::connect(&target.to_string(), "run", Duration::from_secs(5)).unwrap();
        let took = started.elapsed();
        assert!(took < Duration::from_secs(1), "the handshake took {took:?}");
        store.set("k", b"v").unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    flooder.join().unwrap();
    assert!(server.ungreeted() <= MAX_UNGREETED_PER_IP);
    drop(idle);
}

#[test]
fn a_peer_trickling_its_hello_is_closed_at_the_deadline() {
    let deadline = Duration::from_millis(500);
    let server = StoreServer::start_with("127.0.0.1:0".parse().unwrap(), "run", deadline).unwrap();
    let mut stream = raw(&server);
    let started = Instant::now();
    stream.write_all(&100u32.to_le_bytes()).unwrap();
    // One byte every 50 ms: never a read timeout, never a complete frame.
    while started.elapsed() < Duration::from_secs(3) {
        if stream.write_all(&[0]).is_err() {
            break;
        }
        thread::sleep(Duration::from_millis(50));
        if server.ungreeted() == 0 {
            break;
        }
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(1500),
        "still open after {took:?}"
    );
    assert_eq!(server.ungreeted(), 0);
}

/// The listener `launch` holds for rank 0, bound but not yet served, as `GPTREC_STORE_HELD` names it.
fn held_listener() -> (TcpListener, HeldListener) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let held = HeldListener {
        addr,
        announce: true,
    };
    (listener, held)
}

#[test]
fn a_slow_rank_0_behind_the_listener_launch_holds_is_waited_for_until_it_serves() {
    let (listener, held) = held_listener();
    let addr = held.addr.to_string();
    // Rank 0 serves only after 11 s, past the handshake's 10 s limit (the old client took it
    // for a stranger then and failed for good, whatever the deadline).
    let rank0 = thread::spawn(move || {
        thread::sleep(HANDSHAKE_TIMEOUT + Duration::from_secs(1));
        StoreServer::from_listener(listener, SECRET).unwrap()
    });
    let started = Instant::now();
    let mut client = StoreClient::connect_held(&addr, SECRET, Duration::from_secs(30), held)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        started.elapsed() >= HANDSHAKE_TIMEOUT,
        "{:?}",
        started.elapsed()
    );
    let _server = rank0.join().unwrap();
    client.set("k", b"v").unwrap();
    assert_eq!(client.get("k").unwrap(), Some(b"v".to_vec()));
}

#[test]
fn a_held_listener_that_never_serves_fails_at_the_deadline_naming_rank_0() {
    let (_listener, held) = held_listener();
    let addr = held.addr.to_string();
    let started = Instant::now();
    let err =
        StoreClient::connect_held(&addr, SECRET, Duration::from_millis(2500), held).unwrap_err();
    let elapsed = started.elapsed();
    assert!(elapsed >= Duration::from_millis(2300), "{elapsed:?}");
    assert!(elapsed < Duration::from_millis(4500), "{elapsed:?}");
    assert!(matches!(err, StoreError::NotServing { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.starts_with(&format!(
            "rank 0's rendezvous store at {addr} (the port launch holds"
        )),
        "{text}"
    );
    assert!(!text.contains('\n'), "{text}");
}

#[test]
fn a_silent_stranger_elsewhere_is_refused_as_before_when_a_listener_is_held() {
    // launch holds one port; the address dialled is another one, silent: a stranger.
    let (_listener, held) = held_listener();
    let (addr, _seen, _fake) = fake_server(|_, _| thread::sleep(Duration::from_secs(4)));
    // (With this short deadline the handshake's own limit is the deadline: the kind of error
    // tells the two apart.)
    let err =
        StoreClient::connect_held(&addr, SECRET, Duration::from_millis(2000), held).unwrap_err();
    assert!(matches!(err, StoreError::Silent { .. }), "{err:?}");
}

#[test]
fn a_held_listener_on_every_address_holds_the_port_on_each() {
    let any = HeldListener {
        addr: "0.0.0.0:4000".parse().unwrap(),
        announce: false,
    };
    assert!(any.holds("127.0.0.1:4000".parse().unwrap()));
    assert!(any.holds("10.1.2.3:4000".parse().unwrap()));
    assert!(!any.holds("127.0.0.1:4001".parse().unwrap()));
    let one = HeldListener {
        addr: "127.0.0.1:4000".parse().unwrap(),
        announce: false,
    };
    assert!(one.holds("127.0.0.1:4000".parse().unwrap()));
    assert!(!one.holds("127.0.0.2:4000".parse().unwrap()));
}
