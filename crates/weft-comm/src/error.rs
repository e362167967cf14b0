//! Errors of the data plane; each names the peer (rank and address) or the setting involved.

use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// A peer closed, crashed, stalled or sent bytes out of protocol.
    #[error("peer rank {rank} at {addr}: {fault}")]
    Peer {
        rank: usize,
        addr: String,
        fault: Fault,
    },
    /// Another rank lost a peer and told us; names the peer it lost.
    #[error("rank {lost} at {addr} was lost (reported by rank {reporter}): {reason}")]
    Aborted {
        lost: usize,
        addr: String,
        reporter: usize,
        reason: String,
    },
    /// A connection refused during the handshake (wrong secret, version, garbage).
    #[error("handshake with {addr} refused: {reason}")]
    Handshake { addr: String, reason: String },
    /// A bad argument or group description.
    #[error("{0}")]
    Config(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

impl CommError {
    /// The rank this error blames, if any.
    pub fn lost_rank(&self) -> Option<usize> {
        match self {
            CommError::Peer { rank, .. } => Some(*rank),
            CommError::Aborted { lost, .. } => Some(*lost),
            _ => None,
        }
    }
}

/// What went wrong on one link.
#[derive(Debug, thiserror::Error)]
pub enum Fault {
    #[error("connection closed")]
    Closed,
    #[error("no data within the {0:?} timeout")]
    TimedOut(Duration),
    /// The group's heartbeats say a rank (maybe not the one waited on) fell silent.
    #[error("rank {rank} has sent no heartbeat for {:.1} s (its process died, stalled or was cut off)", silent.as_secs_f64().min(1e9))]
    Silent { rank: usize, silent: Duration },
    #[error("malformed frame: {0}")]
    Malformed(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}
