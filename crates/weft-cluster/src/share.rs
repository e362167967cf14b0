//! Shard sharing over the cluster's authenticated connections (the share channel of
//! `control::Channel`): a holder answers for a model's manifest, what it holds, and
//! pieces; `PeerSource` asks one holder for them (weft-share's `Source`); `ShareHost` is
//! the coordinator's server over its whole file; `NodeShards` is a node's cache of every
//! model, served to other nodes while it is filled.
//!
//! Requests: one op byte (`M` manifest, `H` holding, `P` pieces, `L` cached models), the
//! model's root as 64 hex digits (`ANY_ROOT` for `M`: the manifest of whatever the
//! coordinator serves, hashed on that first demand), and for `P` a count (u32) and each
//! piece (kind u8, two u32). Replies: a
//! status byte (0 ok, 1 not held, 2 error), a u64 length and that many bytes, one reply
//! per piece in order. The pieces are checked by their receiver against the manifest, so
//! a holder needs no trust beyond the cluster secret.

use std::collections::{HashMap, HashSet};
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use weft_gguf::GgufFile;
use weft_share::{Holding, Manifest, Piece, ShardCache, Source};

use crate::control::{self, Channel};

const OP_MANIFEST: u8 = b'M';
const OP_HOLDING: u8 = b'H';
const OP_PIECES: u8 = b'P';
const OP_LIST: u8 = b'L';
const OK: u8 = 0;
const ABSENT: u8 = 1;
const ERROR: u8 = 2;
/// The root a node names to ask the coordinator's share port for the manifest of
/// whatever model it serves (a plan that leaves the root out).
pub const ANY_ROOT: &str = "0000000000000000000000000000000000000000000000000000000000000000";
/// Pieces one request may ask for.
const MAX_ASK: u32 = 4096;
/// A reply longer than this is refused (a manifest of 2^16 chunks and strips is far less).
const MAX_REPLY: u64 = 1 << 30;
/// Pieces asked in one request.
const BATCH: usize = 64;
/// Requests in flight at once on a connection: the holder finds the next one waiting.
const AHEAD: usize = 2;
/// How long a holder may be silent in the middle of a reply.
const READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Connections the coordinator's share port serves (and authenticates) at once.
const MAX_SHARE_CONNECTIONS: usize = 64;
/// Test aid: the first N distinct pieces a holder sends on a connection have one byte
/// flipped (a piece asked again comes right, as after a flaky link).
pub const CORRUPT_ENV: &str = "WEFT_TEST_CORRUPT_PIECES";
/// Test aid: milliseconds a holder waits before sending each piece.
pub const DELAY_ENV: &str = "WEFT_TEST_SHARE_DELAY_MS";

