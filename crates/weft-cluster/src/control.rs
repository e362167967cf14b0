//! The control channel between the coordinator and a node: an authenticated TCP
//! connection (weft-comm's handshake) carrying length-prefixed JSON messages, with
//! heartbeats beside them (`heartbeat::ControlLink`).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use weft_comm::handshake::{handshake, Hello};
use weft_model::CacheType;

/// A node's part of a plan.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NodePlan {
    /// The model file as the coordinator names it; a node started with `--model` uses
    /// its own copy instead.
    pub model: String,
    /// This node's rank in the data-plane group (the coordinator is rank 0).
    pub rank: usize,
    pub group_size: usize,
    pub stage: usize,
    /// The ranks of every stage's tensor-parallel members, in stage order.
    pub stages: Vec<Vec<usize>>,
    pub layers: (usize, usize),
    /// Position in the stage (attention and dense FFNs are split over all positions).
    pub tp_rank: usize,
    pub tp_weights: Vec<f64>,
    /// Relative expert shares of the stage's expert groups (`[1.0]`: no EP).
    #[serde(default = "no_expert_split")]
    pub ep_weights: Vec<f64>,
    /// Spare experts each expert group holds beyond its share (0: none).
    #[serde(default)]
    pub ep_spares: usize,
    pub threads: usize,
    pub n_ctx: usize,
    pub ubatch: usize,
    /// How the KV caches store keys and values (f32 from a coordinator that predates it).
    #[serde(default)]
    pub cache_type: CacheType,
    /// Sequences held at once (one KV cache each) for batched steps.
    #[serde(default = "one_slot")]
    pub slots: usize,
    pub transport: String,
    pub link_delay_us: f64,
    pub timeout_ms: u64,
    /// Where to fetch the shard from when the node has no copy of the model.
    #[serde(default)]
    pub share: Option<ShareSpec>,
}

/// A model the coordinator shares: its content hash (the manifest's root) and the
/// holders to ask, the coordinator's share port first, then the other nodes.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ShareSpec {
    /// The manifest's root; empty when the coordinator has not hashed its file yet (it
    /// does so only when a node first asks, as a node without the file then does).
    pub root: String,
    pub sources: Vec<String>,
    /// Each part's URL on a Hugging Face–compatible hub, when the coordinator has no copy:
    /// nodes fetch from it too, with HTTP Range requests (and their own HF_TOKEN).
    #[serde(default)]
    pub hub_urls: Vec<String>,
}

fn no_expert_split() -> Vec<f64> {
    vec![1.0]
}

fn one_slot() -> usize {
    1
}

/// The most sequence slots a plan may ask a node to hold.
pub const MAX_SLOTS: usize = 256;

/// A survey: the node reports its profile, then joins a group to measure every link.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SurveyRequest {
    pub rank: usize,
    pub group_size: usize,
    /// Compute threads a run would give the node (its kernels are timed with these).
    pub threads: usize,
    pub transport: String,
    pub link_delay_us: f64,
    pub timeout_ms: u64,
    /// Round trips per pair, and bytes of the one-way bandwidth transfer.
    pub pings: usize,
    pub bulk: usize,
    /// Time the kernels again rather than reading the cache (the machine's speed now,
    /// for checking predictions against runs).
    #[serde(default)]
    pub fresh: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum ToNode {
    Plan(Box<NodePlan>),
    Survey(Box<SurveyRequest>),
    /// In a survey, sent to every node at once: time the kernels again while all run,
    /// to see what nodes sharing a machine's memory get when they compute together.
    Calibrate,
    /// Every rank's data-plane address, rank order: join the group now.
    Go {
        addrs: Vec<String>,
    },
    /// A member (or a tool) asks for the member list, telling what it knows; the node
    /// answers on this link with `members::MemberReply`, outside any session.
    Members(Box<crate::members::Gossip>),
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum FromNode {
    Ready {
        data_addr: String,
        /// Weight bytes of this node's shard.
        shard_bytes: u64,
        rss_bytes: u64,
        /// What the node fetched for this shard (None: it read its own copy).
        #[serde(default)]
        fetched: Option<weft_share::FetchReport>,
    },
    Failed {
        error: String,
    },
    /// The answer to a survey: what the node offers, and where its data plane listens.
    Profile {
        info: Box<crate::profile::NodeInfo>,
        data_addr: String,
    },
    /// The kernel speeds measured while every surveyed node measured too.
    Rates {
        rates: Vec<weft_kernels::calibrate::TypeRate>,
    },
}

/// What an authenticated connection to a node's control port is for: the first byte after
/// the handshake says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Channel {
    /// Control messages with heartbeats (`heartbeat::ControlLink`).
    Control,
    /// Shard pieces (`share.rs`'s requests and replies).
    Share,
}

impl Channel {
    fn byte(self) -> u8 {
        match self {
            Channel::Control => b'C',
            Channel::Share => b'S',
        }
    }
}

/// The coordinator's side: connect to a node and authenticate.
pub fn dial(addr: &str, secret: &[u8], timeout: Duration) -> Result<TcpStream, String> {
    dial_channel(addr, secret, timeout, Channel::Control)
}

/// Connects to a node's (or a coordinator's share) port for `channel`, authenticated.
pub fn dial_channel(
    addr: &str,
    secret: &[u8],
    timeout: Duration,
    channel: Channel,
) -> Result<TcpStream, String> {
    use std::net::ToSocketAddrs;
    let target = addr
        .to_socket_addrs()
        .map_err(|e| format!("address {addr:?}: {e}"))?
        .next()
        .ok_or_else(|| format!("address {addr:?} resolves to nothing"))?;
    let mut s =
        TcpStream::connect_timeout(&target, timeout).map_err(|e| format!("connecting: {e}"))?;
    s.set_nodelay(true).map_err(|e| e.to_string())?;
    handshake(&mut s, &Hello::new(0, 2), secret, Some(1), timeout)?;
    s.write_all(&[channel.byte()])
        .map_err(|e| format!("sending the channel byte: {e}"))?;
    Ok(s)
}

/// The node's side of a fresh control connection: authenticates, then reads which
/// channel the caller wants.
pub fn accept(s: &mut TcpStream, secret: &[u8], timeout: Duration) -> Result<Channel, String> {
    s.set_nodelay(true).map_err(|e| e.to_string())?;
    handshake(s, &Hello::new(1, 2), secret, None, timeout)?;
    s.set_read_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    let mut b = [0u8; 1];
    s.read_exact(&mut b)
        .map_err(|e| format!("reading the channel byte: {e}"))?;
    s.set_read_timeout(None).map_err(|e| e.to_string())?;
    match b[0] {
        b'C' => Ok(Channel::Control),
        b'S' => Ok(Channel::Share),
        x => Err(format!("unknown channel byte {x:#04x}")),
    }
}
