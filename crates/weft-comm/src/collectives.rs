//! Collectives over a group: all-reduce (one all-to-all round for latency-bound sizes,
//! ring reduce-scatter + all-gather for large ones), all-gather, broadcast, point-to-point,
//! barrier and a top-k merge. Every rank gets bit-identical results, and steady-state
//! calls reuse the group's buffers instead of allocating.

use half::{bf16, f16};

use crate::error::CommError;
use crate::group::Group;

/// Frames are cut into segments of this size so that two ranks sending to each other at
/// once never both block on a full socket buffer.
pub const SEGMENT: usize = 64 << 10;
/// Up to this many bytes per rank an all-reduce is one all-to-all round (latency-bound);
/// above it the ring moves 2(n-1)/n of the data instead of n-1 copies.
pub const RING_FROM: usize = 256 << 10;

/// Number format of all-reduce payloads on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wire {
    F32,
    F16,
    Bf16,
}

impl std::str::FromStr for Wire {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(Wire::F32),
            "f16" => Ok(Wire::F16),
            "bf16" => Ok(Wire::Bf16),
            _ => Err(format!("unknown wire format {s:?} (f32, f16 or bf16)")),
        }
    }
}

pub(crate) fn as_bytes(x: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding or invalid bit patterns; u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u8, std::mem::size_of_val(x)) }
}

pub(crate) fn as_bytes_mut(x: &mut [f32]) -> &mut [u8] {
    // SAFETY: as above, and every byte pattern is a valid f32.
    unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr() as *mut u8, std::mem::size_of_val(x)) }
}

fn segments(len: usize) -> usize {
    len.div_ceil(SEGMENT)
}

fn segment(buf: &[u8], i: usize) -> &[u8] {
    &buf[(i * SEGMENT).min(buf.len())..((i + 1) * SEGMENT).min(buf.len())]
}