/// What a holder can answer.
pub trait Holder: Send + Sync {
    fn manifest(&self, root: &str) -> Option<Vec<u8>>;
    fn holding(&self, root: &str) -> Option<Holding>;
    fn piece(&self, root: &str, p: Piece) -> Option<Vec<u8>>;
    /// Hands piece `p`'s bytes to `f` without copying them where the holder can (a whole
    /// file's chunks are slices of its map); None when it does not hold the piece.
    fn piece_with(
        &self,
        root: &str,
        p: Piece,
        f: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Option<std::io::Result<()>> {
        self.piece(root, p).map(|b| f(&b))
    }
    /// The models this holder caches (for `weft cluster status`).
    fn caches(&self) -> Vec<weft_share::CacheEntry> {
        Vec::new()
    }
    /// Bytes of pieces it has sent.
    fn sent(&self) -> u64 {
        0
    }
    /// The root of the model it serves, once known (a whole file's manifest is built
    /// only when first asked for).
    fn built_root(&self) -> Option<String> {
        None
    }
}

fn encode_piece(p: Piece, out: &mut Vec<u8>) {
    let (k, a, b) = match p {
        Piece::Chunk { part, index } => (0u8, part, index),
        Piece::Strip { set, index } => (1u8, set, index),
    };
    out.push(k);
    out.extend_from_slice(&a.to_le_bytes());
    out.extend_from_slice(&b.to_le_bytes());
}

fn decode_piece(b: &[u8; 9]) -> Option<Piece> {
    let a = u32::from_le_bytes([b[1], b[2], b[3], b[4]]);
    let c = u32::from_le_bytes([b[5], b[6], b[7], b[8]]);
    match b[0] {
        0 => Some(Piece::Chunk { part: a, index: c }),
        1 => Some(Piece::Strip { set: a, index: c }),
        _ => None,
    }
}

fn reply(w: &mut BufWriter<TcpStream>, status: u8, body: &[u8]) -> std::io::Result<()> {
    let mut head = [0u8; 9];
    head[0] = status;
    head[1..].copy_from_slice(&(body.len() as u64).to_le_bytes());
    if body.len() < w.capacity() {
        w.write_all(&head)?;
        return w.write_all(body);
    }
    // A piece: header and body in one system call where the socket takes them.
    w.flush()?;
    let s = w.get_mut();
    let mut parts = [std::io::IoSlice::new(&head), std::io::IoSlice::new(body)];
    let mut slices: &mut [std::io::IoSlice] = &mut parts;
    while !slices.is_empty() {
        let n = s.write_vectored(slices)?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        std::io::IoSlice::advance_slices(&mut slices, n);
    }
    Ok(())
}

fn env_u64(name: &str) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Answers share requests on an authenticated stream until the peer closes it.
pub fn serve_share(stream: TcpStream, holder: &dyn Holder, peer: &str) {
    if let Err(e) = serve_requests(stream, holder) {
        tracing::debug!("share connection from {peer} ended: {e}");
    }
}

fn serve_requests(stream: TcpStream, holder: &dyn Holder) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(300)))?;
    // A peer that stops reading must not hold this thread for ever.
    stream.set_write_timeout(Some(READ_TIMEOUT))?;
    let mut r = BufReader::new(stream.try_clone()?);
    // Small: a piece (64 KiB or more) is written past it, not copied into it.
    let mut w = BufWriter::with_capacity(16 << 10, stream);
    let (corrupt, delay) = (env_u64(CORRUPT_ENV), env_u64(DELAY_ENV));
    let mut corrupted: HashSet<Piece> = HashSet::new();
    loop {
        let mut op = [0u8; 1];
        if r.read(&mut op)? == 0 {
            return Ok(());
        }
        let mut root = [0u8; 64];
        r.read_exact(&mut root)?;
        let root = String::from_utf8_lossy(&root).into_owned();
        match op[0] {
            OP_MANIFEST => match holder.manifest(&root) {
                Some(m) => reply(&mut w, OK, &m)?,
                None => reply(&mut w, ABSENT, b"")?,
            },
            OP_LIST => reply(
                &mut w,
                OK,
                &serde_json::to_vec(&holder.caches()).unwrap_or_default(),
            )?,
            OP_HOLDING => match holder.holding(&root) {
                Some(Holding::All) => reply(&mut w, OK, &[1])?,
                Some(Holding::Some(set)) => {
                    let mut body = vec![0u8];
                    body.extend_from_slice(&(set.len() as u32).to_le_bytes());
                    for p in set {
                        encode_piece(p, &mut body);
                    }
                    reply(&mut w, OK, &body)?
                }
                None => reply(&mut w, ABSENT, b"")?,
            },
            OP_PIECES => {
                let mut n = [0u8; 4];
                r.read_exact(&mut n)?;
                let n = u32::from_le_bytes(n);
                if n > MAX_ASK {
                    reply(
                        &mut w,
                        ERROR,
                        format!("{n} pieces asked, at most {MAX_ASK}").as_bytes(),
                    )?;
                    w.flush()?;
                    return Ok(());
                }
                let mut asked = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    let mut b = [0u8; 9];
                    r.read_exact(&mut b)?;
                    asked.push(decode_piece(&b));
                }
                for p in asked {
                    if corrupt == 0 && delay == 0 {
                        // The usual path: bytes straight from the holder to the socket.
                        let sent = p.and_then(|p| {
                            holder.piece_with(&root, p, &mut |bytes| reply(&mut w, OK, bytes))
                        });
                        match sent {
                            Some(r) => r?,
                            None => reply(&mut w, ABSENT, b"")?,
                        }
                        continue;
                    }
                    match p.and_then(|p| Some((p, holder.piece(&root, p)?))) {
                        Some((p, mut bytes)) => {
                            if delay > 0 {
                                w.flush()?;
                                std::thread::sleep(Duration::from_millis(delay));
                            }
                            if (corrupted.len() as u64) < corrupt && corrupted.insert(p) {
                                if let Some(b) = bytes.first_mut() {
                                    *b ^= 0x5a;
                                }
                            }
                            reply(&mut w, OK, &bytes)?
                        }
                        None => reply(&mut w, ABSENT, b"")?,
                    }
                }
            }
            x => {
                reply(
                    &mut w,
                    ERROR,
                    format!("unknown share op {x:#04x}").as_bytes(),
                )?;
                w.flush()?;
                return Ok(());
            }
        }
        w.flush()?;
    }
}

