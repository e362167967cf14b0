//! weft-comm: the data plane between ranks. A `Group` is a full mesh of authenticated links
//! (TCP, shared-memory rings, or in-process rings) with deadline-bounded collectives,
//! link probes and injected delay. It knows nothing of models.

pub mod collectives;
pub mod error;
pub mod frame;
pub mod group;
pub mod handshake;
pub mod link;
pub mod liveness;
pub mod probe;
pub mod ring;
pub mod secret;
pub mod tcp;

pub use collectives::Wire;
pub use error::{CommError, Fault};
pub use group::{bind, Group, GroupOptions, TransportKind};
pub use link::Deadline;
pub use liveness::Liveness;
pub use probe::LinkMatrix;
