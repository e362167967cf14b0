//! The manifest: a model's bytes as BLAKE3-hashed pieces (fixed-size chunks of every part,
//! and per-block column strips of every matrix, for column-split shards), bound together
//! by one root hash, the model's content hash and the shard cache's key.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};
use weft_gguf::GgufFile;

/// The smallest chunk: range ends waste at most this much on either side.
pub const MIN_CHUNK: u64 = 64 << 10;
/// Chunks per model at most (the chunk size doubles until the model fits in these), so a
/// manifest stays a few MiB even for a terabyte model.
pub const MAX_CHUNKS: u64 = 1 << 16;

pub type Hash = [u8; 32];

/// A list of hashes, written as one hex string (64 characters each).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Hashes(pub Vec<Hash>);

impl Serialize for Hashes {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut out = String::with_capacity(self.0.len() * 64);
        for h in &self.0 {
            out.push_str(&hex(h));
        }
        s.serialize_str(&out)
    }
}

impl<'de> Deserialize<'de> for Hashes {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if !s.is_ascii() {
            return Err(serde::de::Error::custom(
                "a hash list holds non-hex characters",
            ));
        }
        if !s.len().is_multiple_of(64) {
            return Err(serde::de::Error::custom(format!(
                "a hash list of {} hex digits, not a multiple of 64",
                s.len()
            )));
        }
        (0..s.len() / 64)
            .map(|i| parse_hex(&s[i * 64..(i + 1) * 64]).map_err(serde::de::Error::custom))
            .collect::<Result<Vec<_>, _>>()
            .map(Hashes)
    }
}

pub fn hex(h: &Hash) -> String {
    let mut s = String::with_capacity(64);
    for b in h {
        let _ = write!(s, "{b:02x}");
    }
    s
}

pub fn parse_hex(s: &str) -> Result<Hash, String> {
    if s.len() != 64 || !s.is_ascii() {
        return Err(format!(
            "a hash of {} characters, not 64 hex digits",
            s.len()
        ));
    }
    let mut h = [0u8; 32];
    for (i, b) in h.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16)
            .map_err(|_| format!("{s:?} is not a hex hash"))?;
    }
    Ok(h)
}

/// One file of the model.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PartManifest {
    /// The file's name (no directory), as gguf-split names the parts.
    pub name: String,
    pub len: u64,
    /// Where it starts in the model's byte space (parts laid end to end).
    pub base: u64,
    /// Its header's length: every shard needs these bytes.
    pub header_len: u64,
    /// BLAKE3 of each `chunk_size` bytes (the last one shorter).
    pub chunks: Hashes,
}

impl PartManifest {
    /// Part `p` of a model with these chunk hashes.
    pub fn new(p: &weft_gguf::PartLayout, chunks: Vec<Hash>) -> Self {
        PartManifest {
            name: p
                .path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            len: p.len,
            base: p.base,
            header_len: p.header_len,
            chunks: Hashes(chunks),
        }
    }
}

/// One matrix's column strips: strip (slab, block) is block `block` of every row of slab
/// `slab` (a 3-D tensor's slab is one expert's matrix), rows in order.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct StripSet {
    pub tensor: String,
    /// The tensor's first byte in the model's byte space.
    pub start: u64,
    pub row_bytes: u64,
    pub block_bytes: u64,
    pub rows_per_slab: u64,
    pub slabs: u64,
    /// Index slab × blocks per row + block.
    pub hashes: Hashes,
}

impl StripSet {
    pub fn blocks_per_row(&self) -> u64 {
        self.row_bytes / self.block_bytes
    }

    /// Bytes of one strip.
    pub fn strip_bytes(&self) -> u64 {
        self.rows_per_slab * self.block_bytes
    }

    /// Where row `row` (within the tensor) block `block` lies in the model's byte space.
    pub fn at(&self, row: u64, block: u64) -> u64 {
        self.start + row * self.row_bytes + block * self.block_bytes
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    /// BLAKE3 over everything below (`Manifest::compute_root`), in hex.
    pub root: String,
    pub chunk_size: u64,
    pub parts: Vec<PartManifest>,
    pub strips: Vec<StripSet>,
}

/// The chunk size for a model of `total` bytes.
pub fn chunk_size_for(total: u64) -> u64 {
    let mut c = MIN_CHUNK;
    while total.div_ceil(c) > MAX_CHUNKS {
        c *= 2;
    }
    c
}

impl Manifest {
    /// Hashes every chunk and strip of an open model (reads all of it once, and every
    /// matrix once more strip by strip).
    pub fn build(file: &GgufFile) -> Manifest {
        let layout = file.part_layout();
        let total: u64 = layout.iter().map(|p| p.len).sum();
        let chunk_size = chunk_size_for(total);
        let parts = layout
            .iter()
            .map(|p| {
                let bytes = file.slice(p.base as usize..(p.base + p.len) as usize);
                PartManifest::new(
                    p,
                    bytes
                        .chunks(chunk_size as usize)
                        .map(|c| *blake3::hash(c).as_bytes())
                        .collect(),
                )
            })
            .collect();
        let strips = strip_sets(file)
            .into_iter()
            .map(|mut set| {
                let start = set.start as usize;
                let len = (set.slabs * set.rows_per_slab * set.row_bytes) as usize;
                hash_strips(&mut set, file.slice(start..start + len));
                set
            })
            .collect();
        Self::assemble(chunk_size, parts, strips)
    }

