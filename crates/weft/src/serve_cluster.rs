//! `weft serve` as a cluster's coordinator.

use std::path::Path;

use anyhow::{bail, Result};
use weft_model::BatchOptions;
use weft_server::{ChatTemplate, ClusterView, EngineHandle};
use weft_tokenizer::Tokenizer;

use crate::serve::ServeArgs;

type Started = (
    EngineHandle,
    std::sync::Arc<Tokenizer>,
    ChatTemplate,
    Box<dyn ClusterView>,
);

pub fn start(_a: &ServeArgs, _path: &Path, _opts: BatchOptions) -> Result<Started> {
    bail!("cluster serving is not built yet")
}