/// A holder's answer to `H`: 1 (everything), or 0, a count and the pieces.
pub fn parse_holding(body: &[u8]) -> Result<Holding, String> {
    match body.first() {
        Some(1) => Ok(Holding::All),
        Some(0) if body.len() >= 5 => {
            let n = u32::from_le_bytes([body[1], body[2], body[3], body[4]]) as usize;
            let rest = &body[5..];
            if rest.len() != n.saturating_mul(9) {
                return Err(format!(
                    "a holding list of {n} pieces in {} bytes",
                    rest.len()
                ));
            }
            Ok(Holding::Some(
                rest.chunks_exact(9)
                    .filter_map(|c| decode_piece(c.try_into().ok()?))
                    .collect(),
            ))
        }
        _ => Err("a malformed holding reply".into()),
    }
}

/// One holder, asked over the network.
pub struct PeerSource {
    addr: String,
    secret: Vec<u8>,
    root: String,
    stream: Option<(BufReader<TcpStream>, TcpStream)>,
}

impl PeerSource {
    pub fn new(addr: &str, secret: &[u8], root: &str) -> Self {
        PeerSource {
            addr: addr.to_string(),
            secret: secret.to_vec(),
            root: root.to_string(),
            stream: None,
        }
    }

    /// The manifest of whatever model the holder serves (asked under `ANY_ROOT`), waited
    /// for however long the holder takes to build it while `alive` holds: a coordinator
    /// hashes its whole file first, which READ_TIMEOUT would not allow for.
    pub fn manifest_when_ready(&mut self, alive: &dyn Fn() -> bool) -> Result<Vec<u8>, String> {
        self.root = ANY_ROOT.to_string();
        self.ask(OP_MANIFEST, &[]).map_err(|e| self.fail(e))?;
        self.await_reply(alive).map_err(|e| self.fail(e))?;
        match self.read_reply().map_err(|e| self.fail(e))? {
            (OK, body) => Ok(body),
            _ => Err("it serves no model".into()),
        }
    }

