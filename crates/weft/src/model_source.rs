//! The model a coordinator plans with and shares with nodes that lack it: a file it holds,
//! or, for `OWNER/REPO:QUANT` not on disk, the headers of a hub's model (weft-cluster's
//! `share_hub`), whose pieces the nodes then fetch from the hub. Opened once per process:
//! a cluster that forms again after a lost node reuses the share server.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use anyhow::{anyhow, Context, Result};
use weft_cluster::share::ShareHost;
use weft_gguf::GgufFile;
use weft_hub::RepoSpec;

type Opened = (
    Arc<GgufFile>,
    Option<Arc<weft_cluster::share_hub::HubModel>>,
);

fn opened() -> &'static Mutex<HashMap<String, Opened>> {
    static M: OnceLock<Mutex<HashMap<String, Opened>>> = OnceLock::new();
    M.get_or_init(Default::default)
}

fn hosts() -> &'static Mutex<HashMap<String, Arc<ShareHost>>> {
    static M: OnceLock<Mutex<HashMap<String, Arc<ShareHost>>>> = OnceLock::new();
    M.get_or_init(Default::default)
}

/// `model` as a hub repository, when it is no file here and reads as OWNER/REPO[:QUANT]
/// (a missing `*.gguf` path is a missing file, not a repository).
pub fn hub_spec(model: &Path) -> Option<RepoSpec> {
    let s = model.to_str()?;
    if model.exists() || s.ends_with(".gguf") {
        return None;
    }
    s.parse().ok()
}

fn open_any(model: &Path) -> Result<Opened> {
    let key = model.to_string_lossy().into_owned();
    if let Some(o) = opened().lock().ok().and_then(|m| m.get(&key).cloned()) {
        return Ok(o);
    }
    let o: Opened = match hub_spec(model) {
        Some(spec) => {
            let h = weft_cluster::share_hub::open_from_hub(&spec, &crate::paths::weft_home())
                .map_err(|e| anyhow!("{key}: {e}"))?;
            (h.file.clone(), Some(Arc::new(h)))
        }
        None => (
            Arc::new(
                GgufFile::open(model).with_context(|| format!("opening {}", model.display()))?,
            ),
            None,
        ),
    };
    if let Ok(mut m) = opened().lock() {
        m.insert(key, o.clone());
    }
    Ok(o)
}

/// The model's file for reading its metadata (on a hub: its headers).
pub fn open_model(model: &Path) -> Result<Arc<GgufFile>> {
    open_any(model).map(|o| o.0)
}

/// The model's file, and with `share` the server nodes fetch their shards from.
pub fn open_shared(
    model: &Path,
    share: bool,
    secret: &[u8],
) -> Result<(Arc<GgufFile>, Option<Arc<ShareHost>>)> {
    let (file, hub) = open_any(model)?;
    if !share {
        return Ok((file, None));
    }
    let key = model.to_string_lossy().into_owned();
    if let Some(h) = hosts().lock().ok().and_then(|m| m.get(&key).cloned()) {
        return Ok((file, Some(h)));
    }
    let host = match hub {
        Some(h) => ShareHost::start_with(
            h.shards.clone(),
            Some(h.root.clone()),
            h.urls.clone(),
            secret,
        ),
        None => ShareHost::start(file.clone(), Some(crate::paths::weft_home()), secret),
    }
    .map_err(|e| anyhow!(e))?;
    if let Ok(mut m) = hosts().lock() {
        m.insert(key, host.clone());
    }
    Ok((file, Some(host)))
}
