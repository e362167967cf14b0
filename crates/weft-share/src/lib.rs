//! Download once, share over the LAN: a model's bytes as verifiable pieces (manifest.rs),
//! the pieces a shard needs (pieces.rs), the node's cache of them (cache.rs) and fetching
//! them from every holder at once (fetch.rs). The transport lives in weft-cluster; this
//! crate sees holders only as `fetch::Source`s.

pub mod cache;
pub mod fetch;
pub mod manifest;
pub mod pieces;
pub mod stream;

use std::sync::Arc;

pub use cache::{CacheEntry, CacheView, ShardCache};
pub use fetch::{fetch, FetchReport, Holding, Source, SourceReport};
pub use manifest::Manifest;
pub use pieces::{Needs, Piece, Recorder};

use weft_gguf::GgufFile;

/// Opens the cached model's parts as a `GgufFile` whose tensor reads go through `data`
/// (a `Recorder` for the dry run, a `CacheView` to load for real). Its header must be held.
pub fn open_cached(
    cache: &ShardCache,
    data: Arc<dyn weft_gguf::PartialData>,
) -> Result<GgufFile, String> {
    let path = cache.first_part();
    let mut f = GgufFile::open(&path).map_err(|e| format!("{e:#}"))?;
    f.set_partial(data);
    Ok(f)
}

#[cfg(test)]
mod tests;
