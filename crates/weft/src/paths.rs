//! Where weft keeps its files: `${WEFT_HOME:-~/.cache/weft}`.

use std::path::PathBuf;

/// The file name of the default model.
pub const DEFAULT_MODEL_FILE: &str = "gemma-3-270m-q4_k_m.gguf";

pub fn weft_home() -> PathBuf {
    if let Some(h) = std::env::var_os("WEFT_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(h);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("weft")
}

pub fn models_dir() -> PathBuf {
    weft_home().join("models")
}

pub fn default_model_path() -> PathBuf {
    models_dir().join(DEFAULT_MODEL_FILE)
}

/// The model to use: `--model` if given, else the default one, which must have been pulled.
pub fn resolve_model(arg: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(p) = arg {
        return Ok(p);
    }
    let p = default_model_path();
    if !p.exists() {
        anyhow::bail!(
            "no --model given and the default model is not at {}; fetch it with `weft pull` (or pass --model PATH)",
            p.display()
        );
    }
    Ok(p)
}