    /// A manifest from its parts and strips, its root computed.
    pub fn assemble(chunk_size: u64, parts: Vec<PartManifest>, strips: Vec<StripSet>) -> Manifest {
        let mut m = Manifest {
            root: String::new(),
            chunk_size,
            parts,
            strips,
        };
        m.root = hex(&m.compute_root());
        m
    }

    /// BLAKE3 over a fixed encoding of every field but the root.
    pub fn compute_root(&self) -> Hash {
        let mut h = blake3::Hasher::new();
        h.update(b"weft-manifest-1");
        h.update(&self.chunk_size.to_le_bytes());
        for p in &self.parts {
            h.update(&(p.name.len() as u64).to_le_bytes());
            h.update(p.name.as_bytes());
            for v in [p.len, p.base, p.header_len, p.chunks.0.len() as u64] {
                h.update(&v.to_le_bytes());
            }
            for c in &p.chunks.0 {
                h.update(c);
            }
        }
        for s in &self.strips {
            h.update(&(s.tensor.len() as u64).to_le_bytes());
            h.update(s.tensor.as_bytes());
            for v in [
                s.start,
                s.row_bytes,
                s.block_bytes,
                s.rows_per_slab,
                s.slabs,
                s.hashes.0.len() as u64,
            ] {
                h.update(&v.to_le_bytes());
            }
            for c in &s.hashes.0 {
                h.update(c);
            }
        }
        *h.finalize().as_bytes()
    }

    /// Parses a manifest received from a peer and checks it against the root the plan
    /// named and against itself (lengths, counts, names), naming what is wrong.
    pub fn parse_checked(bytes: &[u8], root: &str) -> Result<Manifest, String> {
        Self::parse_checked_as(bytes, Some(root))
    }

    /// As `parse_checked`, for a manifest whose root is not known beforehand (asked of
    /// the coordinator itself over the authenticated channel): it must still hash to the
    /// root it states.
    pub fn parse_self_checked(bytes: &[u8]) -> Result<Manifest, String> {
        Self::parse_checked_as(bytes, None)
    }

    fn parse_checked_as(bytes: &[u8], root: Option<&str>) -> Result<Manifest, String> {
        let m: Manifest =
            serde_json::from_slice(bytes).map_err(|e| format!("malformed manifest: {e}"))?;
        let root = root.unwrap_or(&m.root);
        let computed = hex(&m.compute_root());
        if computed != m.root || computed != root {
            return Err(format!(
                "the manifest hashes to {computed}, not the model's root {root}"
            ));
        }
        if m.chunk_size < 4096 || m.chunk_size > 1 << 30 || !m.chunk_size.is_power_of_two() {
            return Err(format!("manifest chunk size {} is invalid", m.chunk_size));
        }
        const RESERVED: [&str; 7] = [
            "lock",
            "manifest.json",
            "manifest.json.tmp",
            "strips.bin",
            "pieces.log",
            "pieces.log.tmp",
            "used",
        ];
        let mut base = 0u64;
        let mut names = std::collections::HashSet::new();
        for p in &m.parts {
            let name_ok = !p.name.is_empty()
                && p.name != "."
                && p.name != ".."
                && !p.name.contains(['/', '\\', '\0'])
                && !RESERVED.contains(&p.name.as_str())
                && names.insert(p.name.as_str());
            if !name_ok {
                return Err(format!(
                    "manifest part name {:?} is not a file name of its own",
                    p.name
                ));
            }
            if p.base != base
                || p.header_len > p.len
                || p.chunks.0.len() as u64 != p.len.div_ceil(m.chunk_size)
            {
                return Err(format!("manifest part {} has inconsistent lengths", p.name));
            }
            base = base
                .checked_add(p.len)
                .ok_or_else(|| format!("manifest part {} overflows the model's length", p.name))?;
        }
        for s in &m.strips {
            let bad = || format!("manifest strips of {} are inconsistent", s.tensor);
            if s.block_bytes == 0
                || s.rows_per_slab == 0
                || !s.row_bytes.is_multiple_of(s.block_bytes)
                || s.blocks_per_row() < 2
            {
                return Err(bad());
            }
            let len = s
                .slabs
                .checked_mul(s.rows_per_slab)
                .and_then(|r| r.checked_mul(s.row_bytes))
                .ok_or_else(bad)?;
            let count = s.slabs.checked_mul(s.blocks_per_row()).ok_or_else(bad)?;
            let end = s.start.checked_add(len).ok_or_else(bad)?;
            let part = m.part_of(s.start).ok_or_else(bad)?;
            let p = &m.parts[part];
            if s.hashes.0.len() as u64 != count || end > p.base + p.len {
                return Err(bad());
            }
        }
        Ok(m)
    }

