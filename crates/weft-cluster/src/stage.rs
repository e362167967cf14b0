//! The tensor-parallel collective of one pipeline stage: weft-model's `Collective` over
//! the stage's members inside the cluster's data-plane group, timing every wait.

use std::time::{Duration, Instant};

use weft_comm::{Group, Wire};
use weft_model::Collective;

pub struct StageCollective<'a> {
    pub group: &'a mut Group,
    /// The stage's ranks in the group, ascending.
    pub members: &'a [usize],
    /// This rank's position among `members`.
    pub position: usize,
    /// Seconds spent inside collectives (network and waiting for slower ranks).
    pub comm_secs: f64,
    pub syncs: u64,
    /// `weft node --slowdown F`: every stretch of compute is made F times as long.
    pub slowdown: f64,
    /// When the current stretch of compute began.
    pub since: Instant,
}

impl StageCollective<'_> {
    /// Ends a stretch of compute: under a slowdown, spins (F - 1) times its length, as a
    /// slower core would have taken, then starts the next stretch.
    pub fn stretch(&mut self) {
        stretch_by(self.slowdown, self.since.elapsed());
        self.since = Instant::now();
    }
}

/// Spins (F - 1) times `took`: the node's slowdown applied to work outside a collective.
/// A factor of 1 or less, or one whose stretch no `Duration` or `Instant` holds (not
/// finite, or past the clock's range), spins not at all.
pub fn stretch_by(slowdown: f64, took: Duration) {
    if slowdown <= 1.0 {
        return;
    }
    let until = Duration::try_from_secs_f64(took.as_secs_f64() * (slowdown - 1.0))
        .ok()
        .and_then(|extra| Instant::now().checked_add(extra));
    if let Some(until) = until {
        while Instant::now() < until {
            std::hint::spin_loop();
        }
    }
}

impl Collective for StageCollective<'_> {
    fn rank(&self) -> usize {
        self.position
    }
    fn size(&self) -> usize {
        self.members.len()
    }
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), String> {
        self.stretch();
        if self.members.len() == 1 {
            return Ok(());
        }
        let t = Instant::now();
        let r = self
            .group
            .all_reduce_sum_in(self.members, buf, Wire::F32)
            .map_err(|e| e.to_string());
        self.comm_secs += t.elapsed().as_secs_f64();
        self.syncs += 1;
        self.since = Instant::now();
        r
    }
    fn all_gather(
        &mut self,
        local: &[f32],
        _counts: &[usize],
        out: &mut [f32],
    ) -> Result<(), String> {
        if self.members.len() == 1 {
            out[..local.len()].copy_from_slice(local);
            return Ok(());
        }
        // Not used by the forward pass (the head's slices meet at the coordinator as top-k).
        Err("all_gather inside a stage is not supported; merge top-k at the coordinator".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stretch_spins_its_factor_less_one_and_odd_factors_spin_not() {
        let took = Duration::from_millis(2);
        let t = Instant::now();
        stretch_by(3.0, took);
        assert!(t.elapsed() >= Duration::from_millis(4), "{:?}", t.elapsed());
        // None of these may panic (Duration::mul_f64 did on the last two) or spin for
        // ever: 1 and below are no slowdown, the rest no clock can hold.
        for f in [1.0, 0.5, -3.0, f64::NAN, f64::INFINITY, 1e300] {
            stretch_by(f, took);
        }
    }
}