impl Group {
    /// Element-wise sum of `buf` over all ranks, in place, f32 on the wire.
    pub fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        self.all_reduce_sum_as(buf, Wire::F32)
    }

    /// Element-wise sum with the payload sent as `wire` (f16/bf16 halve the bytes; each
    /// rank's contribution is rounded to that format before summing).
    pub fn all_reduce_sum_as(&mut self, buf: &mut [f32], wire: Wire) -> Result<(), CommError> {
        let everyone = std::mem::take(&mut self.everyone);
        let r = self.all_reduce_sum_in(&everyone, buf, wire);
        self.everyone = everyone;
        r
    }

    /// All-reduce among `members` only (ascending ranks, ours among them): the tensor-
    /// parallel group of one pipeline stage inside a larger group.
    pub fn all_reduce_sum_in(
        &mut self,
        members: &[usize],
        buf: &mut [f32],
        wire: Wire,
    ) -> Result<(), CommError> {
        self.check()?;
        let me = self.rank();
        let Some(pos) = members.iter().position(|&m| m == me) else {
            return Err(CommError::Config(format!(
                "rank {me} is not among the members {members:?}"
            )));
        };
        if members.iter().any(|&m| m >= self.size()) || members.windows(2).any(|w| w[0] >= w[1]) {
            return Err(CommError::Config(format!(
                "members {members:?} must be ascending ranks of the group"
            )));
        }
        if members.len() == 1 {
            return Ok(());
        }
        if wire == Wire::F32 && buf.len() * 4 >= RING_FROM && buf.len() >= members.len() {
            self.ring_all_reduce(members, pos, buf)
        } else {
            self.direct_all_reduce(members, buf, wire)
        }
    }

    /// Every member sends everything to every other, then each sums in rank order.
    fn direct_all_reduce(
        &mut self,
        members: &[usize],
        buf: &mut [f32],
        wire: Wire,
    ) -> Result<(), CommError> {
        let (n, me) = (buf.len(), self.rank());
        let width = if wire == Wire::F32 { 4 } else { 2 };
        let words = (n * width).div_ceil(4);
        let mut scratch = std::mem::take(&mut self.scratch);
        for &m in members {
            scratch[m].resize(words, 0.0);
        }
        encode(buf, wire, as_bytes_mut(&mut scratch[me]));
        let res = (|| {
            let nbytes = n * width;
            for i in 0..segments(nbytes) {
                for &p in members.iter().filter(|&&p| p != me) {
                    self.send_frame(p, segment(&as_bytes(&scratch[me])[..nbytes], i))?;
                }
                for &p in members.iter().filter(|&&p| p != me) {
                    let lo = i * SEGMENT;
                    let hi = ((i + 1) * SEGMENT).min(nbytes);
                    self.recv_frame(p, &mut as_bytes_mut(&mut scratch[p])[lo..hi])?;
                }
            }
            Ok(())
        })();
        if res.is_ok() {
            buf.fill(0.0);
            for &m in members {
                add_decoded(buf, wire, &as_bytes(&scratch[m])[..n * width]);
            }
        }
        self.scratch = scratch;
        res
    }

    /// Ring reduce-scatter then ring all-gather; chunk c is summed once along the ring and
    /// then copied, so every member ends with the same bits.
    fn ring_all_reduce(
        &mut self,
        members: &[usize],
        me: usize,
        buf: &mut [f32],
    ) -> Result<(), CommError> {
        let (n, size) = (buf.len(), members.len());
        let next = members[(me + 1) % size];
        let prev = members[(me + size - 1) % size];
        let chunk = |c: usize| c * n / size..(c + 1) * n / size;
        let mut tmp = std::mem::take(&mut self.ring_tmp);
        tmp.resize(n / size + 1, 0.0);
        let res = (|| {
            for s in 0..size - 1 {
                let sc = chunk((me + size - s) % size);
                let rc = chunk((me + 2 * size - s - 1) % size);
                let t = &mut tmp[..rc.len()];
                self.send_recv(next, as_bytes(&buf[sc]), prev, as_bytes_mut(t))?;
                for (b, v) in buf[rc].iter_mut().zip(t.iter()) {
                    *b += v;
                }
            }
            for s in 0..size - 1 {
                let sc = chunk((me + 1 + size - s) % size);
                let rc = chunk((me + size - s) % size);
                let (send, recv) = split_two(buf, sc, rc);
                self.send_recv(next, as_bytes(send), prev, as_bytes_mut(recv))?;
            }
            Ok(())
        })();
        self.ring_tmp = tmp;
        res
    }

    /// Sends `out` to `to` while receiving `inp` from `from`, segment by segment.
    fn send_recv(
        &mut self,
        to: usize,
        out: &[u8],
        from: usize,
        inp: &mut [u8],
    ) -> Result<(), CommError> {
        for i in 0..segments(out.len()).max(segments(inp.len())) {
            if i * SEGMENT < out.len() {
                self.send_frame(to, segment(out, i))?;
            }
            if i * SEGMENT < inp.len() {
                let hi = ((i + 1) * SEGMENT).min(inp.len());
                self.recv_frame(from, &mut inp[i * SEGMENT..hi])?;
            }
        }
        Ok(())
    }

    /// Concatenates every rank's `local` (rank order; rank r gives `counts[r]` values)
    /// into `out` on every rank.
    pub fn all_gather(
        &mut self,
        local: &[f32],
        counts: &[usize],
        out: &mut [f32],
    ) -> Result<(), CommError> {
        if counts.get(self.rank()) != Some(&local.len()) {
            return Err(CommError::Config(format!(
                "all_gather: rank {} gives {} values but counts say {:?}",
                self.rank(),
                local.len(),
                counts.get(self.rank())
            )));
        }
        let mut bytes = std::mem::take(&mut self.counts);
        bytes.clear();
        bytes.extend(counts.iter().map(|c| c * 4));
        let r = self.all_gather_bytes(as_bytes(local), &bytes, as_bytes_mut(out));
        self.counts = bytes;
        r
    }

    /// all_gather over raw bytes.
    pub fn all_gather_bytes(
        &mut self,
        local: &[u8],
        counts: &[usize],
        out: &mut [u8],
    ) -> Result<(), CommError> {
        self.check()?;
        let (me, size) = (self.rank(), self.size());
        let total: usize = counts.iter().sum();
        if counts.len() != size || out.len() < total || counts[me] != local.len() {
            return Err(CommError::Config(format!(
                "all_gather: {} counts for {size} ranks, output {} for {total}, local {} for {}",
                counts.len(),
                out.len(),
                local.len(),
                counts.get(me).copied().unwrap_or(0)
            )));
        }
        let offset = |r: usize| counts[..r].iter().sum::<usize>();
        out[offset(me)..offset(me) + local.len()].copy_from_slice(local);
        let most = counts.iter().copied().max().unwrap_or(0);
        for i in 0..segments(most) {
            if i * SEGMENT < local.len() {
                for p in (0..size).filter(|&p| p != me) {
                    self.send_frame(p, segment(local, i))?;
                }
            }
            for p in (0..size).filter(|&p| p != me) {
                if i * SEGMENT < counts[p] {
                    let lo = offset(p) + i * SEGMENT;
                    let hi = offset(p) + ((i + 1) * SEGMENT).min(counts[p]);
                    self.recv_frame(p, &mut out[lo..hi])?;
                }
            }
        }
        Ok(())
    }

    /// Copies `root`'s `buf` into every rank's `buf`.
    pub fn broadcast(&mut self, root: usize, buf: &mut [u8]) -> Result<(), CommError> {
        self.check()?;
        let (me, size) = (self.rank(), self.size());
        if root >= self.size() {
            return Err(CommError::Config(format!(
                "broadcast root {root} is not a rank"
            )));
        }
        for i in 0..segments(buf.len()) {
            if me == root {
                for p in (0..size).filter(|&p| p != me) {
                    self.send_frame(p, segment(buf, i))?;
                }
            } else {
                let hi = ((i + 1) * SEGMENT).min(buf.len());
                self.recv_frame(root, &mut buf[i * SEGMENT..hi])?;
            }
        }
        Ok(())
    }

    /// Point-to-point: sends `buf` to `to` (pipeline stages).
    pub fn send(&mut self, to: usize, buf: &[u8]) -> Result<(), CommError> {
        self.check()?;
        for i in 0..segments(buf.len()).max(1) {
            self.send_frame(to, segment(buf, i))?;
        }
        Ok(())
    }

    /// Point-to-point: receives exactly `buf.len()` bytes sent by `from` with `send`.
    pub fn recv(&mut self, from: usize, buf: &mut [u8]) -> Result<(), CommError> {
        self.check()?;
        for i in 0..segments(buf.len()).max(1) {
            let hi = ((i + 1) * SEGMENT).min(buf.len());
            let lo = (i * SEGMENT).min(hi);
            self.recv_frame(from, &mut buf[lo..hi])?;
        }
        Ok(())
    }

    /// Receives one small message (at most one segment) from `from`, waiting as long as it
    /// takes: for a worker idle between requests. A peer that dies still ends the wait at
    /// once (its connection closes); only a silent, live peer is waited for.
    pub fn recv_idle(&mut self, from: usize, buf: &mut [u8]) -> Result<(), CommError> {
        self.check()?;
        if buf.len() > SEGMENT {
            return Err(CommError::Config(format!(
                "recv_idle takes at most {SEGMENT} bytes, not {}",
                buf.len()
            )));
        }
        self.recv_frame_within(from, buf, std::time::Duration::from_secs(365 * 24 * 3600))
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&mut self) -> Result<(), CommError> {
        self.check()?;
        let (me, size) = (self.rank(), self.size());
        for p in (0..size).filter(|&p| p != me) {
            self.send_frame(p, &[])?;
        }
        for p in (0..size).filter(|&p| p != me) {
            self.recv_frame(p, &mut [])?;
        }
        Ok(())
    }

    /// Merges per-rank top-k lists of (token id, score): every rank gives exactly `k`
    /// entries and gets the group's best `k`, best first (ties: lower id first).
    pub fn merge_top_k(
        &mut self,
        local: &[(u32, f32)],
        k: usize,
        out: &mut Vec<(u32, f32)>,
    ) -> Result<(), CommError> {
        if local.len() != k {
            return Err(CommError::Config(format!(
                "merge_top_k: rank {} gives {} entries, every rank must give k = {k}",
                self.rank(),
                local.len()
            )));
        }
        let size = self.size();
        let mut send = std::mem::take(&mut self.topk_send);
        send.clear();
        for &(id, v) in local {
            send.extend_from_slice(&id.to_le_bytes());
            send.extend_from_slice(&v.to_le_bytes());
        }
        let mut all = std::mem::take(&mut self.topk_recv);
        all.resize(size * k * 8, 0);
        let mut counts = std::mem::take(&mut self.counts);
        counts.clear();
        counts.resize(size, k * 8);
        let res = self.all_gather_bytes(&send, &counts, &mut all);
        self.counts = counts;
        if res.is_ok() {
            out.clear();
            for e in all.chunks_exact(8) {
                let id = u32::from_le_bytes([e[0], e[1], e[2], e[3]]);
                let v = f32::from_le_bytes([e[4], e[5], e[6], e[7]]);
                out.push((id, v));
            }
            out.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            out.truncate(k);
        }
        self.topk_send = send;
        self.topk_recv = all;
        res
    }
}

