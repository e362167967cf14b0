//! The shard cache on disk, one directory per model under `WEFT_HOME/shards/<root>`: the
//! manifest, each part as a sparse file holding only its fetched chunks (so the model's
//! own loader maps it as it maps a whole file), the column strips one after another in
//! `strips.bin`, and `pieces.log`, one line per verified piece, written after its bytes.
//! Opening re-hashes what the log lists, so a piece cut off by a kill or a lost link is
//! fetched again and nothing else is.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::ops::Range;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use weft_gguf::{PartialData, TensorInfo};

use crate::manifest::{gather_strip, Manifest};
use crate::pieces::Piece;

const MANIFEST: &str = "manifest.json";
const STRIPS: &str = "strips.bin";
const LOG: &str = "pieces.log";
const USED: &str = "used";
const LOCK: &str = "lock";

/// An exclusive lock on a cache directory, held while a process has it open: two nodes
/// sharing one weft home must not both append to its strips and log.
fn lock_dir(dir: &Path) -> Result<File, String> {
    use std::os::fd::AsRawFd;
    let path = dir.join(LOCK);
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| io_err(&path, "opening", e))?;
    // SAFETY: flock on a descriptor this function owns.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(format!(
            "shard cache {} is in use by another process (two weft nodes with one weft home?)",
            dir.display()
        ));
    }
    Ok(f)
}

struct State {
    parts: Vec<File>,
    chunks: Vec<Vec<bool>>,
    /// Offset in strips.bin of each held strip.
    strips: HashMap<(u32, u32), u64>,
    strips_file: File,
    strips_end: u64,
    log: File,
    /// Log lines of pieces written but not yet logged (written in batches: one write per
    /// `LOG_BATCH` pieces, not one per piece; a kill loses only their log lines, and they
    /// are fetched again).
    pending: String,
    pending_n: usize,
}

const LOG_BATCH: usize = 64;

impl State {
    fn flush_log(&mut self) -> std::io::Result<()> {
        if !self.pending.is_empty() {
            self.log.write_all(self.pending.as_bytes())?;
            self.pending.clear();
            self.pending_n = 0;
        }
        Ok(())
    }
}

/// One model's cached pieces. Shared between a node's fetches and its share server.
pub struct ShardCache {
    pub dir: PathBuf,
    pub manifest: Arc<Manifest>,
    state: Mutex<State>,
    /// Holds the directory's lock while open.
    _lock: File,
}

fn io_err(path: &Path, what: &str, e: std::io::Error) -> String {
    format!("{what} {}: {e}", path.display())
}

impl ShardCache {
    /// The directory of model `root` under `shards`.
    pub fn dir_for(shards: &Path, root: &str) -> PathBuf {
        shards.join(&root[..root.len().min(32)])
    }

    /// Opens (creating it if new) the cache of `manifest`'s model under `shards`, keeping
    /// every logged piece whose bytes still hash right.
    pub fn open(shards: &Path, manifest: Manifest) -> Result<ShardCache, String> {
        let dir = Self::dir_for(shards, &manifest.root);
        std::fs::create_dir_all(&dir).map_err(|e| io_err(&dir, "creating", e))?;
        let mpath = dir.join(MANIFEST);
        if !mpath.exists() {
            manifest.write_file(&mpath)?;
        }
        Self::open_dir(dir, manifest)
    }

    /// Opens an existing cache directory, its manifest read and checked from it.
    pub fn open_existing(dir: &Path) -> Result<ShardCache, String> {
        let m = Manifest::read_file(&dir.join(MANIFEST))?;
        Self::open_dir(dir.to_path_buf(), m)
    }

