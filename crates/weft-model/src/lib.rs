//! Model architectures written once against a shard and a collective: config, weights,
//! forward pass, KV cache, sampler, tokenizer glue, and the single-node engine.

mod attention;
pub mod batch;
pub mod batch_stats;
pub mod batcher;
pub mod collective;
pub mod config;
pub mod constraint;
pub mod engine;
pub mod error;
pub mod generate;
pub mod kv;
pub mod local_batch;
pub mod memory;
mod mla;
pub mod model;
#[cfg(test)]
mod model_tests;
mod moe;
pub mod request;
mod rows;
pub mod sampler;
pub mod shard;
pub mod synthetic;
pub mod vocab;
pub mod weights;

pub use batch::SeqSpan;
pub use batch_stats::{BatchStats, RunningRequest, SlotLive};
pub use batcher::{BatchBackend, BatchOptions, Batcher, Event, EventSink, Job};
pub use collective::{Collective, Identity, InProcess};
pub use config::{Arch, ModelConfig};
pub use constraint::TokenConstraint;
pub use engine::Engine;
pub use error::ModelError;
pub use generate::{generate, Backend};
pub use kv::{CacheType, KvCache};
pub use local_batch::LocalBatch;
pub use model::{granularity, Logits, Model, DEFAULT_UBATCH};
pub use request::{FinishReason, GenerateRequest, Generated};
pub use sampler::{Sampler, SamplingParams};
pub use shard::{ShardSpec, StageSplit};
