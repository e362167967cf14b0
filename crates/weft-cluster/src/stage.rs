//! The tensor-parallel collective of one pipeline stage: weft-model's `Collective` over
//! the stage's members inside the cluster's data-plane group, timing every wait.

use std::time::Instant;

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
}

impl Collective for StageCollective<'_> {
    fn rank(&self) -> usize {
        self.position
    }
    fn size(&self) -> usize {
        self.members.len()
    }
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), String> {
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