    fn open_dir(dir: PathBuf, manifest: Manifest) -> Result<ShardCache, String> {
        let lock = lock_dir(&dir)?;
        let rw = |p: &Path| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(p)
                .map_err(|e| io_err(p, "opening", e))
        };
        let mut parts = Vec::new();
        for p in &manifest.parts {
            let path = dir.join(&p.name);
            let f = rw(&path)?;
            let len = f.metadata().map_err(|e| io_err(&path, "reading", e))?.len();
            if len != p.len {
                // A sparse file of the part's length: holes until chunks arrive.
                f.set_len(p.len).map_err(|e| io_err(&path, "sizing", e))?;
            }
            parts.push(f);
        }
        let strips_path = dir.join(STRIPS);
        let strips_file = rw(&strips_path)?;
        let log_path = dir.join(LOG);
        let logged = std::fs::read(&log_path).unwrap_or_default();
        let mut state = State {
            chunks: manifest
                .parts
                .iter()
                .map(|p| vec![false; p.chunks.0.len()])
                .collect(),
            parts,
            strips: HashMap::new(),
            strips_file,
            strips_end: 0,
            log: OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log_path)
                .map_err(|e| io_err(&log_path, "opening", e))?,
            pending: String::new(),
            pending_n: 0,
        };
        let mut kept = Vec::new();
        let mut dropped = 0usize;
        for line in BufReader::new(&logged[..]).lines().map_while(Result::ok) {
            match parse_line(&line).and_then(|(p, off)| {
                let bytes = read_piece(&manifest, &state, p, off)?;
                manifest.verify(p, &bytes).ok()?;
                Some((p, off))
            }) {
                Some((p, off)) => {
                    mark(&manifest, &mut state, p, off);
                    kept.push(line);
                }
                None => dropped += 1,
            }
        }
        // Strip bytes past the last verified strip were cut off mid-write: reuse the room.
        state
            .strips_file
            .set_len(state.strips_end)
            .map_err(|e| io_err(&strips_path, "trimming", e))?;
        if dropped > 0 {
            tracing::warn!(
                "shard cache {}: {dropped} logged pieces failed their hash and will be fetched again",
                dir.display()
            );
            let tmp = dir.join("pieces.log.tmp");
            let body: String = kept.iter().map(|l| format!("{l}\n")).collect();
            std::fs::write(&tmp, body).map_err(|e| io_err(&tmp, "writing", e))?;
            std::fs::rename(&tmp, &log_path).map_err(|e| io_err(&log_path, "writing", e))?;
            state.log = OpenOptions::new()
                .append(true)
                .open(&log_path)
                .map_err(|e| io_err(&log_path, "opening", e))?;
        }
        let cache = ShardCache {
            dir,
            manifest: Arc::new(manifest),
            state: Mutex::new(state),
            _lock: lock,
        };
        cache.touch();
        Ok(cache)
    }

    /// Marks this model as just used (eviction takes the least recently used first).
    pub fn touch(&self) {
        let _ = std::fs::write(self.dir.join(USED), b"");
    }

    /// The first part's path: `GgufFile::open` maps it (and the other parts beside it).
    pub fn first_part(&self) -> PathBuf {
        self.dir.join(
            self.manifest
                .parts
                .first()
                .map(|p| p.name.as_str())
                .unwrap_or("model.gguf"),
        )
    }

    pub fn has(&self, p: Piece) -> bool {
        let Ok(s) = self.state.lock() else {
            return false;
        };
        match p {
            Piece::Chunk { part, index } => s
                .chunks
                .get(part as usize)
                .and_then(|c| c.get(index as usize))
                .copied()
                .unwrap_or(false),
            Piece::Strip { set, index } => s.strips.contains_key(&(set, index)),
        }
    }

    /// Every piece held.
    pub fn held(&self) -> Vec<Piece> {
        let Ok(s) = self.state.lock() else {
            return Vec::new();
        };
        let mut out: Vec<Piece> = s
            .chunks
            .iter()
            .enumerate()
            .flat_map(|(part, c)| {
                c.iter()
                    .enumerate()
                    .filter(|(_, &h)| h)
                    .map(move |(index, _)| Piece::Chunk {
                        part: part as u32,
                        index: index as u32,
                    })
            })
            .collect();
        out.extend(
            s.strips
                .keys()
                .map(|&(set, index)| Piece::Strip { set, index }),
        );
        out
    }

    /// Checks `bytes` against the manifest and stores them; an error says why they were
    /// refused (the caller fetches the piece again) or what could not be written.
    pub fn put(&self, p: Piece, bytes: &[u8]) -> Result<(), PutError> {
        self.manifest.verify(p, bytes).map_err(PutError::Bad)?;
        let mut s = self
            .state
            .lock()
            .map_err(|_| PutError::Io("the shard cache's lock is poisoned".into()))?;
        let io =
            |e: std::io::Error| PutError::Io(format!("shard cache {}: {e}", self.dir.display()));
        let line = match p {
            Piece::Chunk { part, index } => {
                if s.chunks[part as usize][index as usize] {
                    return Ok(());
                }
                let at = index as u64 * self.manifest.chunk_size;
                s.parts[part as usize].write_all_at(bytes, at).map_err(io)?;
                format!("c {part} {index}\n")
            }
            Piece::Strip { set, index } => {
                if s.strips.contains_key(&(set, index)) {
                    return Ok(());
                }
                let at = s.strips_end;
                s.strips_file.write_all_at(bytes, at).map_err(io)?;
                format!("s {set} {index} {at}\n")
            }
        };
        // The log line follows the bytes: a kill before it is written loses only the
        // pieces not yet logged, never logs a piece whose bytes are not there.
        s.pending.push_str(&line);
        s.pending_n += 1;
        if s.pending_n >= LOG_BATCH {
            s.flush_log().map_err(io)?;
        }
        let off = match p {
            Piece::Strip { .. } => s.strips_end,
            Piece::Chunk { .. } => 0,
        };
        mark(&self.manifest, &mut s, p, off);
        Ok(())
    }

    /// Writes the log lines of every piece stored so far.
    pub fn flush_log(&self) -> Result<(), String> {
        let mut s = self
            .state
            .lock()
            .map_err(|_| "the shard cache's lock is poisoned".to_string())?;
        s.flush_log()
            .map_err(|e| format!("shard cache {}: {e}", self.dir.display()))
    }

    /// A held piece's bytes (for serving it to another node).
    pub fn get(&self, p: Piece) -> Option<Vec<u8>> {
        let s = self.state.lock().ok()?;
        let off = match p {
            Piece::Chunk { part, index } => {
                if !*s.chunks.get(part as usize)?.get(index as usize)? {
                    return None;
                }
                0
            }
            Piece::Strip { set, index } => *s.strips.get(&(set, index))?,
        };
        read_piece(&self.manifest, &s, p, off)
    }

    /// What is held now, as the model's loader reads it.
    pub fn view(&self) -> Result<Arc<CacheView>, String> {
        let mut s = self
            .state
            .lock()
            .map_err(|_| "the shard cache's lock is poisoned".to_string())?;
        s.flush_log()
            .map_err(|e| format!("shard cache {}: {e}", self.dir.display()))?;
        let strips = if s.strips_end > 0 {
            // SAFETY: strips.bin only grows past what is mapped and is never rewritten
            // below `strips_end` while the cache is open.
            Some(
                unsafe { memmap2::Mmap::map(&s.strips_file) }
                    .map_err(|e| format!("mapping {}: {e}", self.dir.join(STRIPS).display()))?,
            )
        } else {
            None
        };
        Ok(Arc::new(CacheView {
            manifest: self.manifest.clone(),
            chunks: s.chunks.clone(),
            strip_at: s.strips.clone(),
            sets: self
                .manifest
                .strips
                .iter()
                .enumerate()
                .map(|(i, st)| (st.tensor.clone(), i as u32))
                .collect(),
            strips,
        }))
    }
}

