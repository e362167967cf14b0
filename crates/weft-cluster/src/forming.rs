//! How a coordinator forms a data-plane group with its nodes (for a run or a survey):
//! dial each node's control link with heartbeats feeding the liveness table, then open
//! its own listener where the nodes reach it, send every node the ranks' addresses, and
//! join as rank 0.

use std::sync::Arc;
use std::time::Duration;

use weft_comm::{Group, Liveness};

use crate::activity::ActivityBoard;
use crate::control::{self, FromNode, ToNode};
use crate::heartbeat::{ControlLink, Hooks};
use crate::node::group_options;

/// Node `rank`'s beats (and the end of its control link) feed the coordinator's table,
/// and `board`, where one watches; the coordinator's own beats relay that table to every
/// node.
pub(crate) fn coordinator_hooks(
    liveness: &Arc<Liveness>,
    rank: usize,
    addr: &str,
    board: Option<&Arc<ActivityBoard>>,
) -> Hooks {
    let (on_beat, on_end, ages) = (liveness.clone(), liveness.clone(), liveness.clone());
    let (beat_board, end_board) = (board.cloned(), board.cloned());
    let (beat_addr, end_addr) = (addr.to_string(), addr.to_string());
    Hooks {
        on_beat: Box::new(move |_, work| {
            on_beat.heard(rank);
            if let Some(b) = &beat_board {
                b.heard(&beat_addr, work.copied());
            }
        }),
        on_end: Box::new(move || {
            on_end.mark_dead(rank);
            if let Some(b) = &end_board {
                b.ended(&end_addr);
            }
        }),
        ages: Box::new(move || {
            ages.heard(0);
            ages.ages_ms()
        }),
        work: Box::new(|| None),
    }
}

/// Dials node `addr`, authenticates, and starts its control link as data-plane rank
/// `rank`, its heartbeats feeding `liveness` (and `board`, where one watches).
pub(crate) fn connect(
    addr: &str,
    secret: &[u8],
    liveness: &Arc<Liveness>,
    rank: usize,
    board: Option<&Arc<ActivityBoard>>,
) -> Result<ControlLink<FromNode, ToNode>, String> {
    let c = control::dial(addr, secret, Duration::from_secs(10))
        .map_err(|e| format!("node {addr}: {e}"))?;
    ControlLink::start(c, addr, coordinator_hooks(liveness, rank, addr, board))
        .map_err(|e| format!("node {addr}: {e}"))
}

/// How the group's links are made.
pub(crate) struct GroupSpec<'a> {
    pub transport: &'a str,
    pub link_delay_us: f64,
    pub timeout: Duration,
    pub secret: &'a [u8],
    pub liveness: Arc<Liveness>,
}

/// `addrs[1..]` are the nodes' data addresses (rank order); `addrs[0]` is filled with
/// the coordinator's own, on the address the nodes' control links reach it from.
pub(crate) fn form_group(
    controls: &[ControlLink<FromNode, ToNode>],
    peers: &[String],
    addrs: &mut [String],
    spec: GroupSpec,
) -> Result<Group, String> {
    let first = controls.first().ok_or("no nodes to form a group with")?;
    let ip = first.local_ip()?;
    let listener = weft_comm::bind(&format!("{ip}:0")).map_err(|e| e.to_string())?;
    addrs[0] = listener
        .local_addr()
        .map_err(|e| e.to_string())?
        .to_string();
    for (c, addr) in controls.iter().zip(peers) {
        c.send(&ToNode::Go {
            addrs: addrs.to_vec(),
        })
        .map_err(|e| format!("node {addr}: {e}"))?;
    }
    let mut gopts = group_options(
        0,
        spec.transport,
        spec.link_delay_us,
        spec.timeout.as_millis() as u64,
        spec.secret.to_vec(),
    )?;
    gopts.liveness = Some(spec.liveness);
    Group::with_listener(0, addrs, listener, gopts).map_err(|e| e.to_string())
}
