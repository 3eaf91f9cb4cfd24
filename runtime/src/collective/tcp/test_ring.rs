//! A real ring on threads, for tests here and in other crates (feature `test-support`).

use std::time::Duration;

use common::env_contract::WorkerEnv;

use super::*;
use crate::store::StoreServer;

fn env(rank: u32, world: u32, port: u16) -> WorkerEnv {
    WorkerEnv::single_node(rank, world, "127.0.0.1", port, "ring-test")
}

/// The environment of `rank` in a job of `hosts` hosts with `per_host` ranks each (all of them
/// threads here, on loopback).
fn host_env(rank: u32, hosts: u32, per_host: u32, port: u16) -> WorkerEnv {
    WorkerEnv {
        local_rank: rank % per_host,
        local_world_size: per_host,
        group_rank: rank / per_host,
        group_world_size: hosts,
        ..WorkerEnv::single_node(rank, hosts * per_host, "127.0.0.1", port, "ring-test")
    }
}

/// Runs `body(rank, communicator)` on `world` threads connected by a real ring (and shared
/// memory, as between processes of one host).
pub fn with_ring<T: Send + 'static>(
    world: u32,
    body: impl Fn(usize, &mut TcpCollective) -> T + Send + Sync + 'static,
) -> Vec<T> {
    with_ring_opts(world, TcpOptions::default(), body)
}

/// [`with_ring`] with `options` (e.g. sockets only).
pub fn with_ring_opts<T: Send + 'static>(
    world: u32,
    options: TcpOptions,
    body: impl Fn(usize, &mut TcpCollective) -> T + Send + Sync + 'static,
) -> Vec<T> {
    with_ring_owned_opts(world, options, move |rank, mut comm| body(rank, &mut comm))
}

/// [`with_ring_opts`] for `hosts` hosts of `per_host` ranks each (`RANK = host x per_host +
/// LOCAL_RANK`), as `launch --nnodes` numbers them.
pub fn with_hosts<T: Send + 'static>(
    hosts: u32,
    per_host: u32,
    options: TcpOptions,
    body: impl Fn(usize, &mut TcpCollective) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let env = move |rank, port| host_env(rank, hosts, per_host, port);
    with_envs(hosts * per_host, env, options, move |rank, mut comm| {
        body(rank, &mut comm)
    })
}

/// [`with_hosts`], giving each thread its communicator to own (e.g. for a DDP engine).
pub fn with_hosts_owned<T: Send + 'static>(
    hosts: u32,
    per_host: u32,
    options: TcpOptions,
    body: impl Fn(usize, TcpCollective) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let env = move |rank, port| host_env(rank, hosts, per_host, port);
    with_envs(hosts * per_host, env, options, body)
}

/// [`with_ring`], giving each thread its communicator to own (e.g. for a DDP engine).
pub fn with_ring_owned<T: Send + 'static>(
    world: u32,
    body: impl Fn(usize, TcpCollective) -> T + Send + Sync + 'static,
) -> Vec<T> {
    with_ring_owned_opts(world, TcpOptions::default(), body)
}

/// [`with_ring_owned`] with `options`.
pub fn with_ring_owned_opts<T: Send + 'static>(
    world: u32,
    options: TcpOptions,
    body: impl Fn(usize, TcpCollective) -> T + Send + Sync + 'static,
) -> Vec<T> {
    with_envs(
        world,
        move |rank, port| env(rank, world, port),
        options,
        body,
    )
}

/// Runs `body` on `world` threads, rank `r` connected with `env(r, store port)`.
fn with_envs<T: Send + 'static>(
    world: u32,
    env: impl Fn(u32, u16) -> WorkerEnv,
    options: TcpOptions,
    body: impl Fn(usize, TcpCollective) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "ring-test").unwrap();
    let addr = server.local_addr();
    let body = std::sync::Arc::new(body);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let body = body.clone();
            let env = env(rank, addr.port());
            std::thread::spawn(move || {
                let store =
                    StoreClient::connect(&addr.to_string(), "ring-test", Duration::from_secs(10))
                        .unwrap();
                let comm =
                    TcpCollective::connect_with(&env, store, Duration::from_secs(10), options)
                        .unwrap();
                body(rank as usize, comm)
            })
        })
        .collect();
    let out = handles.into_iter().map(|h| h.join().unwrap()).collect();
    drop(server);
    out
}
