//! Keeps a cluster's sequences running through a lost node: every slot's tokens are kept
//! as they run, and when a step fails on a lost node the cluster is formed again from the
//! nodes that answer (waiting, up to a limit, for one to come back), each running slot's
//! KV cache is rebuilt by prefilling what it had run, and the failed step runs again. The
//! batcher sees one slow step; streams pause and go on.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use weft_model::{BatchBackend, ModelError, SeqSpan};

use crate::coordinator::Cluster;

/// Forms a cluster from the nodes that answer now (a lost one that is back answers
/// again, so it is taken in).
pub trait Former: Send {
    fn form(&mut self) -> Result<Cluster, String>;
}

/// How long to keep trying.
#[derive(Clone, Copy, Debug)]
pub struct ResumeOptions {
    /// From the failure on: past this, the step's sequences fail with the lost node named.
    pub wait: Duration,
    /// Pause between attempts to form the cluster again.
    pub retry: Duration,
}

impl Default for ResumeOptions {
    fn default() -> Self {
        ResumeOptions {
            wait: Duration::from_secs(60),
            retry: Duration::from_millis(250),
        }
    }
}

/// One loss and what was done about it, as `/v1/cluster` and the logs report it.
#[derive(Clone, Debug, Serialize)]
pub struct ResumeEvent {
    /// When the step failed (ms since the Unix epoch).
    pub at_unix_ms: u64,
    /// The nodes the failed cluster lost, and the error that showed it.
    pub lost: Vec<String>,
    pub error: String,
    /// Whether the sequences went on; if not, `error` is what they failed with.
    pub resumed: bool,
    /// From the failure to the failed step's completion on the new cluster.
    pub pause_ms: u64,
    /// Sequences whose caches were rebuilt, and the tokens prefilled to rebuild them.
    pub sequences: usize,
    pub replayed_tokens: usize,
    /// Attempts to form the cluster again.
    pub attempts: usize,
    /// The nodes of the cluster that took over.
    pub nodes: Vec<String>,
}

/// What each slot has run since its last reset, to rebuild its cache elsewhere.
struct History {
    tokens: Vec<Vec<u32>>,
}

impl History {
    fn new(slots: usize) -> Self {
        History {
            tokens: vec![Vec::new(); slots],
        }
    }

    fn clear(&mut self, slot: usize) {
        if let Some(h) = self.tokens.get_mut(slot) {
            h.clear();
        }
    }

    /// Appends a successful step's tokens to the slots its spans name.
    fn record(&mut self, tokens: &[u32], spans: &[SeqSpan]) {
        let mut at = 0;
        for s in spans {
            if let Some(h) = self.tokens.get_mut(s.cache) {
                h.extend_from_slice(&tokens[at..at + s.n_tokens]);
            }
            at += s.n_tokens;
        }
    }
}

/// A `BatchBackend` over a cluster that survives lost nodes.
pub struct Resuming<F: Former> {
    former: F,
    live: Option<Cluster>,
    history: History,
    opts: ResumeOptions,
    slots: usize,
    n_ctx: usize,
    max_rows: usize,
    events: Arc<Mutex<Vec<ResumeEvent>>>,
    /// Handed out by `logits` if asked with no cluster (the batcher never does).
    empty: Vec<f32>,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Runs every slot's kept tokens through `c`, a fresh cluster (its slots start reset),
/// several slots to a step up to `max_rows` rows, so that the weights are read once for
/// all of them; returns (sequences, tokens) replayed.
fn replay<B: BatchBackend>(
    c: &mut B,
    history: &History,
    max_rows: usize,
) -> Result<(usize, usize), ModelError> {
    let max_rows = max_rows.max(1);
    let seqs = history.tokens.iter().filter(|t| !t.is_empty()).count();
    let total = history.tokens.iter().map(Vec::len).sum();
    // Per slot, how many of its tokens have run.
    let mut done = vec![0usize; history.tokens.len()];
    let mut tokens = Vec::with_capacity(max_rows);
    let mut spans = Vec::new();
    loop {
        tokens.clear();
        spans.clear();
        for (slot, kept) in history.tokens.iter().enumerate() {
            let room = max_rows - tokens.len();
            let left = kept.len() - done[slot];
            if room == 0 {
                break;
            }
            if left == 0 {
                continue;
            }
            let n = left.min(room);
            tokens.extend_from_slice(&kept[done[slot]..done[slot] + n]);
            spans.push(SeqSpan {
                cache: slot,
                n_tokens: n,
                logits: false,
            });
            done[slot] += n;
        }
        if spans.is_empty() {
            return Ok((seqs, total));
        }
        BatchBackend::step(c, &tokens, &spans)?;
    }
}

impl<F: Former> Resuming<F> {
    /// Wraps `first`, the cluster as formed at start; `former` forms the next ones.
    pub fn new(first: Cluster, former: F, opts: ResumeOptions) -> Self {
        let slots = BatchBackend::slots(&first);
        let n_ctx = BatchBackend::n_ctx(&first);
        let max_rows = BatchBackend::max_rows(&first);
        Resuming {
            former,
            live: Some(first),
            history: History::new(slots),
            opts,
            slots,
            n_ctx,
            max_rows,
            events: Arc::default(),
            empty: Vec::new(),
        }
    }

