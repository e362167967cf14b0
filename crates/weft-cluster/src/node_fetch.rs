//! A node that lacks the model file fetches only its shard: the manifest from the first
//! holder that has it (checked against the root its plan names), the headers, then a dry
//! run of the loader over them to learn which pieces the shard reads, then those pieces
//! from every holder at once into its shard cache; the model is then opened from the cache.

use std::sync::Arc;

use weft_gguf::GgufFile;
use weft_share::{FetchReport, Manifest, Needs, Recorder, Source};

use crate::activity::WorkCounters;
use crate::control::ShareSpec;
use crate::share::{NodeShards, PeerSource, ANY_ROOT};

/// What the node fetched, and the model opened from its cache.
pub struct Fetched {
    pub file: Arc<GgufFile>,
    pub report: FetchReport,
    /// Bytes the shard reads (its pieces), to compare with what the cache holds.
    pub shard_bytes: u64,
    pub root: String,
}

/// Fills in the plan's root when the coordinator left it out (it had not hashed its file
/// yet): its share port, the first holder the plan names, is asked for the manifest of
/// whatever it serves, which must hash to the root it states. The root is then exactly as
/// trustworthy as the plan: both come from the coordinator over channels the cluster
/// secret opened. Returns the manifest it fetched, for `fetch_shard`.
///
/// Hashing a model of hundreds of GB takes minutes: the node waits as long as `alive`
/// says the coordinator's control link still beats.
pub fn resolve_root(
    spec: &mut ShareSpec,
    secret: &[u8],
    alive: &dyn Fn() -> bool,
) -> Result<Option<Manifest>, String> {
    if !spec.root.is_empty() {
        return Ok(None);
    }
    let first = spec
        .sources
        .first()
        .ok_or("the plan names no holder to fetch the shard from")?;
    let mut coordinator = PeerSource::new(first, secret, ANY_ROOT);
    let m = coordinator
        .manifest_when_ready(alive)
        .and_then(|b| Manifest::parse_self_checked(&b))
        .map_err(|e| format!("the coordinator's share port {first} gave no manifest: {e}"))?;
    spec.root = m.root.clone();
    Ok(Some(m))
}

/// Fetches what `spec`'s model needs for one shard; `dry_load` loads the shard from a file
/// whose data reads are recorded (its bytes are zeros). `known` is the manifest
/// `resolve_root` fetched, if it did.
pub fn fetch_shard(
    spec: &ShareSpec,
    known: Option<Manifest>,
    secret: &[u8],
    shards: &NodeShards,
    work: &WorkCounters,
    dry_load: &dyn Fn(Arc<GgufFile>) -> Result<(), String>,
) -> Result<Fetched, String> {
    if spec.root.len() != 64 || !spec.root.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!(
            "the plan names model root {:?}, not 64 hex digits",
            spec.root
        ));
    }
    let mut sources: Vec<Box<dyn Source>> = spec
        .sources
        .iter()
        .map(|a| Box::new(PeerSource::new(a, secret, &spec.root)) as Box<dyn Source>)
        .collect();
    let mut errors = Vec::new();
    let mut manifest = known.filter(|m| m.root == spec.root);
    for s in sources.iter_mut().filter(|_| manifest.is_none()) {
        match s
            .manifest(&spec.root)
            .and_then(|b| Manifest::parse_checked(&b, &spec.root))
        {
            Ok(m) => {
                manifest = Some(m);
                break;
            }
            Err(e) => errors.push(format!("{}: {e}", s.name())),
        }
    }
    let manifest = manifest.ok_or_else(|| {
        format!(
            "no holder gave the manifest of model {}: {}",
            &spec.root[..16],
            errors.join("; ")
        )
    })?;
    let cache = shards.open(manifest)?;
    if !spec.hub_urls.is_empty() {
        let client = weft_hub::HubClient::from_env();
        sources.push(Box::new(weft_hub::HubSource::new(
            client,
            spec.hub_urls.clone(),
            cache.manifest.clone(),
        )));
    }
    let progress = |done: u64, total: u64| work.fetch_progress(done, total);
    let headers = cache.manifest.pieces_for(&Needs::default())?;
    let first = weft_share::fetch(&cache, &headers, &mut sources, &progress)?;
    let recorder = Arc::new(Recorder::default());
    let dry = weft_share::open_cached(&cache, recorder.clone())?;
    dry_load(Arc::new(dry))?;
    let needs = recorder.take();
    let pieces = cache.manifest.pieces_for(&needs)?;
    let mut report = weft_share::fetch(&cache, &pieces, &mut sources, &progress)?;
    report.fetched_bytes += first.fetched_bytes;
    // The headers fetched a moment ago were not in the cache before.
    let fresh_headers: usize = first.sources.iter().map(|s| s.pieces).sum();
    report.already = report.already.saturating_sub(fresh_headers);
    report.seconds += first.seconds;
    for (r, f) in report.sources.iter_mut().zip(&first.sources) {
        r.bytes += f.bytes;
        r.pieces += f.pieces;
        r.bad += f.bad;
        if r.failed.is_none() {
            r.failed = f.failed.clone();
        }
    }
    let headers: u64 = cache.manifest.parts.iter().map(|p| p.header_len).sum();
    let m = &cache.manifest;
    report.shard_bytes = headers
        + needs.bytes(|name| {
            m.strips
                .iter()
                .find(|s| s.tensor == name)
                .map_or(0, |s| s.block_bytes as usize)
        });
    let view = cache.view()?;
    let file = weft_share::open_cached(&cache, view)?;
    cache.touch();
    tracing::info!(
        "shard of {}: {} pieces, {} held already, {} bytes fetched in {:.2} s ({})",
        cache
            .manifest
            .parts
            .first()
            .map_or("?", |p| p.name.as_str()),
        report.wanted,
        report.already,
        report.fetched_bytes,
        report.seconds,
        report
            .sources
            .iter()
            .map(|s| format!(
                "{} bytes from {}{}",
                s.bytes,
                s.name,
                if s.bad > 0 {
                    format!(", {} bad", s.bad)
                } else {
                    String::new()
                }
            ))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(Fetched {
        file: Arc::new(file),
        shard_bytes: report.shard_bytes,
        report,
        root: cache.manifest.root.clone(),
    })
}