impl Drop for ShardCache {
    fn drop(&mut self) {
        if let Ok(mut s) = self.state.lock() {
            let _ = s.flush_log();
        }
    }
}

/// Why a piece was not stored.
#[derive(Debug)]
pub enum PutError {
    /// The bytes are not the piece's: fetch it again, from another holder if one exists.
    Bad(String),
    /// The cache could not be written.
    Io(String),
}

fn parse_line(line: &str) -> Option<(Piece, u64)> {
    let mut w = line.split(' ');
    let kind = w.next()?;
    let a: u32 = w.next()?.parse().ok()?;
    let b: u32 = w.next()?.parse().ok()?;
    match kind {
        "c" => Some((Piece::Chunk { part: a, index: b }, 0)),
        "s" => Some((Piece::Strip { set: a, index: b }, w.next()?.parse().ok()?)),
        _ => None,
    }
}

fn mark(m: &Manifest, s: &mut State, p: Piece, off: u64) {
    match p {
        Piece::Chunk { part, index } => {
            if let Some(c) = s
                .chunks
                .get_mut(part as usize)
                .and_then(|c| c.get_mut(index as usize))
            {
                *c = true;
            }
        }
        Piece::Strip { set, index } => {
            s.strips.insert((set, index), off);
            if let Some(st) = m.strips.get(set as usize) {
                s.strips_end = s.strips_end.max(off + st.strip_bytes());
            }
        }
    }
}

