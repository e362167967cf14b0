//! weft-cluster: the node daemon and the coordinator. A coordinator sends each node its
//! part of a plan (pipeline stage, tensor-parallel slice), the nodes load only their shard
//! and join one data-plane group, and every step runs across them: stage 0 embeds, each
//! stage's TP ranks all-reduce, stages hand the hidden state on, the last stage's ranks
//! send their vocabulary slices' top-k, and only the coordinator samples.

pub mod activity;
pub mod control;
pub mod coordinator;
pub mod discovery;
mod forming;
pub mod heartbeat;
pub mod layout;
pub mod local;
pub mod members;
pub mod node;
pub mod node_fetch;
pub mod planning;
pub mod procinfo;
pub mod profile;
pub mod resume;
pub mod share;
pub mod share_hub;
pub mod stage;
pub mod step;
pub mod survey;

pub use coordinator::{Cluster, ClusterOptions, NodeStats};
pub use layout::{Layout, LayoutRequest};
pub use node::{serve, NodeOptions};
pub use planning::model_profile;
pub use resume::{Former, ResumeEvent, ResumeOptions, Resuming};
