//! The batcher's live counters, read by the HTTP side (`/v1/cluster`, `/health`, the
//! dashboard): totals, and one record per slot of the request running in it, all atomics
//! the batcher thread stores into, so a step allocates nothing for them.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

/// Live counters of one batcher.
#[derive(Debug)]
pub struct BatchStats {
    pub active: AtomicUsize,
    pub queued: AtomicUsize,
    pub generated_tokens: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub steps: AtomicU64,
    pub completed: AtomicU64,
    pub cancelled: AtomicU64,
    pub failed: AtomicU64,
    /// Time to first token (from submission) of completed requests: how many, their sum
    /// in µs, and the last one's.
    pub ttft_count: AtomicU64,
    pub ttft_us_sum: AtomicU64,
    pub last_ttft_us: AtomicU64,
    /// The request running in each slot.
    pub slots: Vec<SlotLive>,
    /// What the slots' times count from.
    pub epoch: Instant,
    next_request: AtomicU64,
}

/// The request in one slot, as it runs; `request` 0: the slot is free.
#[derive(Debug, Default)]
pub struct SlotLive {
    /// Requests are numbered from 1 in the order they were admitted.
    pub request: AtomicU64,
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens run so far.
    pub prompt_done: AtomicU64,
    pub generated: AtomicU64,
    /// µs after `epoch`: when it was submitted, and when its first token came (0: not yet).
    pub submitted_us: AtomicU64,
    pub first_token_us: AtomicU64,
}

/// One running request, as `BatchStats::running` reads it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RunningRequest {
    pub request: u64,
    pub prompt_tokens: u64,
    pub prompt_done: u64,
    pub generated: u64,
    /// Seconds since it was submitted; to its first token (None: not yet).
    pub age_s: f64,
    pub ttft_s: Option<f64>,
    /// Decode speed since its first token (None: under two tokens yet).
    pub tok_s: Option<f64>,
}

impl Default for BatchStats {
    fn default() -> Self {
        Self::new(0)
    }
}

impl BatchStats {
    pub fn new(slots: usize) -> Self {
        BatchStats {
            active: AtomicUsize::new(0),
            queued: AtomicUsize::new(0),
            generated_tokens: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            steps: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            ttft_count: AtomicU64::new(0),
            ttft_us_sum: AtomicU64::new(0),
            last_ttft_us: AtomicU64::new(0),
            slots: (0..slots).map(|_| SlotLive::default()).collect(),
            epoch: Instant::now(),
            next_request: AtomicU64::new(1),
        }
    }

    fn us(&self, t: Instant) -> u64 {
        // Never 0, which means "not yet".
        (t.saturating_duration_since(self.epoch).as_micros() as u64).max(1)
    }

    /// A request submitted at `submitted` with `prompt` tokens starts in `slot`.
    pub fn admitted(&self, slot: usize, prompt: usize, submitted: Instant) {
        let Some(s) = self.slots.get(slot) else {
            return;
        };
        s.prompt_tokens.store(prompt as u64, Ordering::Relaxed);
        s.prompt_done.store(0, Ordering::Relaxed);
        s.generated.store(0, Ordering::Relaxed);
        s.submitted_us.store(self.us(submitted), Ordering::Relaxed);
        s.first_token_us.store(0, Ordering::Relaxed);
        let id = self.next_request.fetch_add(1, Ordering::Relaxed);
        s.request.store(id, Ordering::Relaxed);
    }

    /// `n` more of `slot`'s prompt tokens have run.
    pub fn prompt_ran(&self, slot: usize, n: usize) {
        if let Some(s) = self.slots.get(slot) {
            s.prompt_done.fetch_add(n as u64, Ordering::Relaxed);
        }
    }

    /// `slot` sampled for the first time at `now` (whether or not the token is kept: a
    /// first token that ends the answer is still its first).
    pub fn first_token(&self, slot: usize, now: Instant) {
        if let Some(s) = self.slots.get(slot) {
            s.first_token_us.store(self.us(now), Ordering::Relaxed);
        }
    }

