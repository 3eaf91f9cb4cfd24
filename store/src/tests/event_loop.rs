//! The server's event loop: many connections on one thread, a write waking exactly the waits for
//! its key, pipelined and unread requests, and ephemeral keys under a wait.

use super::*;

/// Threads of this process now.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |dir| dir.count())
}

#[test]
fn one_write_answers_three_hundred_waits_and_the_server_keeps_one_thread() {
    let server = server("run");
    let before = threads();
    let clients: Vec<StoreClient> = (0..300).map(|_| client(&server, "run")).collect();
    assert!(
        threads() <= before + 1,
        "{} threads for 300 connections (had {before})",
        threads()
    );
    let waiters: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(i, mut store)| {
            thread::spawn(move || {
                // Each waits for the common key and its own, set before.
                store.set(&format!("own/{i}"), b"x").unwrap();
                let own = format!("own/{i}");
                store.wait(&["go", &own], Duration::from_secs(20)).unwrap()
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(200));
    let mut setter = client(&server, "run");
    assert_eq!(setter.get("go").unwrap(), None);
    setter.set("go", b"now").unwrap();
    for waiter in waiters {
        assert_eq!(waiter.join().unwrap(), vec![b"now".to_vec(), b"x".to_vec()]);
    }
}

#[test]
fn a_wait_answers_only_when_every_key_exists_at_once() {
    let server = server("run");
    let mut owner = client(&server, "run");
    let mut waiter = client(&server, "run");
    owner.set_ephemeral("e", b"1").unwrap();
    let waiting = thread::spawn(move || {
        let values = waiter.wait(&["e", "f"], Duration::from_secs(10));
        (values, waiter)
    });
    thread::sleep(Duration::from_millis(100));
    // `e` existed when the wait began; it is gone before `f` comes: the wait goes on.
    drop(owner);
    thread::sleep(Duration::from_millis(100));
    let mut other = client(&server, "run");
    other.add("f", 1).unwrap();
    thread::sleep(Duration::from_millis(100));
    assert!(!waiting.is_finished(), "answered while `e` was missing");
    other.set("e", b"2").unwrap();
    let (values, mut waiter) = waiting.join().unwrap();
    assert_eq!(values.unwrap(), vec![b"2".to_vec(), b"1".to_vec()]);
    // The connection goes on after its wait.
    assert_eq!(waiter.get("f").unwrap(), Some(b"1".to_vec()));
}

#[test]
fn a_timed_out_wait_leaves_no_registration_and_the_connection_usable() {
    let server = server("run");
    let mut store = client(&server, "run");
    for _ in 0..3 {
        let err = store
            .wait(&["never", "nor-this"], Duration::from_millis(50))
            .unwrap_err();
        assert!(err.to_string().contains("never"), "{err}");
    }
    store.set("never", b"now").unwrap();
    assert_eq!(store.get("never").unwrap(), Some(b"now".to_vec()));
}

/// Writes are not answered; the requests after them see them.
#[test]
fn pipelined_requests_are_answered_in_order() {
    let server = server("run");
    let mut stream = raw(&server);
    prove(&mut stream, "run");
    let mut frames = Vec::new();
    for request in [
        Request::Wait {
            keys: vec!["k".into()],
            timeout_ms: 5_000,
        },
        Request::Set {
            key: "w".into(),
            value: b"written".to_vec(),
        },
        Request::Get { key: "w".into() },
        Request::Get { key: "k".into() },
        Request::Add {
            key: "n".into(),
            delta: 2,
        },
    ] {
        frames.extend(encode_frame(&request).unwrap());
    }
    stream.write_all(&frames).unwrap();
    thread::sleep(Duration::from_millis(100));
    client(&server, "run").set("k", b"v").unwrap();
    assert_eq!(receive(&mut stream), Response::Values(vec![b"v".to_vec()]));
    assert_eq!(
        receive(&mut stream),
        Response::Value(Some(b"written".to_vec()))
    );
    assert_eq!(receive(&mut stream), Response::Value(Some(b"v".to_vec())));
    assert_eq!(receive(&mut stream), Response::Counter(2));
}

#[test]
fn a_peer_that_never_reads_its_answers_delays_no_one() {
    let server = server("run");
    let mut big = client(&server, "run");
    big.set("big", &vec![7u8; 4 << 20]).unwrap();
    // Writes are not answered: a request on the same connection makes sure it is in.
    assert!(big.get("big").unwrap().is_some());
    // A raw peer asks for 4 MiB forty times and reads nothing.
    let mut greedy = raw(&server);
    prove(&mut greedy, "run");
    let ask = encode_frame(&Request::Get { key: "big".into() }).unwrap();
    greedy
        .set_write_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    for _ in 0..40 {
        if greedy.write_all(&ask).is_err() {
            break;
        }
    }
    let started = Instant::now();
    let mut other = client(&server, "run");
    other.set("k", b"v").unwrap();
    assert_eq!(other.get("k").unwrap(), Some(b"v".to_vec()));
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    // It gets its answers when it reads them.
    assert!(matches!(receive(&mut greedy), Response::Value(Some(v)) if v.len() == 4 << 20));
}

#[test]
fn get_many_answers_every_key_in_order_in_one_request() {
    let server = server("run");
    let mut store = client(&server, "run");
    store.set("a", b"1").unwrap();
    store.add("c", 3).unwrap();
    assert_eq!(
        store.get_many(&["c", "b", "a"]).unwrap(),
        vec![Some(b"3".to_vec()), None, Some(b"1".to_vec())]
    );
    assert!(store.get_many(&[]).unwrap().is_empty());
}

#[test]
fn a_connection_that_ends_holding_its_will_leaves_it_and_the_first_stays() {
    let server = server("run");
    let mut watcher = client(&server, "run");
    let mut first = client(&server, "run");
    let mut second = client(&server, "run");
    let mut planned = client(&server, "run");
    first.set_will("a", "failed", b"first ended").unwrap();
    second.set_will("b", "failed", b"second ended").unwrap();
    planned.set_will("c", "failed", b"planned ended").unwrap();
    // Revoked from another connection (the one holding it may be parked in a wait).
    let mut other = client(&server, "run");
    other.revoke_will("c").unwrap();
    assert_eq!(other.get("failed").unwrap(), None);
    drop(planned);
    let waiting = thread::spawn(move || watcher.wait(&["failed"], Duration::from_secs(10)));
    thread::sleep(Duration::from_millis(100));
    assert!(!waiting.is_finished(), "a revoked will was written");
    drop(first);
    assert_eq!(
        waiting.join().unwrap().unwrap(),
        vec![b"first ended".to_vec()]
    );
    drop(second);
    thread::sleep(Duration::from_millis(100));
    assert_eq!(other.get("failed").unwrap(), Some(b"first ended".to_vec()));
}

#[test]
fn a_peer_that_closes_while_it_waits_leaves_its_will_at_once() {
    let server = server("run");
    let mut holder = client(&server, "run");
    holder.set_will("w", "failed", b"holder ended").unwrap();
    let closer = holder.closer().unwrap();
    let parked = thread::spawn(move || holder.wait(&["never"], Duration::from_secs(30)));
    thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    closer.close();
    let mut watcher = client(&server, "run");
    assert_eq!(
        watcher.wait(&["failed"], Duration::from_secs(5)).unwrap(),
        vec![b"holder ended".to_vec()]
    );
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    assert!(parked.join().unwrap().is_err());
}

#[test]
fn a_descriptor_limit_short_of_two_a_rank_is_named_with_what_is_needed() {
    assert_eq!(server::descriptor_warning(20_000, 8192, 1024), None);
    let warning = server::descriptor_warning(1024, 1024, 128).unwrap();
    assert!(
        warning.contains("may open 1024") && warning.contains("1024 ranks needs about 2240"),
        "{warning}"
    );
}

#[test]
fn a_key_named_many_times_is_refused_before_its_value_is_copied_and_the_connection_lives() {
    // 100 mentions of a 1 MiB key would be a 100 MiB answer: refused from the sizes alone (the
    // server used to build it, copying the value per mention, then close the connection).
    let server = server("run");
    let mut store = client(&server, "run");
    store.set("big", &vec![7u8; 1 << 20]).unwrap();
    let keys = vec!["big"; 100];
    for refused in [
        store.get_many(&keys).unwrap_err(),
        store.wait(&keys, Duration::from_secs(5)).unwrap_err(),
    ] {
        let text = refused.to_string();
        assert!(
            text.contains("over the 64 MiB limit of one message"),
            "{text}"
        );
    }
    // A parked wait whose keys come later is refused the same way when they do.
    let mut writer = client(&server, "run");
    let waiting = thread::spawn(move || {
        let mut keys = vec!["later"; 70];
        keys.push("big");
        let answer = store.wait(&keys, Duration::from_secs(10));
        (answer.map(|v| v.len()), store)
    });
    thread::sleep(Duration::from_millis(100));
    writer.set("later", &vec![1u8; 1 << 20]).unwrap();
    let (answer, mut store) = waiting.join().unwrap();
    assert!(answer
        .unwrap_err()
        .to_string()
        .contains("limit of one message"));
    // The connection still answers, and a fitting request is served.
    assert_eq!(store.get_many(&["big", "big"]).unwrap().len(), 2);
    assert_eq!(store.get("big").unwrap().map(|v| v.len()), Some(1 << 20));
}

#[test]
fn ending_a_wait_that_names_a_key_many_times_stalls_no_one() {
    // Two waits name one key 80,000 times each (a 160 KB request); ending the short one used to
    // walk the other's registrations once per mention (seconds of a stalled event loop, every
    // client waiting with it); now it costs its own keys.
    let server = server("run");
    let many = vec!["never"; 80_000];
    let mut long = client(&server, "run");
    let parked = thread::spawn(move || {
        let keys = vec!["never"; 80_000];
        long.wait(&keys, Duration::from_secs(60)).map(|v| v.len())
    });
    thread::sleep(Duration::from_millis(300));
    let mut short = client(&server, "run");
    let started = Instant::now();
    let err = short.wait(&many, Duration::from_millis(200)).unwrap_err();
    assert!(matches!(err, StoreError::WaitTimeout { .. }), "{err:?}");
    let mut other = client(&server, "run");
    assert_eq!(other.get("x").unwrap(), None);
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(3),
        "the server stalled: {took:?}"
    );
    // The long wait is still registered, once, and is answered with one value per mention.
    other.set("never", b"v").unwrap();
    assert_eq!(parked.join().unwrap().unwrap(), 80_000);
}
