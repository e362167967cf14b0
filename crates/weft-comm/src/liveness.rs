//! Who in a group is alive: when each rank was last heard from on the control plane
//! (heartbeats), so that a data-plane wait can tell a peer that is computing from one that
//! is dead, stalled or cut off, and name the silent one.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// A rank marked dead reads as silent for ever.
const DEAD: u64 = u64::MAX;

/// Last-heard times per rank, shared (behind an `Arc`) by the threads that read heartbeats
/// and the data plane that consults them.
#[derive(Debug)]
pub struct Liveness {
    epoch: Instant,
    /// Nanoseconds after `epoch` at which each rank was last heard; `DEAD` once lost.
    heard_ns: Vec<AtomicU64>,
    /// Ranks in use (a table made before the group's size is known may hold more).
    active: AtomicUsize,
    /// The rank that relays everyone else's heartbeats (a cluster's coordinator): when it
    /// goes silent, the others' ages are stale and it is the one to blame.
    relay: Option<usize>,
}

impl Liveness {
    /// A table of `ranks` ranks, every one heard now.
    pub fn new(ranks: usize, relay: Option<usize>) -> Self {
        Liveness {
            epoch: Instant::now(),
            heard_ns: (0..ranks).map(|_| AtomicU64::new(0)).collect(),
            active: AtomicUsize::new(ranks),
            relay,
        }
    }

    /// Ranks in use.
    pub fn ranks(&self) -> usize {
        self.active.load(Ordering::Relaxed).min(self.heard_ns.len())
    }

    /// Uses only the first `n` ranks from now on (the group's size, once known).
    pub fn limit_to(&self, n: usize) {
        self.active
            .store(n.min(self.heard_ns.len()), Ordering::Relaxed);
    }

    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Records that `rank` was heard `ago` before now (a relayed age), unless it is dead
    /// or was already heard more recently.
    pub fn heard_ago(&self, rank: usize, ago: Duration) {
        if let Some(h) = self.heard_ns.get(rank) {
            let t = self.now_ns().saturating_sub(ago.as_nanos() as u64);
            let _ = h.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                (old != DEAD && t > old).then_some(t)
            });
        }
    }

    /// Records that `rank` was heard just now.
    pub fn heard(&self, rank: usize) {
        self.heard_ago(rank, Duration::ZERO);
    }

    /// Marks `rank` lost for good (its control connection closed).
    pub fn mark_dead(&self, rank: usize) {
        if let Some(h) = self.heard_ns.get(rank) {
            h.store(DEAD, Ordering::Relaxed);
        }
    }

    /// How long `rank` has been silent (`Duration::MAX` once dead or unknown).
    pub fn silent_for(&self, rank: usize) -> Duration {
        match self.heard_ns.get(rank).map(|h| h.load(Ordering::Relaxed)) {
            Some(DEAD) | None => Duration::MAX,
            Some(t) => Duration::from_nanos(self.now_ns().saturating_sub(t)),
        }
    }

    /// Every rank's silence in whole milliseconds (saturating), for relaying.
    pub fn ages_ms(&self) -> Vec<u32> {
        (0..self.ranks())
            .map(|r| self.silent_for(r).as_millis().min(u32::MAX as u128) as u32)
            .collect()
    }

    /// The first rank silent for at least `limit`, with its silence: the relay first
    /// (when it is silent the others' figures are stale), then in rank order. `me` is
    /// skipped: a rank never waits on itself.
    pub fn lost(&self, limit: Duration, me: usize) -> Option<(usize, Duration)> {
        let order = self
            .relay
            .into_iter()
            .chain((0..self.ranks()).filter(|&r| Some(r) != self.relay));
        for r in order {
            if r == me {
                continue;
            }
            let s = self.silent_for(r);
            if s >= limit {
                return Some((r, s));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silence_grows_and_heartbeats_reset_it() {
        let l = Liveness::new(3, Some(0));
        assert!(l.lost(Duration::from_millis(50), 1).is_none());
        std::thread::sleep(Duration::from_millis(60));
        l.heard(0);
        l.heard(2);
        let (r, s) = l
            .lost(Duration::from_millis(50), 0)
            .expect("rank 1 is silent");
        assert_eq!(r, 1);
        assert!(s >= Duration::from_millis(50));
        l.heard_ago(1, Duration::from_millis(10));
        assert!(l.lost(Duration::from_millis(50), 0).is_none());
    }

    #[test]
    fn the_relay_is_blamed_first_and_the_dead_stay_dead() {
        let l = Liveness::new(3, Some(0));
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(l.lost(Duration::from_millis(20), 2).map(|x| x.0), Some(0));
        l.heard(0);
        l.mark_dead(2);
        l.heard(2);
        l.heard(1);
        assert_eq!(l.lost(Duration::from_millis(20), 1).map(|x| x.0), Some(2));
        assert_eq!(l.silent_for(2), Duration::MAX);
        assert_eq!(l.ages_ms()[2], u32::MAX);
    }

    #[test]
    fn an_older_relayed_age_does_not_move_time_back() {
        let l = Liveness::new(2, None);
        l.heard(1);
        l.heard_ago(1, Duration::from_secs(5));
        assert!(l.silent_for(1) < Duration::from_secs(1));
    }
}