    /// `slot` kept one more token.
    pub fn kept(&self, slot: usize) {
        if let Some(s) = self.slots.get(slot) {
            s.generated.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// `slot`'s request completed: its time to first token joins the totals.
    pub fn completed_in(&self, slot: usize) {
        if let Some(s) = self.slots.get(slot) {
            let (sub, first) = (
                s.submitted_us.load(Ordering::Relaxed),
                s.first_token_us.load(Ordering::Relaxed),
            );
            if first >= sub && first > 0 {
                self.ttft_count.fetch_add(1, Ordering::Relaxed);
                self.ttft_us_sum.fetch_add(first - sub, Ordering::Relaxed);
                self.last_ttft_us.store(first - sub, Ordering::Relaxed);
            }
        }
        self.completed.fetch_add(1, Ordering::Relaxed);
    }

    /// `slot` is free again.
    pub fn freed(&self, slot: usize) {
        if let Some(s) = self.slots.get(slot) {
            s.request.store(0, Ordering::Relaxed);
        }
    }

    /// The requests running now, oldest first. A reader may see a slot mid-update (its
    /// fields are stored one by one): a figure may be a step stale, never unsafe.
    pub fn running(&self) -> Vec<RunningRequest> {
        let now = self.us(Instant::now());
        let mut out: Vec<RunningRequest> = self
            .slots
            .iter()
            .filter_map(|s| {
                let request = s.request.load(Ordering::Relaxed);
                if request == 0 {
                    return None;
                }
                let sub = s.submitted_us.load(Ordering::Relaxed);
                let first = s.first_token_us.load(Ordering::Relaxed);
                let generated = s.generated.load(Ordering::Relaxed);
                let secs = |us: u64| us as f64 / 1e6;
                Some(RunningRequest {
                    request,
                    prompt_tokens: s.prompt_tokens.load(Ordering::Relaxed),
                    prompt_done: s.prompt_done.load(Ordering::Relaxed),
                    generated,
                    age_s: secs(now.saturating_sub(sub)),
                    ttft_s: (first > 0).then(|| secs(first.saturating_sub(sub))),
                    tok_s: (first > 0 && generated > 1 && now > first)
                        .then(|| (generated - 1) as f64 / secs(now - first)),
                })
            })
            .collect();
        out.sort_by_key(|r| r.request);
        out
    }

    /// Mean time to first token of the completed requests, in seconds.
    pub fn mean_ttft_s(&self) -> Option<f64> {
        let n = self.ttft_count.load(Ordering::Relaxed);
        (n > 0).then(|| self.ttft_us_sum.load(Ordering::Relaxed) as f64 / 1e6 / n as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_request_is_followed_from_admission_to_its_end() {
        let st = BatchStats::new(2);
        let t0 = Instant::now();
        st.admitted(1, 10, t0);
        st.prompt_ran(1, 6);
        st.prompt_ran(1, 4);
        let r = st.running();
        assert_eq!(r.len(), 1);
        assert_eq!(
            (r[0].request, r[0].prompt_tokens, r[0].prompt_done),
            (1, 10, 10)
        );
        assert_eq!((r[0].generated, r[0].ttft_s, r[0].tok_s), (0, None, None));
        std::thread::sleep(Duration::from_millis(5));
        st.first_token(1, Instant::now());
        st.kept(1);
        std::thread::sleep(Duration::from_millis(5));
        st.kept(1);
        st.kept(1);
        let r = st.running()[0];
        assert_eq!(r.generated, 3);
        let ttft = r.ttft_s.unwrap();
        assert!(ttft >= 0.005 && ttft <= r.age_s, "{r:?}");
        assert!(r.tok_s.unwrap() > 0.0, "{r:?}");
        st.admitted(0, 3, Instant::now());
        assert_eq!(
            st.running().iter().map(|r| r.request).collect::<Vec<_>>(),
            vec![1, 2],
            "oldest first"
        );
        st.completed_in(1);
        st.freed(1);
        assert_eq!(st.running().len(), 1);
        assert_eq!(st.completed.load(Ordering::Relaxed), 1);
        let mean = st.mean_ttft_s().unwrap();
        assert!((mean - ttft).abs() < 1e-6, "{mean} vs {ttft}");
        // A slot the backend does not have is ignored, not a panic.
        st.admitted(9, 1, Instant::now());
        st.first_token(9, Instant::now());
        st.kept(9);
        // A request whose first sample ended it (no token kept) still has its TTFT.
        st.admitted(1, 2, Instant::now());
        st.first_token(1, Instant::now());
        st.completed_in(1);
        assert_eq!(st.ttft_count.load(Ordering::Relaxed), 2);
    }
}
