//! The planner: from a model's profile, the nodes' profiles, the links between them and the
//! workload, every layout weft can run (pipeline stages of tensor-parallel groups, expert
//! parallel where the model has experts, uneven splits), each with its predicted speed and
//! memory per node, ranked. Pure functions: measuring and reading files happen elsewhere.

pub mod cluster;
pub mod cost;
pub mod engine;
pub mod model;
pub mod search;

pub use cluster::{ClusterProfile, NodeProfile};
pub use cost::{Prediction, Workload};
pub use engine::{AllReduce, EngineCosts, Handoff};
pub use model::{LayerProfile, ModelProfile};
pub use search::{even_layout, plan, Candidate};