    /// Keeps its record of losses in `events` (made before the cluster was, for a
    /// reporter that starts first).
    pub fn with_events(mut self, events: Arc<Mutex<Vec<ResumeEvent>>>) -> Self {
        self.events = events;
        self
    }

    /// Every loss so far, shared with whoever reports them.
    pub fn events(&self) -> Arc<Mutex<Vec<ResumeEvent>>> {
        self.events.clone()
    }

    fn log(&self, e: ResumeEvent) {
        if let Ok(mut v) = self.events.lock() {
            // The most recent ones are what a reader wants; keep the list bounded.
            if v.len() >= 64 {
                v.remove(0);
            }
            v.push(e);
        }
    }

    /// The live cluster, formed again first (its caches empty, so no slot keeps tokens)
    /// if the last one could not be resumed.
    fn cluster(&mut self) -> Result<&mut Cluster, ModelError> {
        if self.live.is_none() {
            let c = self
                .former
                .form()
                .map_err(|e| ModelError::Collective(format!("the cluster is down: {e}")))?;
            self.history = History::new(self.slots);
            self.live = Some(c);
        }
        self.live
            .as_mut()
            .ok_or_else(|| ModelError::Collective("the cluster is down".into()))
    }

    /// After `failed` (a lost node) on the step of `tokens`/`spans`: forms the cluster
    /// again, rebuilds every running slot and runs the step, or gives up after the wait.
    fn resume(
        &mut self,
        failed: ModelError,
        tokens: &[u32],
        spans: &[SeqSpan],
    ) -> Result<(), ModelError> {
        let started = Instant::now();
        let at_unix_ms = unix_ms();
        let lost: Vec<String> = self
            .live
            .as_ref()
            .and_then(Cluster::lost_peer)
            .map(str::to_string)
            .into_iter()
            .collect();
        if let Some(c) = self.live.take() {
            c.abandon();
        }
        let error = failed.to_string();
        tracing::warn!("{error}: forming the cluster again from the nodes that answer");
        let mut attempts = 0;
        loop {
            attempts += 1;
            let last = match self.former.form() {
                Ok(mut c) => {
                    let rebuilt = replay(&mut c, &self.history, self.max_rows)
                        .and_then(|r| BatchBackend::step(&mut c, tokens, spans).map(|()| r));
                    match rebuilt {
                        Ok((sequences, replayed_tokens)) => {
                            let e = ResumeEvent {
                                at_unix_ms,
                                lost,
                                error,
                                resumed: true,
                                pause_ms: started.elapsed().as_millis() as u64,
                                sequences,
                                replayed_tokens,
                                attempts,
                                nodes: c.peers().to_vec(),
                            };
                            tracing::warn!(
                                "resumed on {:?} after {} ms: {} sequences rebuilt from {} tokens",
                                e.nodes,
                                e.pause_ms,
                                sequences,
                                replayed_tokens
                            );
                            self.log(e);
                            self.live = Some(c);
                            return Ok(());
                        }
                        Err(e) => {
                            c.abandon();
                            e.to_string()
                        }
                    }
                }
                Err(e) => e,
            };
            if started.elapsed() >= self.opts.wait {
                let msg = format!(
                    "{error}; no cluster could be formed again within {} s ({attempts} attempts; last: {last})",
                    self.opts.wait.as_secs_f64()
                );
                tracing::error!("{msg}");
                self.log(ResumeEvent {
                    at_unix_ms,
                    lost,
                    error: msg.clone(),
                    resumed: false,
                    pause_ms: started.elapsed().as_millis() as u64,
                    sequences: 0,
                    replayed_tokens: 0,
                    attempts,
                    nodes: Vec::new(),
                });
                // The caches went with the cluster; `cluster` starts the next one empty.
                return Err(ModelError::Collective(msg));
            }
            tracing::debug!("forming again failed: {last}");
            std::thread::sleep(self.opts.retry);
        }
    }
}

impl<F: Former> BatchBackend for Resuming<F> {
    fn n_ctx(&self) -> usize {
        self.n_ctx
    }
    fn slots(&self) -> usize {
        self.slots
    }
    fn max_rows(&self) -> usize {
        self.max_rows
    }
    fn reset(&mut self, slot: usize) -> Result<(), ModelError> {
        self.history.clear(slot);
        BatchBackend::reset(self.cluster()?, slot)
    }
    fn release(&mut self, slot: usize) {
        self.history.clear(slot);
    }
    fn step(&mut self, tokens: &[u32], spans: &[SeqSpan]) -> Result<(), ModelError> {
        let r = BatchBackend::step(self.cluster()?, tokens, spans);
        match r {
            Ok(()) => {}
            // Only a lost node is worth forming the cluster again for; a bad request
            // fails alone.
            Err(e @ ModelError::Collective(_)) => self.resume(e, tokens, spans)?,
            Err(e) => return Err(e),
        }
        self.history.record(tokens, spans);
        Ok(())
    }
    fn logits(&mut self, i: usize) -> &mut [f32] {
        match self.live.as_mut() {
            Some(c) => BatchBackend::logits(c, i),
            None => &mut self.empty,
        }
    }
    fn log_normalizer(&self, i: usize) -> Option<f32> {
        self.live
            .as_ref()
            .and_then(|c| BatchBackend::log_normalizer(c, i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_follows_spans_and_resets() {
        let mut h = History::new(3);
        let spans = [
            SeqSpan {
                cache: 2,
                n_tokens: 3,
                logits: true,
            },
            SeqSpan {
                cache: 0,
                n_tokens: 1,
                logits: true,
            },
        ];
        h.record(&[7, 8, 9, 4], &spans);
        h.record(
            &[5],
            &[SeqSpan {
                cache: 2,
                n_tokens: 1,
                logits: true,
            }],
        );
        assert_eq!(h.tokens[2], vec![7, 8, 9, 5]);
        assert_eq!(h.tokens[0], vec![4]);
        assert!(h.tokens[1].is_empty());
        h.clear(2);
        assert!(h.tokens[2].is_empty());
        // A slot past the end is ignored, not a panic.
        h.clear(9);
    }

    /// A step as recorded: its tokens and its spans' (slot, rows).
    type Recorded = (Vec<u32>, Vec<(usize, usize)>);

    /// Records the steps it is asked to run.
    #[derive(Default)]
    struct Steps(Vec<Recorded>);

    impl BatchBackend for Steps {
        fn n_ctx(&self) -> usize {
            1024
        }
        fn slots(&self) -> usize {
            4
        }
        fn max_rows(&self) -> usize {
            4
        }
        fn reset(&mut self, _: usize) -> Result<(), ModelError> {
            Ok(())
        }
        fn step(&mut self, tokens: &[u32], spans: &[SeqSpan]) -> Result<(), ModelError> {
            assert!(spans.iter().all(|s| !s.logits));
            let sp = spans.iter().map(|s| (s.cache, s.n_tokens)).collect();
            self.0.push((tokens.to_vec(), sp));
            Ok(())
        }
        fn logits(&mut self, _: usize) -> &mut [f32] {
            &mut []
        }
    }

    #[test]
    fn replay_packs_slots_into_full_steps_in_order() {
        let mut h = History::new(4);
        h.tokens[0] = vec![1, 2, 3];
        h.tokens[2] = vec![4, 5, 6, 7, 8];
        h.tokens[3] = vec![9];
        let mut b = Steps::default();
        assert_eq!(replay(&mut b, &h, 4).unwrap(), (3, 9));
        // Rows per step at most 4; each slot's tokens in order, slots sharing steps.
        assert_eq!(
            b.0,
            vec![
                (vec![1, 2, 3, 4], vec![(0, 3), (2, 1)]),
                (vec![5, 6, 7, 8], vec![(2, 4)]),
                (vec![9], vec![(3, 1)]),
            ]
        );
        let mut none = Steps::default();
        assert_eq!(replay(&mut none, &History::new(2), 4).unwrap(), (0, 0));
        assert!(none.0.is_empty());
    }
}
