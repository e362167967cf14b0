//! Building a manifest from a stream (a hub's file read once over HTTP), so that no
//! machine need hold the whole model: the parts' headers give the tensor table (a
//! `GgufFile` over sparse files holding only the headers), then each part's bytes pass
//! once through the chunk hasher and, tensor by tensor, the strip hasher.

use weft_gguf::GgufFile;

use crate::manifest::{chunk_size_for, hash_strips, strip_sets, Manifest, PartManifest};

/// Hashes what `read(part, sink)` streams of every part of `headers`' model. `headers`
/// knows the tensors (its data may be absent); `read` calls `sink` with the part's bytes
/// in order, from its first byte to its last.
pub fn build_streaming(
    headers: &GgufFile,
    mut read: impl FnMut(usize, &mut dyn FnMut(&[u8])) -> Result<(), String>,
) -> Result<Manifest, String> {
    let layout = headers.part_layout();
    let total: u64 = layout.iter().map(|p| p.len).sum();
    let chunk_size = chunk_size_for(total);
    let mut sets = strip_sets(headers);
    // Streamed tensors are taken one after another: two that overlap cannot be.
    let mut by_start: Vec<&crate::manifest::StripSet> = sets.iter().collect();
    by_start.sort_by_key(|s| s.start);
    for w in by_start.windows(2) {
        if w[0].start + w[0].slabs * w[0].rows_per_slab * w[0].row_bytes > w[1].start {
            return Err(format!(
                "tensors {} and {} overlap",
                w[0].tensor, w[1].tensor
            ));
        }
    }
    let mut parts = Vec::new();
    for (i, p) in layout.iter().enumerate() {
        let mut chunks = Vec::new();
        let mut chunk = Vec::with_capacity(chunk_size as usize);
        // The strip sets whose tensors lie in this part, by start.
        let mut here: Vec<usize> = (0..sets.len())
            .filter(|&k| sets[k].start >= p.base && sets[k].start < p.base + p.len)
            .collect();
        here.sort_by_key(|&k| sets[k].start);
        let mut next = 0usize;
        let mut tensor: Vec<u8> = Vec::new();
        let mut pos = p.base;
        read(i, &mut |mut bytes: &[u8]| {
            let at = pos;
            pos += bytes.len() as u64;
            // Tensor bytes, for their strips.
            let mut off = at;
            let mut rest = bytes;
            while next < here.len() && !rest.is_empty() {
                let s = &sets[here[next]];
                let len = s.slabs * s.rows_per_slab * s.row_bytes;
                let (start, end) = (s.start, s.start + len);
                if off + rest.len() as u64 <= start {
                    break;
                }
                let skip = start.saturating_sub(off);
                let from = (off + skip) as usize - off as usize;
                let take = ((end - (off + skip)) as usize).min(rest.len() - from);
                tensor.extend_from_slice(&rest[from..from + take]);
                off += (from + take) as u64;
                rest = &rest[from + take..];
                if tensor.len() as u64 == len {
                    hash_strips(&mut sets[here[next]], &tensor);
                    tensor.clear();
                    next += 1;
                }
            }
            // Chunks.
            while !bytes.is_empty() {
                let take = (chunk_size as usize - chunk.len()).min(bytes.len());
                chunk.extend_from_slice(&bytes[..take]);
                bytes = &bytes[take..];
                if chunk.len() == chunk_size as usize {
                    chunks.push(*blake3::hash(&chunk).as_bytes());
                    chunk.clear();
                }
            }
        })?;
        if !chunk.is_empty() {
            chunks.push(*blake3::hash(&chunk).as_bytes());
        }
        if pos != p.base + p.len || next != here.len() {
            return Err(format!(
                "part {} streamed {} of its {} bytes",
                p.path.display(),
                pos - p.base,
                p.len
            ));
        }
        parts.push(PartManifest::new(p, chunks));
    }
    Ok(Manifest::assemble(chunk_size, parts, sets))
}