    /// A manifest saved as JSON at `path`, checked against the root it names itself.
    pub fn read_file(path: &std::path::Path) -> Result<Manifest, String> {
        let bytes = std::fs::read(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
        let root = serde_json::from_slice::<serde_json::Value>(&bytes)
            .ok()
            .and_then(|v| v.get("root").and_then(|r| r.as_str()).map(String::from))
            .ok_or_else(|| format!("{} names no root", path.display()))?;
        Self::parse_checked(&bytes, &root).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Saves this manifest at `path` (written whole, then renamed into place).
    pub fn write_file(&self, path: &std::path::Path) -> Result<(), String> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        }
        let body = serde_json::to_vec(self).map_err(|e| e.to_string())?;
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, body).map_err(|e| format!("writing {}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, path).map_err(|e| format!("writing {}: {e}", path.display()))
    }

    pub fn total_len(&self) -> u64 {
        self.parts.iter().map(|p| p.len).sum()
    }

    /// The part holding model byte `at`.
    pub fn part_of(&self, at: u64) -> Option<usize> {
        self.parts
            .iter()
            .position(|p| at >= p.base && at < p.base + p.len)
    }

    /// Model byte range of chunk `index` of part `part`.
    pub fn chunk_range(&self, part: usize, index: u64) -> Option<std::ops::Range<u64>> {
        let p = self.parts.get(part)?;
        let start = index.checked_mul(self.chunk_size)?;
        (start < p.len).then(|| p.base + start..p.base + (start + self.chunk_size).min(p.len))
    }
}

/// The strip sets (hashes not yet filled) of every matrix of `file` with more than one
/// block a row, in tensor order.
pub fn strip_sets(file: &GgufFile) -> Vec<StripSet> {
    file.tensors()
        .iter()
        .filter(|t| t.dims.len() >= 2 && t.row_len() / t.ty.block_size() > 1)
        .map(|t| {
            let rows_per_slab = t.dims[1];
            StripSet {
                tensor: t.name.clone(),
                start: file.tensor_range(t).start as u64,
                row_bytes: t.row_bytes() as u64,
                block_bytes: t.ty.type_size() as u64,
                rows_per_slab,
                slabs: t.n_rows() as u64 / rows_per_slab.max(1),
                hashes: Hashes::default(),
            }
        })
        .collect()
}

/// Fills `set`'s hashes from its tensor's bytes.
pub fn hash_strips(set: &mut StripSet, bytes: &[u8]) {
    let mut buf = Vec::with_capacity(set.strip_bytes() as usize);
    set.hashes.0.clear();
    for slab in 0..set.slabs {
        for block in 0..set.blocks_per_row() {
            gather_strip(set, slab, block, |r| &bytes[r], &mut buf);
            set.hashes.0.push(*blake3::hash(&buf).as_bytes());
        }
    }
}

/// Gathers strip (slab, block) of `set` into `out`, reading rows through `read` (model
/// byte ranges relative to the tensor's start).
pub fn gather_strip<'a>(
    set: &StripSet,
    slab: u64,
    block: u64,
    read: impl Fn(std::ops::Range<usize>) -> &'a [u8],
    out: &mut Vec<u8>,
) {
    out.clear();
    for row in slab * set.rows_per_slab..(slab + 1) * set.rows_per_slab {
        let at = (row * set.row_bytes + block * set.block_bytes) as usize;
        out.extend_from_slice(read(at..at + set.block_bytes as usize));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_size_keeps_the_count_bounded() {
        assert_eq!(chunk_size_for(1), MIN_CHUNK);
        assert_eq!(chunk_size_for(MIN_CHUNK * MAX_CHUNKS), MIN_CHUNK);
        assert_eq!(chunk_size_for(MIN_CHUNK * MAX_CHUNKS + 1), 2 * MIN_CHUNK);
        let tb = 1u64 << 40;
        assert!(tb.div_ceil(chunk_size_for(tb)) <= MAX_CHUNKS);
    }

    #[test]
    fn hashes_round_trip_as_hex() {
        let h = Hashes(vec![[7u8; 32], *blake3::hash(b"x").as_bytes()]);
        let s = serde_json::to_string(&h).unwrap();
        assert_eq!(serde_json::from_str::<Hashes>(&s).unwrap(), h);
        assert!(serde_json::from_str::<Hashes>("\"abc\"").is_err());
        assert!(parse_hex(&"zz".repeat(32)).is_err());
    }
}
