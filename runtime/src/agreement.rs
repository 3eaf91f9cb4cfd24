//! The start-up agreement of a multi-node job: before any collective is set up, every rank
//! shows the terms it runs with (what must be the same on every node: the caller decides,
//! e.g. `common::job_terms`), and one process per global rank is admitted. A node started
//! with another config, other data or another worker build fails the job at once on every
//! rank with one line naming the keys and both values, instead of training a different model
//! beside the others; a second process claiming a taken rank (an overlapping `--node-rank`)
//! is refused alone, and the job goes on with the first.
//!
//! This module owns the store keys `agree/*` and the verdict; it must not know what the
//! terms mean. Cost: two store round trips per rank and one wait on every rank's key at rank 0.

use std::collections::BTreeMap;
use std::time::Duration;

use common::env_contract::WorkerEnv;
use common::job_terms::{self, Terms};
use store::{StoreClient, StoreError};

const VERDICT: &str = "agree/verdict";
const VERDICT_CLAIM: &str = "agree/verdict-claim";
const OK: &[u8] = b"ok";
const VERDICT_READ: &str = "agree/verdict-read";
const ALL_READ: &str = "agree/verdict-read-by-all";
/// How long rank 0 keeps the store up for the others to read a disagreement.
const READ_GRACE: Duration = Duration::from_secs(5);
/// How often rank 0, waiting for every rank's answer, looks for a verdict published meanwhile.
const VERDICT_POLL: Duration = Duration::from_millis(200);
/// How many differing keys the line names before "and N more".
const NAMED_KEYS: usize = 8;

