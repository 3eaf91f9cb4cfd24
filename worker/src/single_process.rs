//! A collective of one process over a store of its own on loopback, for the tools that load a
//! run's data and model outside a job (`recommend`, `export-split`): `load_data` and cached text
//! encoding take a collective. Must not listen anywhere but loopback.

use std::time::Duration;

use anyhow::Context as _;
use common::env_contract::WorkerEnv;
use runtime::collective::tcp::TcpCollective;
use runtime::collective::Collective;
use runtime::store::{StoreClient, StoreServer};

/// The store (keep it alive while the collective is used) and a world-size-1 collective;
/// `tag` names the tool in the run id.
pub fn single_process(tag: &str) -> anyhow::Result<(StoreServer, Box<dyn Collective>)> {
    let id = format!("{tag}-{}", std::process::id());
    let server =
        StoreServer::start("127.0.0.1:0".parse()?, &id).context("starting a local store")?;
    let addr = server.local_addr();
    let store = StoreClient::connect(&addr.to_string(), &id, Duration::from_secs(10))?;
    let env = WorkerEnv::single_node(0, 1, "127.0.0.1", addr.port(), &id);
    let comm = TcpCollective::connect(&env, store, Duration::from_secs(10))?;
    Ok((server, Box::new(comm)))
}
