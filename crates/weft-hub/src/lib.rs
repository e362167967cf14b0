//! weft-hub: models from a Hugging Face–compatible hub. `OWNER/REPO[:QUANT]` names a
//! repository and the quantization wanted; the hub's tree API lists its files with their
//! LFS sha256; every file of that quantization (all parts of a split model) is downloaded
//! with HTTP Range resumption and kept only once its sha256 matches.
//!
//! Hand-written over ureq rather than the `hf-hub` crate: hf-hub neither resumes a cut
//! download with Range nor checks the LFS sha256, the two things this module is for.

mod client;
mod source;
mod spec;

pub use client::{HubClient, HubError, HubFile};
pub use source::HubSource;
pub use spec::{available_quants, pick_files, RepoSpec};
