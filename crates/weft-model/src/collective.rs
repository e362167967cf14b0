//! The collective operations a sharded forward pass needs, and the two that live here:
//! the identity (one rank) and an in-process group of threads (tests).

use std::sync::{Arc, Barrier, Mutex};

/// Collectives over a tensor-parallel group. Every rank calls the same operations in the
/// same order; implementations must give every rank bit-identical results.
pub trait Collective: Send {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Element-wise sum of `buf` across ranks, written back to every rank's `buf`.
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), String>;
    /// Concatenates each rank's `local` (rank order) into `out` on every rank.
    /// `counts[r]` is rank r's length; `out` is their sum.
    fn all_gather(
        &mut self,
        local: &[f32],
        counts: &[usize],
        out: &mut [f32],
    ) -> Result<(), String>;
}

/// The collective of a group of one.
#[derive(Default, Clone, Copy)]
pub struct Identity;

impl Collective for Identity {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&mut self, _buf: &mut [f32]) -> Result<(), String> {
        Ok(())
    }
    fn all_gather(
        &mut self,
        local: &[f32],
        _counts: &[usize],
        out: &mut [f32],
    ) -> Result<(), String> {
        out[..local.len()].copy_from_slice(local);
        Ok(())
    }
}

struct Slots {
    bufs: Vec<Vec<f32>>,
}

/// Ranks as threads of one process, meeting at a barrier. Sums run in rank order on
/// every rank, so all ranks agree exactly.
pub struct InProcess {
    rank: usize,
    size: usize,
    slots: Arc<Mutex<Slots>>,
    barrier: Arc<Barrier>,
}

impl InProcess {
    /// One handle per rank of a new group of `size`.
    pub fn group(size: usize) -> Vec<InProcess> {
        let slots = Arc::new(Mutex::new(Slots {
            bufs: vec![Vec::new(); size],
        }));
        let barrier = Arc::new(Barrier::new(size));
        (0..size)
            .map(|rank| InProcess {
                rank,
                size,
                slots: slots.clone(),
                barrier: barrier.clone(),
            })
            .collect()
    }

    fn publish(&self, data: &[f32]) -> Result<(), String> {
        let mut s = self
            .slots
            .lock()
            .map_err(|_| "in-process group poisoned".to_string())?;
        s.bufs[self.rank].clear();
        s.bufs[self.rank].extend_from_slice(data);
        Ok(())
    }
}

impl Collective for InProcess {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), String> {
        self.publish(buf)?;
        self.barrier.wait();
        {
            let s = self
                .slots
                .lock()
                .map_err(|_| "in-process group poisoned".to_string())?;
            buf.iter_mut().for_each(|v| *v = 0.0);
            for b in &s.bufs {
                if b.len() != buf.len() {
                    return Err(format!(
                        "all-reduce of {} values met one of {}",
                        buf.len(),
                        b.len()
                    ));
                }
                for (o, v) in buf.iter_mut().zip(b) {
                    *o += v;
                }
            }
        }
        self.barrier.wait();
        Ok(())
    }
    fn all_gather(
        &mut self,
        local: &[f32],
        counts: &[usize],
        out: &mut [f32],
    ) -> Result<(), String> {
        self.publish(local)?;
        self.barrier.wait();
        {
            let s = self
                .slots
                .lock()
                .map_err(|_| "in-process group poisoned".to_string())?;
            let mut at = 0;
            for (r, b) in s.bufs.iter().enumerate() {
                if b.len() != counts[r] {
                    return Err(format!(
                        "rank {r} gathered {} values, expected {}",
                        b.len(),
                        counts[r]
                    ));
                }
                out[at..at + b.len()].copy_from_slice(b);
                at += b.len();
            }
        }
        self.barrier.wait();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_process_reduce_and_gather() {
        let handles: Vec<_> = InProcess::group(3)
            .into_iter()
            .map(|mut c| {
                std::thread::spawn(move || {
                    let r = c.rank() as f32;
                    let mut buf = vec![r, 2.0 * r];
                    c.all_reduce_sum(&mut buf).unwrap();
                    let local = vec![r; c.rank() + 1];
                    let mut out = vec![0.0; 6];
                    c.all_gather(&local, &[1, 2, 3], &mut out).unwrap();
                    (buf, out)
                })
            })
            .collect();
        for h in handles {
            let (buf, out) = h.join().unwrap();
            assert_eq!(buf, vec![3.0, 6.0]);
            assert_eq!(out, vec![0.0, 1.0, 1.0, 2.0, 2.0, 2.0]);
        }
    }
}
