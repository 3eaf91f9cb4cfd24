//! Static multi-node jobs whose nodes were started differently (another config value, the same
//! `--node-rank` twice): every rank stops before training with one line naming what differs,
//! instead of training diverged models or hanging until the collective's timeout.

mod support;

use std::time::Duration;

use support::*;

const T: Duration = Duration::from_secs(120);

/// Starts one `launch` per (node rank, extra args) of a 2-node static job on loopback.
fn static_job(tag: &str, nodes: &[(&str, &[&str])]) -> (Vec<Output>, String) {
    static_job_with(tag, nodes, &[])
}

/// [`static_job`] with `env` added to every node's environment.
fn static_job_with(
    tag: &str,
    nodes: &[(&str, &[&str])],
    env: &[(&str, &str)],
) -> (Vec<Output>, String) {
    let dir = tempfile::tempdir().unwrap();
    let id = unique_run_id(tag);
    let port = free_port().to_string();
    let sets = tiny_bpr_sets(dir.path());
    let children: Vec<_> = nodes
        .iter()
        .map(|(node, extra)| {
            let mut args: Vec<&str> = vec![
                "--nnodes",
                "2",
                "--node-rank",
                node,
                "--num-processes",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                &port,
                "--run-id",
                &id,
                "configs/default.toml",
                "--set",
                "dist.timeout_s=60",
            ];
            args.extend(sets.iter().map(String::as_str));
            args.extend(extra.iter());
            let mut cmd = launch_cmd(&args);
            cmd.envs(env.iter().copied());
            cmd.spawn().expect("start launch")
        })
        .collect();
    let outs = children.into_iter().map(|c| wait_output(c, T)).collect();
    (outs, id)
}

#[test]
fn a_node_with_another_config_value_stops_every_rank_before_training() {
    let (outs, id) = static_job(
        "terms-lr",
        &[("0", &[]), ("1", &["--set", "train.lr=0.002"])],
    );
    for out in &outs {
        out.assert_code(2);
        out.assert_stderr("the ranks do not run the same job: rank 1 (node rank 1");
        out.assert_stderr("train.lr: 0.002 on rank 1 vs 0.005 on rank 0");
        assert!(!out.all().contains("collective tcp ready"), "{}", out.all());
        out.assert_ended_within(30);
    }
    assert_no_processes(&id, Duration::from_secs(10));
}

#[test]
fn a_second_node_with_a_taken_node_rank_is_refused_and_the_job_goes_on() {
    let (outs, id) = static_job("terms-rank", &[("0", &[]), ("1", &[]), ("1", &[])]);
    let (refused, ran): (Vec<&Output>, Vec<&Output>) = outs.iter().partition(|o| {
        o.stderr
            .contains("RANK 1 is already taken by another process")
    });
    assert_eq!(
        refused.len(),
        1,
        "{:?}",
        outs.iter().map(|o| &o.stderr).collect::<Vec<_>>()
    );
    refused[0].assert_code(2);
    for out in ran {
        out.assert_code(0);
    }
    assert_no_processes(&id, Duration::from_secs(10));
}

#[test]
fn a_rank_whose_collective_fails_to_start_stops_the_other_node_at_once() {
    // Node 1's rank fails while setting up its collective (as an NCCL initialisation can):
    // node 0's rank, which has joined the rendezvous, is told at once by the job watch instead
    // of waiting for it until the set-up's timeout (600 s here).
    let (outs, id) = static_job_with(
        "collective-fails",
        &[
            ("0", &["--set", "dist.timeout_s=600"]),
            ("1", &["--set", "dist.timeout_s=600"]),
        ],
        &[("GPTREC_FAULT_COLLECTIVE", "1")],
    );
    outs[1].assert_stderr("set-up failed on this rank (GPTREC_FAULT_COLLECTIVE)");
    outs[0].assert_stderr("stopping: rank 1 (host");
    outs[0].assert_stderr("ended before the job finished");
    for out in &outs {
        out.assert_code(1);
        out.assert_ended_within(60);
    }
    assert_no_processes(&id, Duration::from_secs(10));
}