    /// Returns once a reply has begun to arrive (or the connection ended), polling each
    /// second whether `alive` still holds.
    fn await_reply(&mut self, alive: &dyn Fn() -> bool) -> Result<(), String> {
        let (r, s) = self.conn()?;
        if !r.buffer().is_empty() {
            return Ok(());
        }
        let io = |e: std::io::Error| format!("waiting for a reply: {e}");
        s.set_read_timeout(Some(Duration::from_secs(1)))
            .map_err(io)?;
        let waited = loop {
            match s.peek(&mut [0u8; 1]) {
                // Data, or the end of the stream, which the read that follows reports.
                Ok(_) => break Ok(()),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    if !alive() {
                        break Err("its owner went silent while it was awaited".to_string());
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => break Err(io(e)),
            }
        };
        s.set_read_timeout(Some(READ_TIMEOUT)).map_err(io)?;
        waited
    }

    fn conn(&mut self) -> Result<&mut (BufReader<TcpStream>, TcpStream), String> {
        if self.stream.is_none() {
            let s = control::dial_channel(
                &self.addr,
                &self.secret,
                Duration::from_secs(10),
                Channel::Share,
            )?;
            s.set_read_timeout(Some(READ_TIMEOUT))
                .map_err(|e| e.to_string())?;
            // A reply's header and no more: a piece's body is then read past this buffer
            // straight into the caller's, not copied through it.
            let r = BufReader::with_capacity(9, s.try_clone().map_err(|e| e.to_string())?);
            self.stream = Some((r, s));
        }
        self.stream.as_mut().ok_or_else(|| "no connection".into())
    }

    fn ask(&mut self, op: u8, extra: &[u8]) -> Result<(), String> {
        let mut req = vec![op];
        req.extend_from_slice(self.root.as_bytes());
        req.extend_from_slice(extra);
        let (_, w) = self.conn()?;
        w.write_all(&req)
            .map_err(|e| format!("sending a request: {e}"))
    }

    fn read_reply(&mut self) -> Result<(u8, Vec<u8>), String> {
        let mut body = Vec::new();
        let status = self.read_reply_into(&mut body)?;
        Ok((status, body))
    }

    /// Reads one reply's body into `body` (cleared first; its capacity is kept, so a
    /// fetch reuses one buffer that stays in the core's cache) and returns its status.
    fn read_reply_into(&mut self, body: &mut Vec<u8>) -> Result<u8, String> {
        let (r, _) = self.conn()?;
        let mut head = [0u8; 9];
        r.read_exact(&mut head)
            .map_err(|e| format!("reading a reply: {e}"))?;
        let len = u64::from_le_bytes(head[1..9].try_into().unwrap_or([0; 8]));
        if len > MAX_REPLY {
            return Err(format!(
                "a reply of {len} bytes, over the {MAX_REPLY}-byte limit"
            ));
        }
        body.clear();
        // Read into spare capacity, not zeroed memory: a piece's bytes are written once.
        body.reserve(len as usize);
        r.take(len)
            .read_to_end(body)
            .map_err(|e| format!("reading a reply: {e}"))?;
        if body.len() as u64 != len {
            return Err(format!(
                "the reply ended after {} of {len} bytes",
                body.len()
            ));
        }
        if head[0] == ERROR {
            return Err(format!("it answered: {}", String::from_utf8_lossy(body)));
        }
        Ok(head[0])
    }

    fn ask_pieces(&mut self, pieces: &[Piece]) -> Result<(), String> {
        let mut extra = (pieces.len() as u32).to_le_bytes().to_vec();
        for &p in pieces {
            encode_piece(p, &mut extra);
        }
        self.ask(OP_PIECES, &extra)
    }

    fn fail(&mut self, e: String) -> String {
        self.stream = None;
        e
    }
}

impl Source for PeerSource {
    fn name(&self) -> String {
        self.addr.clone()
    }

    fn manifest(&mut self, root: &str) -> Result<Vec<u8>, String> {
        self.root = root.to_string();
        self.ask(OP_MANIFEST, &[]).map_err(|e| self.fail(e))?;
        match self.read_reply().map_err(|e| self.fail(e))? {
            (OK, body) => Ok(body),
            _ => Err("it does not hold this model".into()),
        }
    }

    fn holding(&mut self) -> Result<Holding, String> {
        self.ask(OP_HOLDING, &[]).map_err(|e| self.fail(e))?;
        let (status, body) = self.read_reply().map_err(|e| self.fail(e))?;
        if status != OK {
            return Ok(Holding::Some(HashSet::new()));
        }
        parse_holding(&body)
    }

