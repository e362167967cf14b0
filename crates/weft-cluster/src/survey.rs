//! The coordinator's survey of running nodes: each node's profile (memory, cores, model
//! files, kernel speeds) and the link matrix between the coordinator and every node,
//! measured over the transport and injected delay a run would use.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use weft_comm::{LinkMatrix, Liveness};

use crate::activity::ActivityBoard;
use crate::control::{FromNode, SurveyRequest, ToNode};
use crate::forming::{connect, form_group, GroupSpec};
use crate::profile::NodeInfo;

/// How to survey.
#[derive(Clone, Debug)]
pub struct SurveyOptions {
    pub secret: Vec<u8>,
    pub transport: String,
    pub link_delay_us: f64,
    pub timeout: Duration,
    pub threads_per_node: usize,
    pub pings: usize,
    pub bulk: usize,
    /// Nodes time their kernels now instead of reading their cache.
    pub fresh: bool,
    /// Where the nodes' beats are kept for a watcher (their state while surveyed).
    pub activity: Option<Arc<ActivityBoard>>,
}

/// What the survey found. `links` has the coordinator as rank 0 and `peers[i]` as i + 1.
#[derive(Clone, Debug, Serialize)]
pub struct Survey {
    pub peers: Vec<String>,
    pub nodes: Vec<NodeInfo>,
    pub links: LinkMatrix,
}

/// Asks every node in `peers` for its profile, then measures all links in one group.
pub fn survey(peers: &[String], opts: &SurveyOptions) -> Result<Survey, String> {
    if peers.is_empty() {
        return Err("no nodes to survey".into());
    }
    let n = peers.len() + 1;
    let liveness = Arc::new(Liveness::new(n, None));
    let mut controls = Vec::new();
    let mut addrs = vec![String::new()];
    let mut nodes = Vec::new();
    // One node at a time, so that each times its kernels alone (a node measures on first
    // ask, about a second, beating meanwhile); then all at once, below.
    for (i, addr) in peers.iter().enumerate() {
        let c = connect(addr, &opts.secret, &liveness, i + 1, opts.activity.as_ref())?;
        c.send(&ToNode::Survey(Box::new(SurveyRequest {
            rank: i + 1,
            group_size: n,
            threads: opts.threads_per_node,
            transport: opts.transport.clone(),
            link_delay_us: opts.link_delay_us,
            timeout_ms: opts.timeout.as_millis() as u64,
            pings: opts.pings,
            bulk: opts.bulk,
            fresh: opts.fresh,
        })))
        .map_err(|e| format!("node {addr}: {e}"))?;
        match c
            .recv(Duration::from_secs(10))
            .map_err(|e| format!("node {addr}: {e}"))?
        {
            FromNode::Profile { info, data_addr } => {
                nodes.push(*info);
                addrs.push(data_addr);
            }
            FromNode::Failed { error } => return Err(format!("node {addr}: {error}")),
            other => return Err(format!("node {addr}: expected a profile, got {other:?}")),
        }
        controls.push(c);
    }
    if peers.len() > 1 {
        for (c, addr) in controls.iter().zip(peers) {
            c.send(&ToNode::Calibrate)
                .map_err(|e| format!("node {addr}: {e}"))?;
        }
        for ((c, addr), info) in controls.iter().zip(peers).zip(&mut nodes) {
            match c
                .recv(Duration::from_secs(10))
                .map_err(|e| format!("node {addr}: {e}"))?
            {
                FromNode::Rates { rates } => info.rates_loaded = rates,
                FromNode::Failed { error } => return Err(format!("node {addr}: {error}")),
                other => return Err(format!("node {addr}: expected rates, got {other:?}")),
            }
        }
    }
    let spec = GroupSpec {
        transport: &opts.transport,
        link_delay_us: opts.link_delay_us,
        timeout: opts.timeout,
        secret: &opts.secret,
        liveness,
    };
    let mut group = form_group(&controls, peers, &mut addrs, spec)?;
    let links = group
        .probe_links(opts.pings, opts.bulk)
        .map_err(|e| format!("measuring links: {e}"))?;
    Ok(Survey {
        peers: peers.to_vec(),
        nodes,
        links,
    })
}
