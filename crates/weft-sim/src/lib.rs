//! `weft simulate`: the planner's cost model (weft-plan) over profiles of models, machines,
//! links and engines, at any node count from 1 to 1,024 and every layout kind, with the
//! time per token split into compute, links and bubbles; calibrated from single-node
//! measurements and checked against published multi-node results; tables, JSON and SVG
//! plots are the caller's to print.

pub mod calibrate;
pub mod engines;
pub mod hardware;
pub mod links;
pub mod models;
pub mod plot;
pub mod profiles;
pub mod published;
pub mod sweep;

pub use calibrate::calibrate;
pub use engines::Engine;
pub use hardware::Hardware;
pub use links::Link;
pub use models::Architecture;
pub use profiles::Profiles;
pub use sweep::{simulate, Kind, Row, Scenario};
