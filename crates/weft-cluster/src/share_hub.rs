//! A coordinator with no copy of the model, which is on a Hugging Face–compatible hub:
//! it reads each part's header with Range requests (into sparse files), hashes the parts
//! once as they stream past (checking the hub's sha256) for the manifest, keeps only the
//! headers in its shard cache, and serves those and the manifest to the nodes, which
//! fetch their shards' pieces from the hub and from each other. No machine holds the
//! whole model.

use std::path::Path;
use std::sync::Arc;

use weft_gguf::GgufFile;
use weft_hub::{pick_files, HubClient, HubSource, RepoSpec};
use weft_share::{Manifest, Needs, Source};

use crate::share::NodeShards;

/// The model as the coordinator holds it: headers only.
pub struct HubModel {
    /// Opened from the shard cache: metadata and tensor table, no tensor data.
    pub file: Arc<GgufFile>,
    pub shards: Arc<NodeShards>,
    pub root: String,
    /// Each part's resolve URL.
    pub urls: Vec<String>,
}

/// The first prefix of every part read for its header; it grows fourfold while the header
/// runs past it, up to `MAX_PREFIX` (a header is metadata and the tensor table: a
/// vocabulary of 256k tokens is a few MiB).
const FIRST_PREFIX: u64 = 1 << 20;
const MAX_PREFIX: u64 = 256 << 20;

pub fn open_from_hub(spec: &RepoSpec, home: &Path) -> Result<HubModel, String> {
    let client = HubClient::from_env();
    let files = pick_files(
        &client.list(&spec.repo).map_err(|e| e.to_string())?,
        spec.quant.as_deref(),
        &spec.repo,
    )
    .map_err(|e| e.to_string())?;
    let urls: Vec<String> = files
        .iter()
        .map(|f| client.file_url(&spec.repo, &f.path))
        .collect();
    let name = |f: &weft_hub::HubFile| {
        Path::new(&f.path)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    // The headers, into sparse files of the parts' lengths, until they parse.
    let dir = home.join("hub-headers").join(format!(
        "{}--{}",
        spec.repo.replace('/', "--"),
        spec.quant.as_deref().unwrap_or("")
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let mut prefix = FIRST_PREFIX;
    let headers = loop {
        for (f, url) in files.iter().zip(&urls) {
            let path = dir.join(name(f));
            let n = prefix.min(f.size);
            let bytes = client.get_range(url, 0..n).map_err(|e| e.to_string())?;
            let file = std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .truncate(true)
                .open(&path)
                .map_err(|e| format!("writing {}: {e}", path.display()))?;
            file.set_len(f.size)
                .and_then(|()| std::os::unix::fs::FileExt::write_all_at(&file, &bytes, 0))
                .map_err(|e| format!("writing {}: {e}", path.display()))?;
        }
        let opened = GgufFile::open(dir.join(name(&files[0])));
        let last = files.iter().all(|f| prefix >= f.size) || prefix >= MAX_PREFIX;
        match opened {
            Ok(g) if g.part_layout().iter().all(|p| p.header_len <= prefix) => break g,
            Err(e) if last => return Err(format!("{}: {e:#}", spec.repo)),
            _ if last => {
                return Err(format!(
                    "{}: the headers do not fit in the first {prefix} bytes",
                    spec.repo
                ))
            }
            _ => prefix *= 4,
        }
    };
    // The hub's files must be the model's parts, in order.
    let layout = headers.part_layout();
    let named: Vec<String> = layout
        .iter()
        .map(|p| {
            p.path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        })
        .collect();
    let listed: Vec<String> = files.iter().map(name).collect();
    if named != listed || layout.iter().zip(&files).any(|(p, f)| p.len != f.size) {
        return Err(format!(
            "{}: the files picked ({}) are not the model's parts ({})",
            spec.repo,
            listed.join(", "),
            named.join(", ")
        ));
    }
    let manifest = hub_manifest(&client, &files, &urls, &headers, home)?;
    drop(headers);
    let _ = std::fs::remove_dir_all(&dir);
    // Apart from the shards/ a node on this machine with the same home fills: the two
    // would otherwise contend for one cache directory's lock.
    let shards = Arc::new(NodeShards::new(home.join("hub-cache")));
    let cache = shards.open(manifest)?;
    let mut hub: Vec<Box<dyn Source>> = vec![Box::new(HubSource::new(
        client,
        urls.clone(),
        cache.manifest.clone(),
    ))];
    let head = cache.manifest.pieces_for(&Needs::default())?;
    weft_share::fetch(&cache, &head, &mut hub, &|_, _| {})?;
    let file = weft_share::open_cached(&cache, cache.view()?)?;
    Ok(HubModel {
        file: Arc::new(file),
        root: cache.manifest.root.clone(),
        shards,
        urls,
    })
}

/// The manifest of the hub's files: cached under `home`/manifests by the first part's
/// sha256, else built from one streamed read of every part (each part's sha256 checked).
fn hub_manifest(
    client: &HubClient,
    files: &[weft_hub::HubFile],
    urls: &[String],
    headers: &GgufFile,
    home: &Path,
) -> Result<Manifest, String> {
    // Cached by every file's path, size and sha256; only where the hub gives each sha256.
    let verified = files.iter().all(|f| {
        f.sha256
            .as_ref()
            .is_some_and(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
    });
    let key = {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        for f in files {
            h.update(format!("{}|{}|{:?}\n", f.path, f.size, f.sha256));
        }
        h.finalize()
            .iter()
            .take(16)
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    let cached = verified.then(|| home.join("manifests").join(format!("hub-{key}.json")));
    let layout = headers.part_layout();
    let fits = |m: &Manifest| {
        m.parts.len() == layout.len()
            && m.parts
                .iter()
                .zip(&layout)
                .all(|(a, b)| a.len == b.len && a.header_len == b.header_len)
    };
    if let Some(m) = cached.as_ref().and_then(|p| Manifest::read_file(p).ok()) {
        if fits(&m) {
            return Ok(m);
        }
    }
    let t = std::time::Instant::now();
    let m = weft_share::stream::build_streaming(headers, |i, sink| {
        let f = &files[i];
        let got = client
            .stream(&urls[i], f.size, sink)
            .map_err(|e| e.to_string())?;
        match &f.sha256 {
            Some(want) if *want != got => Err(format!(
                "{}: the hub's bytes hash to sha256 {got}, its listing says {want}",
                f.path
            )),
            _ => Ok(()),
        }
    })?;
    tracing::info!(
        "hashed {} hub file(s) as they streamed, in {:.2} s (root {})",
        files.len(),
        t.elapsed().as_secs_f64(),
        &m.root[..16]
    );
    if let Some(p) = cached {
        if let Err(e) = m.write_file(&p) {
            tracing::warn!("keeping the manifest: {e}");
        }
    }
    Ok(m)
}
