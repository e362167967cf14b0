//! Fetching the pieces a shard lacks from every holder at once: each piece goes to the
//! holder with the fewest bytes given so far (the coordinator and any node that already
//! fetched it), each holder on its own thread, every piece checked on arrival; a bad
//! piece is logged with its sender and asked again of another holder, and a holder that
//! fails hands its remaining pieces to the others.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use crate::cache::{PutError, ShardCache};
use crate::pieces::Piece;

/// What a holder has of the model.
#[derive(Clone, Debug)]
pub enum Holding {
    All,
    Some(HashSet<Piece>),
}

impl Holding {
    pub fn has(&self, p: &Piece) -> bool {
        match self {
            Holding::All => true,
            Holding::Some(s) => s.contains(p),
        }
    }
}

/// A holder of a model's pieces: a peer over the network, or a hub's file over HTTP.
pub trait Source: Send {
    /// Its name in logs and reports (an address or URL).
    fn name(&self) -> String;
    /// The manifest of model `root`, as JSON (checked by the caller).
    fn manifest(&mut self, root: &str) -> Result<Vec<u8>, String>;
    fn holding(&mut self) -> Result<Holding, String>;
    /// Fetches `pieces` (a holder's whole queue, requests kept in flight as the source
    /// sees fit, maybe on several connections at once), calling `got` with each piece
    /// as it arrives; `got` returns false to stop early. An `Err` means the holder cannot be used any more.
    fn fetch(
        &mut self,
        pieces: &[Piece],
        got: &(dyn Fn(Piece, &[u8]) -> bool + Sync),
    ) -> Result<(), String>;
}

/// What one holder gave.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct SourceReport {
    pub name: String,
    pub bytes: u64,
    pub pieces: usize,
    /// Pieces it sent that failed their hash.
    pub bad: usize,
    pub failed: Option<String>,
}

#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct FetchReport {
    /// Pieces the shard needs, and how many of them the cache held already.
    pub wanted: usize,
    pub already: usize,
    pub wanted_bytes: u64,
    /// Bytes the shard itself reads (headers, ranges, column blocks), which the pieces
    /// cover with some rounding at their ends; set by the caller that knows them.
    #[serde(default)]
    pub shard_bytes: u64,
    pub fetched_bytes: u64,
    pub seconds: f64,
    pub sources: Vec<SourceReport>,
}

/// Bad copies of one piece tolerated before the fetch gives up on it.
const MAX_BAD: usize = 3;

