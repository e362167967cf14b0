//! Refuses `--parallel` and `--ctx` values whose KV caches cannot fit in this machine's
//! memory, before loading anything (an oversized allocation aborts the process).

use std::path::Path;

use anyhow::{anyhow, Result};
use weft_gguf::GgufFile;
use weft_model::{memory, ModelConfig, DEFAULT_UBATCH};

use crate::layout_args::LayoutArgs;

/// Checks `slots` sequences of `n_ctx` tokens of the model at `path` against MemAvailable.
/// Local nodes (--nodes) share this machine, so the whole cache counts; nodes given by
/// --peers hold theirs elsewhere and are not checked here.
pub fn check(path: &Path, layout: &LayoutArgs, slots: usize, n_ctx: usize) -> Result<()> {
    if !layout.peers.is_empty() {
        return Ok(());
    }
    let Some(available) = memory::mem_available() else {
        return Ok(());
    };
    let f = GgufFile::open(path)?;
    let cfg = ModelConfig::from_gguf(&f)?;
    memory::check_fits(
        &cfg,
        slots,
        (n_ctx, DEFAULT_UBATCH),
        layout.cache_type,
        available,
    )
    .map_err(|e| anyhow!("{}: {e}", path.display()))
}
