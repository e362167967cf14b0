//! A hub's files as a holder of every piece (weft-share's `Source`): a run of consecutive
//! chunks is one HTTP Range request; a column strip is the rows of its slab in one request, gathered (a hub
//! cannot send scattered bytes, so a strip costs its slab's bytes on the wire, and the
//! slab is kept for the next strips of the same slab).

use std::sync::Arc;

use weft_share::manifest::gather_strip;
use weft_share::{Holding, Manifest, Piece, Source};

use crate::client::HubClient;

/// Tries of one Range request.
const ATTEMPTS: u32 = 4;
/// Bytes of consecutive chunks asked in one Range request.
const MAX_RUN: u64 = 8 << 20;

pub struct HubSource {
    client: HubClient,
    /// Each part's resolve URL, in part order.
    urls: Vec<String>,
    manifest: Arc<Manifest>,
    /// The last slab read: (strip set, slab, its bytes).
    slab: Option<(u32, u64, Vec<u8>)>,
}

impl HubSource {
    pub fn new(client: HubClient, urls: Vec<String>, manifest: Arc<Manifest>) -> Self {
        HubSource {
            client,
            urls,
            manifest,
            slab: None,
        }
    }

    /// Bytes `r` of the model's byte space (within one part).
    fn read(&self, r: std::ops::Range<u64>) -> Result<Vec<u8>, String> {
        let part = self
            .manifest
            .part_of(r.start)
            .ok_or_else(|| format!("bytes {r:?} lie outside the model"))?;
        let p = &self.manifest.parts[part];
        let url = self
            .urls
            .get(part)
            .ok_or_else(|| format!("no URL for part {}", p.name))?;
        // A hub may refuse or drop one request (429, 5xx, a reset): tried again with
        // backoff before this holder is given up.
        let mut last = String::new();
        for attempt in 0..ATTEMPTS {
            if attempt > 0 {
                std::thread::sleep(std::time::Duration::from_millis(250 << attempt));
            }
            match self.client.get_range(url, r.start - p.base..r.end - p.base) {
                Ok(b) => return Ok(b),
                Err(e) => last = e.to_string(),
            }
        }
        Err(format!("{last} (after {ATTEMPTS} tries)"))
    }

    /// Strip `index` of strip set `set`, gathered from its slab.
    fn strip(&mut self, set: u32, index: u32) -> Result<Vec<u8>, String> {
        let st = self
            .manifest
            .strips
            .get(set as usize)
            .ok_or_else(|| format!("strip set {set} is not in the manifest"))?
            .clone();
        let bpr = st.blocks_per_row();
        let (slab, block) = (index as u64 / bpr, index as u64 % bpr);
        let fresh = !matches!(&self.slab, Some((s, b, _)) if *s == set && *b == slab);
        if fresh {
            let len = st.rows_per_slab * st.row_bytes;
            let start = st.start + slab * len;
            self.slab = Some((set, slab, self.read(start..start + len)?));
        }
        let bytes = &self.slab.as_ref().ok_or("no slab")?.2;
        let mut out = Vec::new();
        // The slab's rows, as if it were the tensor's first slab.
        let one = weft_share::manifest::StripSet { slabs: 1, ..st };
        gather_strip(&one, 0, block, |r| &bytes[r], &mut out);
        Ok(out)
    }
}

impl Source for HubSource {
    fn name(&self) -> String {
        self.urls.first().cloned().unwrap_or_else(|| "hub".into())
    }

    fn manifest(&mut self, _root: &str) -> Result<Vec<u8>, String> {
        Err("a hub serves files, not manifests".into())
    }

    fn holding(&mut self) -> Result<Holding, String> {
        Ok(Holding::All)
    }

    fn fetch(
        &mut self,
        pieces: &[Piece],
        got: &(dyn Fn(Piece, &[u8]) -> bool + Sync),
    ) -> Result<(), String> {
        let mut rest = pieces;
        while let Some(&first) = rest.first() {
            let (part, index) = match first {
                Piece::Chunk { part, index } => (part, index),
                Piece::Strip { set, index } => {
                    let bytes = self.strip(set, index)?;
                    if !got(first, &bytes) {
                        return Ok(());
                    }
                    rest = &rest[1..];
                    continue;
                }
            };
            // A run of consecutive chunks of one part is one Range request: a round
            // trip to a hub costs far more than the 64 KiB of one chunk.
            let chunk = self.manifest.chunk_size;
            let run = rest
                .iter()
                .enumerate()
                .take_while(|&(k, p)| {
                    let next = index.checked_add(k as u32);
                    next.is_some_and(|index| *p == Piece::Chunk { part, index })
                        && (k as u64 + 1) * chunk <= MAX_RUN
                })
                .count()
                .max(1);
            let start = self
                .manifest
                .chunk_range(part as usize, index as u64)
                .ok_or_else(|| format!("{first:?} is not in the manifest"))?
                .start;
            let end = self
                .manifest
                .chunk_range(part as usize, index as u64 + run as u64 - 1)
                .ok_or_else(|| format!("{:?} is not in the manifest", rest[run - 1]))?
                .end;
            let bytes = self.read(start..end)?;
            for (k, p) in rest[..run].iter().enumerate() {
                let from = k * chunk as usize;
                let to = (from + chunk as usize).min(bytes.len());
                let one = bytes
                    .get(from..to)
                    .ok_or_else(|| format!("{p:?} lies past the {} bytes received", bytes.len()))?;
                if !got(*p, one) {
                    return Ok(());
                }
            }
            rest = &rest[run..];
        }
        Ok(())
    }
}