/// Fetches every piece of `wanted` the cache lacks. `progress(done, total)` is called as
/// bytes arrive.
pub fn fetch(
    cache: &ShardCache,
    wanted: &BTreeSet<Piece>,
    sources: &mut [Box<dyn Source>],
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<FetchReport, String> {
    let t = Instant::now();
    let m = &cache.manifest;
    let size = |p: &Piece| m.piece_info(*p).map_or(0, |(n, _)| n);
    let mut missing: Vec<Piece> = wanted.iter().filter(|p| !cache.has(**p)).copied().collect();
    let mut report = FetchReport {
        wanted: wanted.len(),
        already: wanted.len() - missing.len(),
        wanted_bytes: wanted.iter().map(size).sum(),
        ..FetchReport::default()
    };
    let total: u64 = missing.iter().map(size).sum();
    let done = AtomicU64::new(0);
    progress(0, total);
    // The log is written even when the fetch fails part-way: what was stored stays.
    struct FlushOnExit<'a>(&'a ShardCache);
    impl Drop for FlushOnExit<'_> {
        fn drop(&mut self) {
            let _ = self.0.flush_log();
        }
    }
    let _flush = FlushOnExit(cache);
    report.sources = sources
        .iter()
        .map(|s| SourceReport {
            name: s.name(),
            ..SourceReport::default()
        })
        .collect();
    let mut holdings: Vec<Option<Holding>> = vec![None; sources.len()];
    // Holders that sent a bad copy of a piece are not asked for it again while another has it.
    let mut shunned: HashMap<Piece, Vec<usize>> = HashMap::new();
    let mut bad_count: HashMap<Piece, usize> = HashMap::new();
    while !missing.is_empty() {
        // What each working holder has now: nodes fetching at the same time gain pieces.
        for (i, s) in sources.iter_mut().enumerate() {
            if report.sources[i].failed.is_some() {
                continue;
            }
            match s.holding() {
                Ok(h) => holdings[i] = Some(h),
                Err(e) => {
                    tracing::warn!("shard holder {}: {e}", report.sources[i].name);
                    report.sources[i].failed = Some(e);
                    holdings[i] = None;
                }
            }
        }
        let mut queues: Vec<Vec<Piece>> = vec![Vec::new(); sources.len()];
        let mut load = vec![0u64; sources.len()];
        let mut orphans = Vec::new();
        for p in &missing {
            let no = shunned.get(p);
            let pick = |allow_shunned: bool| {
                (0..sources.len())
                    .filter(|&i| holdings[i].as_ref().is_some_and(|h| h.has(p)))
                    .filter(|i| allow_shunned || !no.is_some_and(|n| n.contains(i)))
                    .min_by_key(|&i| load[i])
            };
            match pick(false).or_else(|| pick(true)) {
                Some(i) => {
                    load[i] += size(p);
                    queues[i].push(*p);
                }
                None => orphans.push(*p),
            }
        }
        if !orphans.is_empty() {
            return Err(format!(
                "{} pieces ({} bytes) of the shard have no working holder (first: {:?}); holders: {}",
                orphans.len(),
                orphans.iter().map(size).sum::<u64>(),
                orphans[0],
                report
                    .sources
                    .iter()
                    .map(|s| match &s.failed {
                        Some(e) => format!("{} ({e})", s.name),
                        None => s.name.clone(),
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        let failed: Mutex<Vec<(Piece, usize, bool)>> = Mutex::new(Vec::new());
        let io_error: Mutex<Option<String>> = Mutex::new(None);
        // Set with io_error: every holder's thread stops asking.
        let stop = AtomicBool::new(false);
        let results: Vec<(usize, SourceReport)> = std::thread::scope(|sc| {
            let handles: Vec<_> = sources
                .iter_mut()
                .zip(queues)
                .enumerate()
                .filter(|(_, (_, q))| !q.is_empty())
                .map(|(i, (src, queue))| {
                    let (failed, io_error, done, stop) = (&failed, &io_error, &done, &stop);
                    sc.spawn(move || {
                        let name = src.name();
                        let (bytes_in, pieces_in, bad_in) =
                            (AtomicU64::new(0), AtomicUsize::new(0), AtomicUsize::new(0));
                        // Each piece is checked and stored on the thread that received
                        // it, while its bytes are still in that core's cache: a hand-off
                        // to another thread cost more in memory traffic and wake-ups
                        // than it gained (the socket's buffer keeps the link busy
                        // meanwhile).
                        let res = src.fetch(&queue, &|p, bytes| {
                            if stop.load(Ordering::Relaxed) {
                                return false;
                            }
                            match cache.put(p, bytes) {
                                Ok(()) => {
                                    let n = bytes.len() as u64;
                                    bytes_in.fetch_add(n, Ordering::Relaxed);
                                    pieces_in.fetch_add(1, Ordering::Relaxed);
                                    let d = done.fetch_add(n, Ordering::Relaxed);
                                    progress(d + n, total);
                                    true
                                }
                                Err(PutError::Bad(why)) => {
                                    tracing::warn!(
                                        "shard holder {name} sent a bad piece: {why}; asking again"
                                    );
                                    bad_in.fetch_add(1, Ordering::Relaxed);
                                    if let Ok(mut f) = failed.lock() {
                                        f.push((p, i, true));
                                    }
                                    true
                                }
                                Err(PutError::Io(e)) => {
                                    if let Ok(mut x) = io_error.lock() {
                                        *x = Some(e);
                                    }
                                    stop.store(true, Ordering::Relaxed);
                                    false
                                }
                            }
                        });
                        // A holder stopped because a store failed is no holder's fault.
                        let stopped = stop.load(Ordering::Relaxed);
                        if let (Err(e), false) = (&res, stopped) {
                            let left: Vec<Piece> =
                                queue.iter().filter(|p| !cache.has(**p)).copied().collect();
                            tracing::warn!(
                                "shard holder {name} failed ({e}); its {} remaining pieces go to the others",
                                left.len()
                            );
                            if let Ok(mut f) = failed.lock() {
                                f.extend(left.into_iter().map(|p| (p, i, false)));
                            }
                        }
                        let r = SourceReport {
                            bytes: bytes_in.into_inner(),
                            pieces: pieces_in.into_inner(),
                            bad: bad_in.into_inner(),
                            failed: res.err(),
                            ..SourceReport::default()
                        };
                        (i, r)
                    })
                })
                .collect();
            handles.into_iter().filter_map(|h| h.join().ok()).collect()
        });
        if let Some(e) = io_error.lock().ok().and_then(|mut x| x.take()) {
            return Err(e);
        }
        for (i, r) in results {
            let s = &mut report.sources[i];
            s.bytes += r.bytes;
            s.pieces += r.pieces;
            s.bad += r.bad;
            if r.failed.is_some() {
                s.failed = r.failed;
                holdings[i] = None;
            }
        }
        let failed = failed.into_inner().unwrap_or_default();
        for &(p, i, bad) in &failed {
            if bad {
                let n = bad_count.entry(p).or_insert(0);
                *n += 1;
                if *n >= MAX_BAD {
                    return Err(format!(
                        "{p:?} failed its hash {MAX_BAD} times (last from {})",
                        report.sources[i].name
                    ));
                }
                shunned.entry(p).or_default().push(i);
            }
        }
        // Whatever is still not held goes round again (a holder's thread that died
        // without a word leaves its pieces here too); a round that stores nothing ends it.
        let before = missing.len();
        missing.retain(|p| !cache.has(*p));
        if missing.len() == before && failed.is_empty() {
            return Err(format!(
                "{} pieces of the shard could not be fetched (first: {:?})",
                missing.len(),
                missing[0]
            ));
        }
    }
    cache.flush_log()?;
    report.fetched_bytes = done.load(Ordering::Relaxed);
    report.seconds = t.elapsed().as_secs_f64();
    Ok(report)
}
