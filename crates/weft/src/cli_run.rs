//! `weft run`: generate text from a prompt, streaming it to stdout.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use serde_json::json;
use weft_model::{GenerateRequest, SamplingParams};

use crate::paths::resolve_model;
use crate::progress::{default_threads, load_engine};

#[derive(Args, Debug)]
pub struct RunArgs {
    /// GGUF model file (default: the model `weft pull` fetched).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The prompt text.
    #[arg(long, short = 'p')]
    pub prompt: String,
    #[arg(long, short = 'n', default_value_t = 64)]
    pub max_tokens: usize,
    /// 0 means greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop when this text is generated (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Threads (default: all cores).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Context size in tokens.
    #[arg(long, default_value_t = 4096)]
    pub ctx: usize,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// With --json: the K most likely tokens and their logprobs for each generated token.
    #[arg(long, default_value_t = 0)]
    pub logprobs: usize,
}

pub fn run(a: RunArgs) -> Result<()> {
    let path = resolve_model(a.model.clone())?;
    let threads = a.threads.unwrap_or_else(default_threads).max(1);
    let (mut engine, load_s) = load_engine(&path, threads, a.ctx)?;
    let prompt_ids = engine.tokenizer.encode(&a.prompt, true, true);
    let req = GenerateRequest {
        prompt_ids: prompt_ids.clone(),
        max_tokens: a.max_tokens,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            min_p: a.min_p,
            repeat_penalty: a.repeat_penalty,
            repeat_last_n: 64,
            seed: a.seed,
        },
        stop: a.stop.clone(),
        logprobs: a.logprobs,
    };
    let stdout = std::io::stdout();
    let json_mode = a.json;
    let g = engine
        .generate(&req, &mut |piece| {
            if !json_mode {
                let mut o = stdout.lock();
                let _ = o.write_all(piece.as_bytes());
                let _ = o.flush();
            }
        })
        .context("generation failed")?;
    if json_mode {
        let mut v = json!({
            "prompt_ids": prompt_ids,
            "token_ids": g.token_ids,
            "text": g.text,
            "finish_reason": g.finish.as_str(),
            "prefill_tok_s": g.prefill_tok_s(),
            "decode_tok_s": g.decode_tok_s(),
            "load_s": load_s,
            "threads": threads,
        });
        if a.logprobs > 0 {
            v["top_logprobs"] = json!(g
                .logprobs
                .iter()
                .map(|(_, top)| top
                    .iter()
                    .map(|(id, lp)| json!([id, lp]))
                    .collect::<Vec<_>>())
                .collect::<Vec<_>>());
            v["logprobs"] = json!(g.logprobs.iter().map(|(lp, _)| *lp).collect::<Vec<_>>());
        }
        println!("{v}");
    } else {
        println!();
        eprintln!(
            "prefill: {} tokens, {:.1} tok/s | decode: {} tokens, {:.1} tok/s | load {:.2}s, {threads} threads",
            g.prefill_tokens,
            g.prefill_tok_s(),
            g.token_ids.len(),
            g.decode_tok_s(),
            load_s
        );
    }
    Ok(())
}