/// Disjoint `a` (read) and `b` (written) chunks of one buffer.
fn split_two(
    buf: &mut [f32],
    a: std::ops::Range<usize>,
    b: std::ops::Range<usize>,
) -> (&[f32], &mut [f32]) {
    if a.start < b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.len()])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.len()], &mut lo[b])
    }
}

fn encode(x: &[f32], wire: Wire, out: &mut [u8]) {
    match wire {
        Wire::F32 => out[..x.len() * 4].copy_from_slice(as_bytes(x)),
        Wire::F16 => {
            for (v, o) in x.iter().zip(out.chunks_exact_mut(2)) {
                o.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
            }
        }
        Wire::Bf16 => {
            for (v, o) in x.iter().zip(out.chunks_exact_mut(2)) {
                o.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
            }
        }
    }
}

fn add_decoded(acc: &mut [f32], wire: Wire, bytes: &[u8]) {
    match wire {
        Wire::F32 => {
            for (a, b) in acc.iter_mut().zip(bytes.chunks_exact(4)) {
                *a += f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        Wire::F16 => {
            for (a, b) in acc.iter_mut().zip(bytes.chunks_exact(2)) {
                *a += f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        Wire::Bf16 => {
            for (a, b) in acc.iter_mut().zip(bytes.chunks_exact(2)) {
                *a += bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::GroupOptions;

    /// In-process ranks as threads: every size crosses the direct/ring threshold and the
    /// results are exact and identical on every rank.
    #[test]
    fn in_process_all_reduce_is_exact_on_every_rank() {
        for n in [2usize, 3, 4] {
            let groups = Group::in_process(n, GroupOptions::default()).unwrap();
            let handles: Vec<_> = groups
                .into_iter()
                .map(|mut g| {
                    std::thread::spawn(move || {
                        let mut outs = Vec::new();
                        for len in [1usize, 640, 100_000] {
                            let r = g.rank();
                            let mut v: Vec<f32> =
                                (0..len).map(|i| ((r * 13 + i) % 50) as f32 * 0.5).collect();
                            g.all_reduce_sum(&mut v).unwrap();
                            outs.push(v);
                        }
                        outs
                    })
                })
                .collect();
            let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            for (k, len) in [1usize, 640, 100_000].into_iter().enumerate() {
                let want: Vec<f32> = (0..len)
                    .map(|i| (0..n).map(|r| ((r * 13 + i) % 50) as f32 * 0.5).sum())
                    .collect();
                for r in &results {
                    assert!(r[k] == want, "{n} ranks, len {len}");
                }
            }
        }
    }
}
