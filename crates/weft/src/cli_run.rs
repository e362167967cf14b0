//! `weft run`: generate text from a prompt, streaming it to stdout.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use serde_json::json;
use weft_model::{GenerateRequest, SamplingParams};

use crate::paths::resolve_model;
use crate::progress::{load_engine, resolve_threads};

#[derive(Args, Debug)]
pub struct RunArgs {
    /// GGUF model file (default: the model `weft pull` fetched).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The prompt text.
    #[arg(long, short = 'p', required_unless_present = "prompt_ids")]
    pub prompt: Option<String>,
    /// The prompt as token ids, comma-separated, instead of text: exactly this context,
    /// no tokenizing and no BOS added (e.g. another engine's prompt and tokens, to see
    /// what weft picks after them).
    #[arg(long, value_delimiter = ',', conflicts_with = "prompt")]
    pub prompt_ids: Option<Vec<u32>>,
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
    #[command(flatten)]
    pub layout: crate::layout_args::LayoutArgs,
}

pub fn run(a: RunArgs) -> Result<()> {
    let path = resolve_model(a.model.clone())?;
    let threads = resolve_threads(a.threads)?;
    crate::memcheck::check(&path, &a.layout, 1, a.ctx)?;
    if a.layout.is_cluster() {
        return run_cluster(&a, &path);
    }
    let (mut engine, load_s) = load_engine(&path, threads, a.ctx, a.layout.cache_type)?;
    let prompt_ids = prompt_tokens(&a, &engine.tokenizer)?;
    let req = request(&a, prompt_ids.clone());
    let mut sink = TextSink::new(a.json);
    let g = engine
        .generate(&req, &mut |piece| sink.push(piece))
        .context("generation failed");
    sink.result()?;
    let g = g?;
    let extra = json!({"load_s": load_s, "threads": threads});
    report(
        &a,
        &prompt_ids,
        &g,
        extra,
        &format!("load {load_s:.2}s, {threads} threads"),
    )
}

/// The same generation across a cluster: local nodes (--nodes) or running ones (--peers).
fn run_cluster(a: &RunArgs, path: &std::path::Path) -> Result<()> {
    let t0 = std::time::Instant::now();
    let top_k = 64.max(a.top_k).max(a.logprobs);
    let mut c = crate::cluster_open::open(&a.layout, path, a.ctx, top_k, a.logprobs > 0, 1, None)?;
    let setup_s = t0.elapsed().as_secs_f64();
    let prompt_ids = prompt_tokens(a, &c.tokenizer)?;
    let req = request(a, prompt_ids.clone());
    let mut sink = TextSink::new(a.json);
    let g = weft_model::generate(&mut c.cluster, &c.tokenizer, &req, &mut |piece| {
        sink.push(piece)
    })
    .context("generation across the cluster failed");
    sink.result()?;
    let g = g?;
    let stats = c.cluster.stop().map_err(|e| anyhow::anyhow!(e))?;
    let l = c.cluster.layout().clone();
    let fetched = c.cluster.fetched().to_vec();
    let sent = c.cluster.options().share.as_ref().map(|h| h.bytes_sent());
    if !a.json {
        for (addr, f) in c.peers.iter().zip(&fetched) {
            if let Some(f) = f {
                eprintln!("{}", crate::share_report::line(addr, f));
            }
        }
        if let Some(sent) = sent.filter(|&s| s > 0) {
            eprintln!("this coordinator sent {sent} bytes of shards");
        }
    }
    let extra = json!({
        "fetched": fetched,
        "share_sent_bytes": sent,
        "setup_s": setup_s,
        "nodes": c.peers,
        "tp": l.tp,
        "pp": l.pp,
        "ep": l.ep,
        "layers": l.layers.iter().map(|r| [r.start, r.end]).collect::<Vec<_>>(),
        "node_stats": stats,
    });
    let what = format!("{} nodes, {}, setup {setup_s:.2}s", c.peers.len(), l.name());
    report(a, &prompt_ids, &g, extra, &what)
}

/// The prompt's token ids: `--prompt` tokenized (BOS and special tokens as the model's
/// metadata says), or `--prompt-ids` checked against the vocabulary.
fn prompt_tokens(a: &RunArgs, tokenizer: &weft_tokenizer::Tokenizer) -> Result<Vec<u32>> {
    match (&a.prompt, &a.prompt_ids) {
        (_, Some(ids)) => {
            let vocab = tokenizer.vocab_size();
            if ids.is_empty() {
                anyhow::bail!("--prompt-ids: no token ids given");
            }
            if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
                anyhow::bail!(
                    "--prompt-ids: id {id} (at {i}) is outside the model's vocabulary of {vocab} tokens"
                );
            }
            Ok(ids.clone())
        }
        (Some(text), None) => Ok(tokenizer.encode(text, true, true)),
        (None, None) => anyhow::bail!("give --prompt or --prompt-ids"),
    }
}

fn report(
    a: &RunArgs,
    prompt_ids: &[u32],
    g: &weft_model::Generated,
    extra: serde_json::Value,
    what: &str,
) -> Result<()> {
    if a.json {
        let mut v = json!({
            "prompt_ids": prompt_ids,
            "token_ids": g.token_ids,
            "text": g.text,
            "finish_reason": g.finish.as_str(),
            "prefill_tok_s": g.prefill_tok_s(),
            "decode_tok_s": g.decode_tok_s(),
        });
        if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
            o.extend(e.clone());
        }
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
        outln!("{v}")?;
    } else {
        outln!()?;
        eprintln!(
            "prefill: {} tokens, {:.1} tok/s | decode: {} tokens, {:.1} tok/s | {what}",
            g.prefill_tokens,
            g.prefill_tok_s(),
            g.token_ids.len(),
            g.decode_tok_s(),
        );
    }
    Ok(())
}

/// Streams generated text to stdout (unless --json). The first failed write is kept and
/// later pieces are dropped, so a closed pipe ends the command with that error rather
/// than a panic; generation itself has no way to be stopped from here.
struct TextSink {
    json: bool,
    error: Option<crate::out::StdoutError>,
}

impl TextSink {
    fn new(json: bool) -> Self {
        TextSink { json, error: None }
    }

    fn push(&mut self, piece: &str) {
        if self.json || self.error.is_some() || piece.is_empty() {
            return;
        }
        if let Err(e) = crate::out::write_str(piece) {
            self.error = Some(e);
        }
    }

    fn result(&mut self) -> Result<(), crate::out::StdoutError> {
        self.error.take().map_or(Ok(()), Err)
    }
}

fn request(a: &RunArgs, prompt_ids: Vec<u32>) -> GenerateRequest {
    GenerateRequest {
        prompt_ids,
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
    }
}