    fn fetch(
        &mut self,
        pieces: &[Piece],
        got: &(dyn Fn(Piece, &[u8]) -> bool + Sync),
    ) -> Result<(), String> {
        // Requests of BATCH pieces, AHEAD of them in flight: the holder finds the next
        // request waiting when it ends one, so its socket never runs dry between them.
        // One connection: two, each on its own thread, were slower on two cores (the
        // receiving end's copying, hashing and storing already fill one core, and the
        // sender and the network stack the other).
        let batches = pieces.chunks(BATCH);
        let mut ahead = batches.clone();
        for batch in ahead.by_ref().take(AHEAD - 1) {
            self.ask_pieces(batch).map_err(|e| self.fail(e))?;
        }
        let mut body = Vec::new();
        for batch in batches {
            if let Some(next) = ahead.next() {
                self.ask_pieces(next).map_err(|e| self.fail(e))?;
            }
            for &p in batch {
                let status = self.read_reply_into(&mut body).map_err(|e| self.fail(e))?;
                if status != OK {
                    // It held the piece when asked what it holds; now it does not.
                    return Err(self.fail(format!("it no longer holds {p:?}")));
                }
                if !got(p, &body) {
                    return Err(self.fail("stopped".into()));
                }
            }
        }
        Ok(())
    }
}

/// A holder of a whole model file (the coordinator).
pub struct FileHolder {
    pub file: Arc<GgufFile>,
    /// Where the manifest is cached between runs.
    home: Option<PathBuf>,
    /// The manifest and its JSON, built when a node first asks: hashing a large model
    /// takes minutes, and a cluster whose nodes all hold the file never needs it.
    built: OnceLock<(Arc<Manifest>, Vec<u8>)>,
    /// Bytes of pieces sent, for the report.
    pub sent: AtomicU64,
}

impl FileHolder {
    /// `file`, its manifest built (or read from `home`'s cache) on first demand.
    pub fn new(file: Arc<GgufFile>, home: Option<PathBuf>) -> Self {
        FileHolder {
            file,
            home,
            built: OnceLock::new(),
            sent: AtomicU64::new(0),
        }
    }

    pub fn built_manifest(&self) -> &Arc<Manifest> {
        &self.built().0
    }

    fn built(&self) -> &(Arc<Manifest>, Vec<u8>) {
        self.built.get_or_init(|| {
            let m = manifest_for(&self.file, self.home.as_deref());
            let json = serde_json::to_vec(&m).unwrap_or_default();
            (Arc::new(m), json)
        })
    }

    /// Whether `root` names this file's model (building the manifest if need be).
    fn is(&self, root: &str) -> bool {
        root == self.built_manifest().root
    }
}

impl Holder for FileHolder {
    fn manifest(&self, root: &str) -> Option<Vec<u8>> {
        (root == ANY_ROOT || self.is(root)).then(|| self.built().1.clone())
    }

    fn holding(&self, root: &str) -> Option<Holding> {
        self.is(root).then_some(Holding::All)
    }

    fn built_root(&self) -> Option<String> {
        self.built.get().map(|b| b.0.root.clone())
    }

    fn piece(&self, root: &str, p: Piece) -> Option<Vec<u8>> {
        if !self.is(root) {
            return None;
        }
        let m = self.built_manifest();
        let bytes = match p {
            Piece::Chunk { part, index } => {
                let r = m.chunk_range(part as usize, index as u64)?;
                self.file.slice(r.start as usize..r.end as usize).to_vec()
            }
            Piece::Strip { set, index } => {
                weft_share::cache::strip_from_file(m, &self.file, set, index)?
            }
        };
        self.sent.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Some(bytes)
    }

    fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    fn piece_with(
        &self,
        root: &str,
        p: Piece,
        f: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Option<std::io::Result<()>> {
        match p {
            Piece::Chunk { part, index } if self.is(root) => {
                let r = self
                    .built_manifest()
                    .chunk_range(part as usize, index as u64)?;
                self.sent.fetch_add(r.end - r.start, Ordering::Relaxed);
                Some(f(self.file.slice(r.start as usize..r.end as usize)))
            }
            _ => self.piece(root, p).map(|b| f(&b)),
        }
    }
}

/// A node's shard caches (every model under its `shards/`), opened on first use and
/// shared between its fetches and the other nodes it serves.
pub struct NodeShards {
    pub dir: PathBuf,
    open: Mutex<HashMap<String, Arc<ShardCache>>>,
}

impl NodeShards {
    pub fn new(dir: PathBuf) -> Self {
        NodeShards {
            dir,
            open: Mutex::new(HashMap::new()),
        }
    }

    /// The cache of `manifest`'s model, created if new.
    pub fn open(&self, manifest: Manifest) -> Result<Arc<ShardCache>, String> {
        let mut open = self
            .open
            .lock()
            .map_err(|_| "the cache table's lock is poisoned")?;
        if let Some(c) = open.get(&manifest.root) {
            return Ok(c.clone());
        }
        let root = manifest.root.clone();
        let c = Arc::new(ShardCache::open(&self.dir, manifest)?);
        open.insert(root, c.clone());
        Ok(c)
    }

