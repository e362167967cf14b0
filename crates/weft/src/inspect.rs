//! `weft inspect`: a GGUF file's metadata and tensors, for humans.

use std::path::PathBuf;

use anyhow::Result;
use weft_gguf::{GgufFile, Value};

use crate::paths::resolve_model;

pub fn run(model: Option<PathBuf>, tensors: bool, check: bool, all: bool) -> Result<()> {
    let path = resolve_model(model)?;
    let f = GgufFile::open(&path)?;
    outln!(
        "{}: GGUF v{}, {} tensors, {} metadata keys",
        path.display(),
        f.version,
        f.tensors().len(),
        f.metadata().len()
    )?;
    let parts = f.parts();
    if parts.len() > 1 {
        outln!("  split in {} parts:", parts.len())?;
        for (i, (p, len)) in parts.iter().enumerate() {
            let held = f.tensors().iter().filter(|t| t.part == i).count();
            outln!(
                "    {}: {} ({len} bytes, {held} tensors)",
                i + 1,
                p.display()
            )?;
        }
    }
    for (k, v) in f.metadata() {
        let shown = match v {
            Value::String(s) if s.len() > 120 => format!(
                "{:?}…",
                &s[..s.char_indices().nth(120).map(|c| c.0).unwrap_or(s.len())]
            ),
            v => v.to_string(),
        };
        outln!("  {k} = {shown}")?;
    }
    if let Ok(cfg) = weft_model::ModelConfig::from_gguf(&f) {
        outln!("  {}", kv_per_token_line(&cfg, weft_model::CacheType::F32))?;
    }
    if tensors {
        for t in f.tensors() {
            let part = if parts.len() > 1 {
                format!(", part {}", t.part + 1)
            } else {
                String::new()
            };
            outln!(
                "  {} {:?} {} ({} bytes{part})",
                t.name,
                t.dims,
                t.ty,
                t.n_bytes
            )?;
        }
    }
    if check {
        crate::inspect_check::run(&f, all)?;
    }
    Ok(())
}

/// The KV cache's bytes per token (values stored as `ty`, all layers), what it holds, and
/// what a full-KV cache of the same model would need: MLA's saving in one line.
pub fn kv_per_token_line(cfg: &weft_model::ModelConfig, ty: weft_model::CacheType) -> String {
    let (cached, full) = cfg.kv_bytes_per_token(ty);
    let t = ty.name();
    let holds = match cfg.mla {
        Some(m) => format!("MLA latent {} + RoPE key {} {t}", m.kv_lora_rank, m.n_rope),
        None => format!(
            "keys and values of {} KV heads x {} {t}",
            cfg.n_head_kv, cfg.head_dim
        ),
    };
    format!(
        "KV cache per token: {cached} bytes ({} layers x {holds}); a full K/V cache: {full} \
         bytes ({:.1}x)",
        cfg.n_layer,
        full as f64 / cached.max(1) as f64
    )
}
