//! A link is a reliable byte stream to one peer with deadlines on every wait; framing and
//! collectives sit above it. Also the adaptive spin-then-block policy the links share.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::Fault;
use crate::liveness::Liveness;

pub trait Link: Send {
    /// Writes all of `bytes`, waiting for room until `deadline` gives up.
    fn write_all(&mut self, bytes: &[u8], deadline: &mut Deadline) -> Result<(), Fault>;
    /// Fills `buf`, waiting for data until `deadline` gives up.
    fn read_exact(&mut self, buf: &mut [u8], deadline: &mut Deadline) -> Result<(), Fault>;
    /// "tcp", "shm" or "in-process", for logs and reports.
    fn kind(&self) -> &'static str;
}

/// How long a waiting receiver busy-polls before it blocks. A spin that catches the data
/// saves the 25–30 µs wake-up of a sleeping thread; a spin that runs out only burns the
/// core, so the budget halves after each spin that ran out and doubles after each catch.
#[derive(Clone, Debug)]
pub struct SpinPolicy {
    budget: Duration,
    min: Duration,
    max: Duration,
}

impl SpinPolicy {
    pub fn new(max: Duration) -> Self {
        SpinPolicy {
            budget: max,
            min: max.min(Duration::from_micros(5)),
            max,
        }
    }

    pub fn budget(&self) -> Duration {
        self.budget
    }

    /// Records the outcome of one wait: caught while spinning, or not.
    pub fn record(&mut self, caught_while_spinning: bool) {
        self.budget = if caught_while_spinning {
            (self.budget * 2).min(self.max)
        } else {
            (self.budget / 2).max(self.min)
        };
    }
}

/// How long a waiter spins before it starts yielding its core between polls (ns). Yielding
/// costs a syscall per poll, so it is only worth it when this host runs more ranks than it
/// has cores (4 ranks on 2 vCPUs): then the rank being waited for may need our core.
static PURE_SPIN_NS: AtomicU64 = AtomicU64::new(u64::MAX);

/// Called when a group learns how many of its ranks share this host.
pub fn set_oversubscribed(yes: bool) {
    PURE_SPIN_NS.store(if yes { 2_000 } else { u64::MAX }, Ordering::Relaxed);
}

/// One poll-loop pause: a spin hint, or a yield of the core once spinning has gone on
/// for the pure-spin time on an oversubscribed host.
#[inline]
pub fn pause(waited: Duration) {
    if (waited.as_nanos() as u64) < PURE_SPIN_NS.load(Ordering::Relaxed) {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

/// When a wait on a peer gives up. Plain, it is an instant `timeout` after the wait began.
/// With a liveness table, a wait that reaches that instant goes on in short slices while
/// every rank of the group has been heard within `timeout` (a peer that is computing a long
/// prefill is busy, not lost), up to `cap`; it gives up naming the first silent rank.
#[derive(Clone, Debug)]
pub struct Deadline {
    at: Instant,
    timeout: Duration,
    patience: Option<Patience>,
}

#[derive(Clone, Debug)]
struct Patience {
    liveness: Arc<Liveness>,
    me: usize,
    cap: Instant,
}

impl Deadline {
    /// A plain deadline `timeout` from now.
    pub fn after(timeout: Duration) -> Self {
        Deadline {
            at: Instant::now() + timeout,
            timeout,
            patience: None,
        }
    }

    /// A deadline that follows the group's heartbeats (see the type), for rank `me`.
    pub fn patient(
        timeout: Duration,
        liveness: Option<&Arc<Liveness>>,
        me: usize,
        max_wait: Duration,
    ) -> Self {
        let now = Instant::now();
        Deadline {
            at: now + timeout,
            timeout,
            patience: liveness.map(|l| Patience {
                liveness: l.clone(),
                me,
                cap: now + max_wait.max(timeout),
            }),
        }
    }

    /// The time left, or the fault to give up with: a silent rank, or the timeout.
    pub fn left(&mut self) -> Result<Duration, Fault> {
        let now = Instant::now();
        if now < self.at {
            return Ok(self.at - now);
        }
        if let Some(p) = &self.patience {
            if let Some((rank, silent)) = p.liveness.lost(self.timeout, p.me) {
                return Err(Fault::Silent { rank, silent });
            }
            if now < p.cap {
                self.at = now + (self.timeout / 4).max(Duration::from_millis(1));
                return Ok(self.at - now);
            }
        }
        Err(Fault::TimedOut(self.timeout))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spin_budget_adapts_within_bounds() {
        let mut p = SpinPolicy::new(Duration::from_micros(200));
        for _ in 0..20 {
            p.record(false);
        }
        assert_eq!(p.budget(), Duration::from_micros(5));
        p.record(true);
        assert_eq!(p.budget(), Duration::from_micros(10));
        for _ in 0..20 {
            p.record(true);
        }
        assert_eq!(p.budget(), Duration::from_micros(200));
    }
}