    fn existing(&self, root: &str) -> Option<Arc<ShardCache>> {
        if root.len() != 64 || !root.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let mut open = self.open.lock().ok()?;
        if let Some(c) = open.get(root) {
            return Some(c.clone());
        }
        let dir = ShardCache::dir_for(&self.dir, root);
        let c = Arc::new(ShardCache::open_existing(&dir).ok()?);
        if c.manifest.root != root {
            return None;
        }
        open.insert(root.to_string(), c.clone());
        Some(c)
    }

    /// Drops a model evicted from disk.
    pub fn forget(&self, root: &str) {
        if let Ok(mut open) = self.open.lock() {
            open.remove(root);
        }
    }

    /// Closes every cache but `keep`'s (releasing their locks, so eviction may take them).
    pub fn close_except(&self, keep: &str) {
        if let Ok(mut open) = self.open.lock() {
            open.retain(|root, _| root == keep);
        }
    }
}

impl Holder for NodeShards {
    fn manifest(&self, root: &str) -> Option<Vec<u8>> {
        let c = self.existing(root)?;
        serde_json::to_vec(&*c.manifest).ok()
    }

    fn holding(&self, root: &str) -> Option<Holding> {
        Some(Holding::Some(
            self.existing(root)?.held().into_iter().collect(),
        ))
    }

    fn piece(&self, root: &str, p: Piece) -> Option<Vec<u8>> {
        self.existing(root)?.get(p)
    }

    fn caches(&self) -> Vec<weft_share::CacheEntry> {
        weft_share::cache::list(&self.dir)
    }
}

/// The models node `addr` caches, least recently used first.
pub fn list_caches(addr: &str, secret: &[u8]) -> Result<Vec<weft_share::CacheEntry>, String> {
    let mut p = PeerSource::new(addr, secret, ANY_ROOT);
    p.ask(OP_LIST, &[])?;
    let (_, body) = p.read_reply()?;
    serde_json::from_slice(&body).map_err(|e| format!("a malformed cache list: {e}"))
}

/// The coordinator's share server, on a port of its own: its whole model file, or (with
/// the model on a hub) the manifest and headers it fetched.
pub struct ShareHost {
    pub holder: Arc<dyn Holder>,
    /// The model's root when known at the start (a hub's); a whole file's comes from its
    /// holder once a node has asked for the manifest.
    root: Option<String>,
    pub port: u16,
    /// Each part's hub URL, when nodes fetch from the hub.
    pub hub_urls: Vec<String>,
}

impl std::fmt::Debug for ShareHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ShareHost(port {}, root {:?})", self.port, self.root())
    }
}

impl ShareHost {
    /// Serves `file` to anyone who proves `secret`; its manifest is built (or read from
    /// `home`'s cache) when a node first asks for it.
    pub fn start(
        file: Arc<GgufFile>,
        home: Option<PathBuf>,
        secret: &[u8],
    ) -> Result<Arc<Self>, String> {
        Self::start_with(
            Arc::new(FileHolder::new(file, home)),
            None,
            Vec::new(),
            secret,
        )
    }