fn read_piece(m: &Manifest, s: &State, p: Piece, off: u64) -> Option<Vec<u8>> {
    let (len, _) = m.piece_info(p)?;
    let mut buf = vec![0u8; len as usize];
    match p {
        Piece::Chunk { part, index } => s
            .parts
            .get(part as usize)?
            .read_exact_at(&mut buf, index as u64 * m.chunk_size)
            .ok()?,
        Piece::Strip { .. } => s.strips_file.read_exact_at(&mut buf, off).ok()?,
    }
    Some(buf)
}

/// A snapshot of a cache's pieces for the model's loader (`weft_gguf::PartialData`).
pub struct CacheView {
    manifest: Arc<Manifest>,
    chunks: Vec<Vec<bool>>,
    strip_at: HashMap<(u32, u32), u64>,
    sets: HashMap<String, u32>,
    strips: Option<memmap2::Mmap>,
}

impl PartialData for CacheView {
    fn check(&self, r: Range<usize>) -> Result<(), String> {
        let m = &self.manifest;
        let missing = |why: &str| format!("bytes {r:?} are not in this node's shard cache ({why})");
        if r.is_empty() {
            return Ok(());
        }
        let part = m
            .part_of(r.start as u64)
            .ok_or_else(|| missing("outside the model"))?;
        let p = &m.parts[part];
        let c0 = (r.start as u64 - p.base) / m.chunk_size;
        let c1 = (r.end as u64 - p.base).div_ceil(m.chunk_size);
        let held = &self.chunks[part];
        if (c0..c1).all(|c| held.get(c as usize).copied().unwrap_or(false)) {
            Ok(())
        } else {
            Err(missing("a chunk was never fetched"))
        }
    }

    fn columns(
        &self,
        _index: usize,
        t: &TensorInfo,
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Result<Vec<u8>, String> {
        let set = *self
            .sets
            .get(&t.name)
            .ok_or_else(|| "the manifest has no column strips for it".to_string())?;
        let st = &self.manifest.strips[set as usize];
        let strips = self
            .strips
            .as_ref()
            .ok_or_else(|| "no column strips are in this node's shard cache".to_string())?;
        let bs = t.ty.block_size();
        let (b0, b1) = (cols.start / bs, cols.end / bs);
        let bb = st.block_bytes as usize;
        let mut out = Vec::with_capacity(rows.len() * (b1 - b0) * bb);
        for row in rows {
            let slab = row as u64 / st.rows_per_slab;
            let within = row as u64 % st.rows_per_slab;
            for block in b0..b1 {
                let index = (slab * st.blocks_per_row() + block as u64) as u32;
                let at = *self.strip_at.get(&(set, index)).ok_or_else(|| {
                    format!("column strip {index} of row {row} is not in this node's shard cache")
                })? as usize
                    + within as usize * bb;
                out.extend_from_slice(
                    strips.get(at..at + bb).ok_or_else(|| {
                        format!("column strip {index} lies past strips.bin's end")
                    })?,
                );
            }
        }
        Ok(out)
    }
}

/// A cached model as `weft cluster status` lists it.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct CacheEntry {
    pub root: String,
    /// The model's first file name.
    pub model: String,
    /// Bytes on disk (allocated blocks: the parts are sparse).
    pub disk_bytes: u64,
    pub model_bytes: u64,
    /// Seconds since it was last used.
    pub idle_s: u64,
    /// Its directory (not sent: where eviction removes it).
    #[serde(skip)]
    pub dir: PathBuf,
}

