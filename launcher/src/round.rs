//! A round of an elastic job as data: the nodes of the worker group in node-rank order, what
//! each said about itself, and what follows from that (world size, each node's first rank,
//! the workers' store). The rendezvous forms rounds and the plan turns one into a node's
//! plan; neither needs the other to read it.

use serde::{Deserialize, Serialize};

/// What a node says about itself when it joins a round.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub id: u64,
    /// Where the other nodes reach it (its workers' store, when it is node rank 0).
    pub addr: String,
    pub nproc: u32,
    /// A free port on this node for the workers' store, should it become node rank 0.
    pub port: u16,
    /// Whether it hosts the rendezvous store (it then always comes first).
    pub host: bool,
    /// Digest of its job terms (`common::job_terms::digest`); the full terms are under
    /// `elastic/terms/<id>`.
    #[serde(default)]
    pub terms: String,
    /// Its host name, for messages.
    #[serde(default)]
    pub hostname: String,
}

/// A closed round: the nodes of the worker group in node-rank order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Round {
    pub round: u64,
    pub nodes: Vec<NodeInfo>,
    /// Rounds that ended in a failure before this one.
    pub failures: u32,
    /// The world of the round before this one, if any (a node that missed it compares with
    /// that, not with the last round it ran in).
    #[serde(default)]
    pub previous_world: Option<u32>,
}

impl Round {
    pub fn world_size(&self) -> u32 {
        self.nodes.iter().map(|n| n.nproc).sum()
    }

    /// This node's rank in the round, if it is a member.
    pub fn node_rank_of(&self, id: u64) -> Option<u32> {
        self.nodes.iter().position(|n| n.id == id).map(|r| r as u32)
    }

    /// Global rank of local rank 0 on node rank `node_rank`: nodes may run different numbers
    /// of processes, so it is the sum over the nodes before it.
    pub fn first_rank_of(&self, node_rank: u32) -> u32 {
        self.nodes
            .iter()
            .take(node_rank as usize)
            .map(|n| n.nproc)
            .sum()
    }

    /// Node `id` for messages: `node id 2 (host h2 at 10.0.0.3, ranks 4..5)`.
    pub fn describe(&self, id: u64) -> String {
        let Some(rank) = self.node_rank_of(id) else {
            return format!("node id {id}");
        };
        let node = &self.nodes[rank as usize];
        let first = self.first_rank_of(rank);
        let ranks = match node.nproc {
            1 => format!("rank {first}"),
            n => format!("ranks {first}..{}", first + n - 1),
        };
        let host = match node.hostname.as_str() {
            "" => String::new(),
            name => format!("host {name} at "),
        };
        format!("node id {id} ({host}{}, {ranks})", node.addr)
    }

    /// The workers' store: node rank 0's address and port.
    pub fn master(&self) -> (&str, u16) {
        let first = &self.nodes[0];
        (&first.addr, first.port)
    }

    pub fn ids(&self) -> Vec<u64> {
        self.nodes.iter().map(|n| n.id).collect()
    }
}