    /// Serves what `holder` holds of model `root` (None: the holder says, once it knows).
    pub fn start_with(
        holder: Arc<dyn Holder>,
        root: Option<String>,
        hub_urls: Vec<String>,
        secret: &[u8],
    ) -> Result<Arc<Self>, String> {
        let listener = TcpListener::bind("0.0.0.0:0").map_err(|e| format!("share port: {e}"))?;
        let port = listener.local_addr().map_err(|e| e.to_string())?.port();
        let (h, secret) = (holder.clone(), secret.to_vec());
        let live = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        std::thread::Builder::new()
            .name("weft-share".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    let Ok(mut s) = conn else { continue };
                    if live.fetch_add(1, Ordering::SeqCst) >= MAX_SHARE_CONNECTIONS {
                        live.fetch_sub(1, Ordering::SeqCst);
                        tracing::warn!(
                            "share port: over {MAX_SHARE_CONNECTIONS} connections, refusing one"
                        );
                        continue;
                    }
                    let (h, secret, live) = (h.clone(), secret.clone(), live.clone());
                    let _ = std::thread::Builder::new()
                        .name("weft-share-conn".into())
                        .spawn(move || {
                            struct Leave(Arc<std::sync::atomic::AtomicUsize>);
                            impl Drop for Leave {
                                fn drop(&mut self) {
                                    self.0.fetch_sub(1, Ordering::SeqCst);
                                }
                            }
                            let _leave = Leave(live);
                            let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                            match control::accept(&mut s, &secret, Duration::from_secs(3)) {
                                Ok(Channel::Share) => serve_share(s, &*h, &peer),
                                Ok(Channel::Control) => {
                                    tracing::debug!(
                                        "{peer} opened a control channel on the share port"
                                    )
                                }
                                Err(e) => tracing::debug!("share connection from {peer}: {e}"),
                            }
                        });
                }
            })
            .map_err(|e| format!("share thread: {e}"))?;
        Ok(Arc::new(ShareHost {
            holder,
            root,
            port,
            hub_urls,
        }))
    }

    /// The model's root, once known: None until a node has asked for the manifest of a
    /// whole file (plans then leave the root for the nodes to ask).
    pub fn root(&self) -> Option<String> {
        self.root.clone().or_else(|| self.holder.built_root())
    }

    pub fn bytes_sent(&self) -> u64 {
        self.holder.sent()
    }
}

/// The manifest of `file`, read from `home`'s manifests/ when this file (by path, size
/// and modification time) was hashed before, else built and saved there.
pub fn manifest_for(file: &GgufFile, home: Option<&Path>) -> Manifest {
    let key = std::fs::metadata(file.path()).ok().map(|m| {
        use sha2::Digest;
        let mtime = m
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        let path = std::fs::canonicalize(file.path()).unwrap_or_else(|_| file.path().to_path_buf());
        let h = sha2::Sha256::digest(format!("{}|{}|{mtime}", path.display(), file.file_len()));
        h.iter()
            .take(12)
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    });
    let cached = home
        .zip(key.as_ref())
        .map(|(h, k)| h.join("manifests").join(format!("{k}.json")));
    if let Some(m) = cached.as_ref().and_then(|p| Manifest::read_file(p).ok()) {
        return m;
    }
    let t = std::time::Instant::now();
    let m = Manifest::build(file);
    tracing::info!(
        "hashed {} for sharing in {:.2} s (root {})",
        file.path().display(),
        t.elapsed().as_secs_f64(),
        &m.root[..16]
    );
    if let Some(p) = cached {
        if let Err(e) = m.write_file(&p) {
            tracing::warn!("keeping the manifest: {e}");
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A holder that takes `ms` to answer for its manifest, as a coordinator hashing a
    /// large file does.
    struct SlowManifest {
        ms: u64,
    }

    impl Holder for SlowManifest {
        fn manifest(&self, root: &str) -> Option<Vec<u8>> {
            std::thread::sleep(Duration::from_millis(self.ms));
            (root == ANY_ROOT).then(|| b"the manifest".to_vec())
        }
        fn holding(&self, _: &str) -> Option<Holding> {
            None
        }
        fn piece(&self, _: &str, _: Piece) -> Option<Vec<u8>> {
            None
        }
    }

    #[test]
    fn a_node_waits_for_a_manifest_while_the_coordinator_beats() {
        let secret = weft_comm::handshake::random_secret();
        let host = ShareHost::start_with(
            Arc::new(SlowManifest { ms: 2500 }),
            None,
            Vec::new(),
            secret.as_bytes(),
        )
        .unwrap();
        let addr = format!("127.0.0.1:{}", host.port);
        // Alive: waited for through several one-second polls.
        let mut node = PeerSource::new(&addr, secret.as_bytes(), ANY_ROOT);
        assert_eq!(node.manifest_when_ready(&|| true).unwrap(), b"the manifest");
        // The coordinator's control link silent: given up at the first poll, before the
        // answer comes.
        let mut node = PeerSource::new(&addr, secret.as_bytes(), ANY_ROOT);
        let err = node.manifest_when_ready(&|| false).unwrap_err();
        assert!(err.contains("went silent"), "{err}");
    }
}