/// Allocated bytes of every file in `dir` (sparse holes take none).
pub fn disk_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.blocks() * 512)
                .sum()
        })
        .unwrap_or(0)
}

/// Every model cached under `shards`, least recently used first.
pub fn list(shards: &Path) -> Vec<CacheEntry> {
    let now = SystemTime::now();
    let mut out: Vec<(SystemTime, CacheEntry)> = std::fs::read_dir(shards)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter_map(|e| {
                    let dir = e.path();
                    let bytes = std::fs::read(dir.join(MANIFEST)).ok()?;
                    let m: Manifest = serde_json::from_slice(&bytes).ok()?;
                    let hex = m.root.len() == 64 && m.root.bytes().all(|b| b.is_ascii_hexdigit());
                    if !hex || dir != ShardCache::dir_for(shards, &m.root) {
                        return None;
                    }
                    let used = std::fs::metadata(dir.join(USED))
                        .and_then(|m| m.modified())
                        .unwrap_or(SystemTime::UNIX_EPOCH);
                    Some((
                        used,
                        CacheEntry {
                            model: m.parts.first().map(|p| p.name.clone()).unwrap_or_default(),
                            model_bytes: m.total_len(),
                            root: m.root,
                            disk_bytes: disk_bytes(&dir),
                            idle_s: now.duration_since(used).map(|d| d.as_secs()).unwrap_or(0),
                            dir: dir.clone(),
                        },
                    ))
                })
                .collect()
        })
        .unwrap_or_default();
    out.sort_by_key(|(t, _)| *t);
    out.into_iter().map(|(_, e)| e).collect()
}

/// Removes whole cached models, least recently used first, until the cache fits in
/// `limit` bytes; never `keep` (the model in use). Returns what it removed.
pub fn evict(shards: &Path, limit: u64, keep: &str) -> Vec<CacheEntry> {
    let entries = list(shards);
    let mut total: u64 = entries.iter().map(|e| e.disk_bytes).sum();
    let mut removed = Vec::new();
    for e in entries {
        if total <= limit {
            break;
        }
        if e.root == keep {
            continue;
        }
        // A model another process has open is not removed under it.
        let Ok(lock) = lock_dir(&e.dir) else {
            continue;
        };
        let dir = e.dir.clone();
        drop(lock);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => {
                total -= e.disk_bytes;
                tracing::info!(
                    "shard cache over its limit: evicted {} ({}, {} bytes)",
                    e.model,
                    e.root.get(..16).unwrap_or(&e.root),
                    e.disk_bytes
                );
                removed.push(e);
            }
            Err(err) => tracing::warn!("evicting {}: {err}", dir.display()),
        }
    }
    removed
}

/// Gathers strip `index` of set `set` from a whole model's bytes (what a holder of the
/// full file sends).
pub fn strip_from_file(
    m: &Manifest,
    file: &weft_gguf::GgufFile,
    set: u32,
    index: u32,
) -> Option<Vec<u8>> {
    let st = m.strips.get(set as usize)?;
    let bpr = st.blocks_per_row();
    let (slab, block) = (index as u64 / bpr, index as u64 % bpr);
    if slab >= st.slabs {
        return None;
    }
    let len = (st.slabs * st.rows_per_slab * st.row_bytes) as usize;
    let bytes = file.slice(st.start as usize..st.start as usize + len);
    let mut out = Vec::new();
    gather_strip(st, slab, block, |r| &bytes[r], &mut out);
    Some(out)
}
