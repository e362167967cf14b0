//! Pieces (a chunk of a part, or a column strip) and which of them a shard needs: a dry
//! run of the model's loader over the file's header records every range it borrows and
//! every column block it copies (`Recorder`), and `Manifest::pieces_for` turns those into
//! the pieces that cover them.

use std::collections::BTreeSet;
use std::ops::Range;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use weft_gguf::{PartialData, TensorInfo};

use crate::manifest::Manifest;

/// One verifiable unit of a model's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Piece {
    /// Chunk `index` of part `part`.
    Chunk { part: u32, index: u32 },
    /// Strip `index` (slab × blocks per row + block) of strip set `set`.
    Strip { set: u32, index: u32 },
}

/// What a shard's loader read: ranges of the model's byte space it borrows, and column
/// blocks of matrices it copies.
#[derive(Clone, Debug, Default)]
pub struct Needs {
    pub ranges: Vec<Range<usize>>,
    /// Tensor name, rows, columns (elements, block-aligned), block size in elements.
    pub columns: Vec<(String, Range<usize>, Range<usize>, usize)>,
}

impl Needs {
    /// Bytes the shard reads: the union of its ranges and its column blocks (each block
    /// `type_size` bytes: given per tensor as (elements per block, bytes per block)).
    pub fn bytes(&self, block_bytes: impl Fn(&str) -> usize) -> u64 {
        let mut r: Vec<Range<usize>> = self.ranges.clone();
        r.sort_by_key(|r| r.start);
        let (mut total, mut end) = (0usize, 0usize);
        for x in r {
            let s = x.start.max(end);
            if x.end > s {
                total += x.end - s;
            }
            end = end.max(x.end);
        }
        let cols: usize = self
            .columns
            .iter()
            .map(|(name, rows, cols, bs)| rows.len() * (cols.len() / bs) * block_bytes(name))
            .sum();
        (total + cols) as u64
    }
}

/// A `PartialData` that holds nothing and notes every read: load a model through it over
/// a file whose data section is absent (all zeros) to learn what the shard needs.
#[derive(Default)]
pub struct Recorder {
    pub needs: Mutex<Needs>,
}

impl Recorder {
    pub fn take(&self) -> Needs {
        self.needs
            .lock()
            .map(|mut n| std::mem::take(&mut *n))
            .unwrap_or_default()
    }
}

impl PartialData for Recorder {
    fn check(&self, r: Range<usize>) -> Result<(), String> {
        if let Ok(mut n) = self.needs.lock() {
            n.ranges.push(r);
        }
        Ok(())
    }

    fn columns(
        &self,
        _index: usize,
        t: &TensorInfo,
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Result<Vec<u8>, String> {
        let bs = t.ty.block_size();
        let bytes = rows.len() * (cols.len() / bs) * t.ty.type_size();
        if let Ok(mut n) = self.needs.lock() {
            n.columns.push((t.name.clone(), rows, cols, bs));
        }
        Ok(vec![0; bytes])
    }

    fn records_only(&self) -> bool {
        true
    }
}

impl Manifest {
    /// The pieces covering `needs`, plus every part's header; an error names a tensor or
    /// range the manifest does not describe.
    pub fn pieces_for(&self, needs: &Needs) -> Result<BTreeSet<Piece>, String> {
        let mut out = BTreeSet::new();
        for p in &self.parts {
            self.add_range(p.base..p.base + p.header_len, &mut out)
                .map_err(|e| format!("header of {}: {e}", p.name))?;
        }
        for r in &needs.ranges {
            self.add_range(r.start as u64..r.end as u64, &mut out)?;
        }
        for (name, rows, cols, bs) in &needs.columns {
            let (si, set) = self
                .strips
                .iter()
                .enumerate()
                .find(|(_, s)| &s.tensor == name)
                .ok_or_else(|| format!("the manifest has no column strips for {name}"))?;
            let rps = set.rows_per_slab as usize;
            let bpr = set.blocks_per_row() as usize;
            let (s0, s1) = (rows.start / rps, rows.end.div_ceil(rps));
            let (b0, b1) = (cols.start / bs, cols.end.div_ceil(*bs));
            if s1 as u64 > set.slabs || b1 > bpr {
                return Err(format!(
                    "{name}: rows {rows:?} columns {cols:?} lie outside its strips"
                ));
            }
            for slab in s0..s1 {
                for block in b0..b1 {
                    out.insert(Piece::Strip {
                        set: si as u32,
                        index: (slab * bpr + block) as u32,
                    });
                }
            }
        }
        Ok(out)
    }

    fn add_range(&self, r: Range<u64>, out: &mut BTreeSet<Piece>) -> Result<(), String> {
        if r.is_empty() {
            return Ok(());
        }
        let part = self
            .part_of(r.start)
            .ok_or_else(|| format!("bytes {r:?} lie outside the model"))?;
        let p = &self.parts[part];
        if r.end > p.base + p.len {
            return Err(format!("bytes {r:?} cross the end of part {}", p.name));
        }
        let (c0, c1) = (
            (r.start - p.base) / self.chunk_size,
            (r.end - p.base).div_ceil(self.chunk_size),
        );
        for index in c0..c1 {
            out.insert(Piece::Chunk {
                part: part as u32,
                index: index as u32,
            });
        }
        Ok(())
    }

    /// Bytes of a piece, and its expected hash; None when the manifest has no such piece.
    pub fn piece_info(&self, p: Piece) -> Option<(u64, crate::manifest::Hash)> {
        match p {
            Piece::Chunk { part, index } => {
                let r = self.chunk_range(part as usize, index as u64)?;
                let h = *self.parts[part as usize].chunks.0.get(index as usize)?;
                Some((r.end - r.start, h))
            }
            Piece::Strip { set, index } => {
                let s = self.strips.get(set as usize)?;
                let h = *s.hashes.0.get(index as usize)?;
                Some((s.strip_bytes(), h))
            }
        }
    }

    /// Whether `bytes` are piece `p`'s.
    pub fn verify(&self, p: Piece, bytes: &[u8]) -> Result<(), String> {
        let (len, want) = self
            .piece_info(p)
            .ok_or_else(|| format!("{p:?} is not in the manifest"))?;
        if bytes.len() as u64 != len {
            return Err(format!("{p:?}: {} bytes, expected {len}", bytes.len()));
        }
        if *blake3::hash(bytes).as_bytes() != want {
            return Err(format!(
                "{p:?}: its BLAKE3 hash does not match the manifest"
            ));
        }
        Ok(())
    }
}
