//! A real ring on threads, for tests here and in other crates (feature `test-support`).

use super::*;
use crate::store::StoreServer;

fn env(rank: u32, world: u32, port: u16) -> WorkerEnv {
    WorkerEnv::single_node(rank, world, "127.0.0.1", port, "ring-test")
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
    let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "ring-test").unwrap();
    let addr = server.local_addr();
    let body = std::sync::Arc::new(body);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let body = body.clone();
            std::thread::spawn(move || {
                let store =
                    StoreClient::connect(&addr.to_string(), "ring-test", Duration::from_secs(10))
                        .unwrap();
                let comm = TcpCollective::connect_with(
                    &env(rank, world, addr.port()),
                    store,
                    Duration::from_secs(10),
                    options,
                )
                .unwrap();
                body(rank as usize, comm)
            })
        })
        .collect();
    let out = handles.into_iter().map(|h| h.join().unwrap()).collect();
    drop(server);
    out
}
