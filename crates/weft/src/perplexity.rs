//! `weft perplexity`: llama-perplexity's measurement over a text file.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use serde_json::json;

use crate::paths::resolve_model;
use crate::progress::{load_engine, resolve_threads};

#[derive(Args, Debug)]
pub struct PerplexityArgs {
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The text to score.
    #[arg(long, short = 'f')]
    pub file: PathBuf,
    /// Tokens per chunk.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// How the KV cache stores keys and values: f32 or f16.
    #[arg(long, default_value = "f32")]
    pub cache_type: weft_model::CacheType,
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: PerplexityArgs) -> Result<()> {
    let text = std::fs::read_to_string(&a.file)
        .with_context(|| format!("reading {}", a.file.display()))?;
    let path = resolve_model(a.model.clone())?;
    let threads = resolve_threads(a.threads)?;
    let (mut engine, _) = load_engine(&path, threads, a.ctx, a.cache_type)?;
    let tokens = engine.tokenizer.encode(&text, true, false);
    let t0 = std::time::Instant::now();
    let quiet = a.json;
    let (ppl, chunks, scored) = engine
        .perplexity(&tokens, a.ctx, &mut |c, n, p| {
            if !quiet {
                eprintln!("chunk {c}/{n}: running ppl {p:.4}");
            }
        })
        .with_context(|| format!("scoring {}", a.file.display()))?;
    let secs = t0.elapsed().as_secs_f64();
    if a.json {
        outln!(
            "{}",
            json!({"ppl": ppl, "chunks": chunks, "ctx": a.ctx, "tokens": tokens.len(), "scored": scored, "seconds": secs})
        )?;
    } else {
        outln!(
            "perplexity {ppl:.4} over {chunks} chunks of {} tokens ({scored} scored, {secs:.1}s)",
            a.ctx
        )?;
    }
    Ok(())
}