/// Why the ranks do not agree, or why it could not be checked.
#[derive(Debug, thiserror::Error)]
pub enum AgreementError {
    #[error("the ranks do not run the same job: {0}")]
    Disagree(String),
    #[error("checking that every rank runs the same job: {0}")]
    Store(#[from] StoreError),
}

/// What each rank publishes: its terms' digest and where it runs.
fn claim_key(rank: u32) -> String {
    format!("agree/claim/{rank}")
}
fn rank_key(rank: u32) -> String {
    format!("agree/rank/{rank}")
}
const RANK0_TERMS: &str = "agree/terms/0";

/// Checks that every rank of the job runs with `terms` equal to rank 0's and that no global
/// rank is taken twice; every rank returns the same verdict.
pub fn agree(
    store: &mut StoreClient,
    env: &WorkerEnv,
    terms: &Terms,
    timeout: Duration,
) -> Result<(), AgreementError> {
    let here = where_am_i(env);
    if store.add(&claim_key(env.rank), 1)? > 1 {
        // The first to claim a rank holds it; the job goes on without the second.
        let line = format!(
            "RANK {} is already taken by another process ({here} is not admitted): two nodes were started with the same --node-rank, or with different --num-processes",
            env.rank
        );
        return Err(AgreementError::Disagree(line));
    }
    let digest = job_terms::digest(terms);
    let mine = if env.rank == 0 {
        store.set(RANK0_TERMS, &serde_json::to_vec(terms).unwrap_or_default())?;
        OK.to_vec()
    } else {
        compare_with_rank0(store, env.rank, &here, terms, &digest, timeout)?
    };
    store.set(&rank_key(env.rank), &mine)?;
    if env.rank == 0 {
        decide(store, env.world_size, timeout)?;
    }
    let verdict = store.wait(&[VERDICT], timeout)?.remove(0);
    if verdict == OK {
        return Ok(());
    }
    // Every rank must read the verdict before rank 0, which serves the store, exits with it.
    if store.add(VERDICT_READ, 1)? >= i64::from(env.world_size) {
        store.set(ALL_READ, b"1")?;
    }
    if env.rank == 0 {
        let _ = store.wait(&[ALL_READ], timeout.min(READ_GRACE));
    }
    Err(AgreementError::Disagree(
        String::from_utf8_lossy(&verdict).into_owned(),
    ))
}

/// `ok`, or the line that says how this rank's terms differ from rank 0's.
fn compare_with_rank0(
    store: &mut StoreClient,
    rank: u32,
    here: &str,
    terms: &Terms,
    digest: &str,
    timeout: Duration,
) -> Result<Vec<u8>, AgreementError> {
    let theirs = store.wait(&[RANK0_TERMS], timeout)?.remove(0);
    let theirs: BTreeMap<String, String> = serde_json::from_slice(&theirs).unwrap_or_default();
    if job_terms::digest(&theirs) == digest {
        return Ok(OK.to_vec());
    }
    let on_rank = format!("on rank {rank}");
    let diff = job_terms::describe_difference(terms, &theirs, NAMED_KEYS, (&on_rank, "on rank 0"));
    Ok(format!("rank {rank} ({here}) differs from rank 0: {diff}").into_bytes())
}

/// Rank 0: waits for every rank's answer and publishes the first disagreement, or `ok`; a
/// verdict published meanwhile (a rank taken twice: some rank never answers) ends the wait.
fn decide(store: &mut StoreClient, world: u32, timeout: Duration) -> Result<(), StoreError> {
    let keys: Vec<String> = (0..world).map(rank_key).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let deadline = std::time::Instant::now() + timeout;
    let answers = loop {
        if store.get(VERDICT)?.is_some() {
            return Ok(());
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match store.wait(&keys, left.min(VERDICT_POLL)) {
            Ok(answers) => break answers,
            Err(StoreError::WaitTimeout { .. }) if !left.is_zero() => continue,
            Err(e) => return Err(e),
        }
    };
    let line = answers.into_iter().find(|a| a.as_slice() != OK);
    match line {
        Some(line) => publish_verdict(store, &String::from_utf8_lossy(&line)),
        None => publish_verdict(store, "ok"),
    }
}

/// Writes the verdict once: the first writer wins, so a verdict never changes under a reader.
fn publish_verdict(store: &mut StoreClient, line: &str) -> Result<(), StoreError> {
    if store.add(VERDICT_CLAIM, 1)? == 1 {
        store.set(VERDICT, line.as_bytes())?;
    }
    Ok(())
}

fn where_am_i(env: &WorkerEnv) -> String {
    let host = host_name();
    format!(
        "node rank {}, host {host}, pid {}",
        env.group_rank,
        std::process::id()
    )
}

/// This machine's host name, or `?`.
pub(crate) fn host_name() -> String {
    nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "?".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use store::StoreServer;

    fn env(rank: u32, world: u32, port: u16) -> WorkerEnv {
        WorkerEnv {
            rank,
            local_rank: 0,
            world_size: world,
            local_world_size: 1,
            group_rank: rank,
            group_world_size: world,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            restart_count: 0,
            max_restarts: 0,
            run_id: "agree-test".into(),
        }
    }

    fn terms(lr: &str) -> Terms {
        [
            ("train.lr".to_string(), lr.to_string()),
            ("x".into(), "1".into()),
        ]
        .into()
    }

    /// Runs `agree` for each (rank, terms) on its own thread; the verdicts in order.
    fn run(ranks: Vec<(u32, Terms)>, world: u32) -> Vec<Result<(), String>> {
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "agree-test").unwrap();
        let addr = server.local_addr().to_string();
        let port = server.local_addr().port();
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|(rank, terms)| {
                let addr = addr.clone();
                std::thread::spawn(move || {
                    let t = Duration::from_secs(10);
                    let mut store = StoreClient::connect(&addr, "agree-test", t).unwrap();
                    agree(&mut store, &env(rank, world, port), &terms, t).map_err(|e| e.to_string())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn equal_terms_agree() {
        let verdicts = run((0..3).map(|r| (r, terms("0.001"))).collect(), 3);
        assert!(verdicts.iter().all(Result::is_ok), "{verdicts:?}");
    }

    #[test]
    fn one_rank_with_another_value_fails_every_rank_naming_the_key_and_both_values() {
        let verdicts = run(
            vec![
                (0, terms("0.001")),
                (1, terms("0.001")),
                (2, terms("0.002")),
            ],
            3,
        );
        for v in &verdicts {
            let e = v.as_ref().unwrap_err();
            assert!(e.contains("rank 2 (node rank 2"), "{e}");
            assert!(
                e.contains("train.lr: 0.002 on rank 2 vs 0.001 on rank 0"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_second_process_claiming_a_taken_rank_is_refused_alone() {
        let verdicts = run(vec![(0, terms("1")), (1, terms("1")), (1, terms("1"))], 2);
        let lines: Vec<&String> = verdicts.iter().filter_map(|v| v.as_ref().err()).collect();
        assert_eq!(lines.len(), 1, "{verdicts:?}");
        assert!(lines[0].contains("RANK 1 is already taken"), "{lines:?}");
        assert!(verdicts[0].is_ok(), "{verdicts:?}");
    }
}
