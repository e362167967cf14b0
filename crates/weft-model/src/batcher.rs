//! Continuous batching: every active sequence decodes in one shared forward step (the
//! weights are read once for all of them), new requests join between steps, long prompts
//! are prefilled in chunks between the running decodes, and requests beyond the cap on
//! concurrent sequences wait in a queue. Synchronous: it runs on its own thread and talks
//! to the HTTP side only through `Job`s and their `EventSink`s.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;

use crate::batch_stats::BatchStats;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::Instant;

use weft_tokenizer::Tokenizer;

use crate::batch::SeqSpan;
use crate::constraint::TokenConstraint;
use crate::error::ModelError;
use crate::generate::Sequence;
use crate::request::{GenerateRequest, Generated};

/// Something that runs batched steps over a fixed set of sequence slots, each with its
/// own KV cache: the whole model on this node, or a cluster.
pub trait BatchBackend {
    /// The most tokens one sequence may hold.
    fn n_ctx(&self) -> usize;
    /// How many sequences can be held at once.
    fn slots(&self) -> usize;
    /// The most token rows one step may carry.
    fn max_rows(&self) -> usize;
    /// Forgets slot `slot`'s sequence so a new one can start there.
    fn reset(&mut self, slot: usize) -> Result<(), ModelError>;
    /// Slot `slot`'s sequence has ended (finished, cancelled or failed): nothing will
    /// run in it until the next `reset`. A backend that keeps what each slot ran (to
    /// rebuild it elsewhere) may drop it now.
    fn release(&mut self, _slot: usize) {}
    /// Runs `tokens`, laid out as `spans` (each naming a slot), through the model.
    fn step(&mut self, tokens: &[u32], spans: &[SeqSpan]) -> Result<(), ModelError>;
    /// The logits of the `i`-th span that asked for them in the last step.
    fn logits(&mut self, i: usize) -> &mut [f32];
    /// log Σ exp over the full vocabulary when `logits(i)` holds only a top-k view.
    fn log_normalizer(&self, _i: usize) -> Option<f32> {
        None
    }
}

/// What a request hears about its generation.
#[derive(Debug)]
pub enum Event {
    /// Text that became safe to emit, and the token that produced it (None for text
    /// flushed at the end), with its logprob and top alternatives when asked for.
    Token {
        text: String,
        token: Option<u32>,
        logprob: Option<(f32, Vec<(u32, f32)>)>,
    },
    /// The generation ended; timings are filled in (prefill: admission to first token).
    Done(Generated),
    /// The request could not run or its step failed.
    Failed(ModelError),
}

/// Where a request's events go. `send` returns false once the client is gone, which
/// cancels the generation and frees its slot.
pub trait EventSink: Send {
    fn send(&mut self, event: Event) -> bool;
    /// Whether the client has gone away (checked between steps, even while queued).
    fn is_closed(&self) -> bool;
}

/// One request for the batcher.
pub struct Job {
    pub req: GenerateRequest,
    pub sink: Box<dyn EventSink>,
    /// When the request was handed over (its queueing time counts from here).
    pub submitted: Instant,
    /// The rule its tokens must follow (structured output), if any.
    pub constraint: Option<Box<dyn TokenConstraint>>,
}

impl Job {
    pub fn new(req: GenerateRequest, sink: Box<dyn EventSink>) -> Self {
        Job {
            req,
            sink,
            submitted: Instant::now(),
            constraint: None,
        }
    }
}

/// Scheduling limits.
#[derive(Clone, Copy, Debug)]
pub struct BatchOptions {
    /// Most sequences decoding at once (at most the backend's slots).
    pub max_seqs: usize,
    /// Most prompt tokens a step carries while other sequences are decoding, so a long
    /// prompt stalls running streams for at most one such chunk per token; with nothing
    /// decoding a step takes a full micro-batch.
    pub prefill_chunk: usize,
}

/// A sequence holding a slot.
struct Active<'t> {
    slot: usize,
    seq: Sequence<'t>,
    prompt: Vec<u32>,
    /// Prompt tokens already run.
    fed: usize,
    /// The token to run next once the prompt is done.
    next: Option<u32>,
    sink: Box<dyn EventSink>,
    submitted: Instant,
    admitted: Instant,
    first_token: Option<Instant>,
    /// Finished, cancelled or failed: its slot is released after this step.
    gone: bool,
    failed: bool,
}

/// The scheduler loop over one backend.
pub struct Batcher<B: BatchBackend> {
    backend: B,
    tokenizer: Arc<Tokenizer>,
    opts: BatchOptions,
    stats: Arc<BatchStats>,
    /// Test hook, read once at start from WEFT_TEST_PANIC_ON_PROMPT: a prompt whose text
    /// contains this panics the batcher thread, so tests can check what a dying engine
    /// looks like from outside (/health, the exit code). Unset in normal use.
    panic_on: Option<String>,
}

/// The environment variable of the test hook above.
pub const PANIC_HOOK_ENV: &str = "WEFT_TEST_PANIC_ON_PROMPT";

impl<B: BatchBackend> Batcher<B> {
    pub fn new(backend: B, tokenizer: Arc<Tokenizer>, opts: BatchOptions) -> Self {
        let stats = Arc::new(BatchStats::new(backend.slots().max(1)));
        Self::with_stats(backend, tokenizer, opts, stats)
    }

    /// As `new`, counting into `stats` (made before the backend was, for a reader that
    /// starts first; a slot past its records is simply not followed).
    pub fn with_stats(
        backend: B,
        tokenizer: Arc<Tokenizer>,
        opts: BatchOptions,
        stats: Arc<BatchStats>,
    ) -> Self {
        let max_seqs = opts.max_seqs.clamp(1, backend.slots().max(1));
        let prefill_chunk = opts.prefill_chunk.clamp(1, backend.max_rows().max(1));
        Batcher {
            backend,
            tokenizer,
            opts: BatchOptions {
                max_seqs,
                prefill_chunk,
            },
            stats,
            panic_on: std::env::var(PANIC_HOOK_ENV).ok().filter(|s| !s.is_empty()),
        }
    }

    pub fn stats(&self) -> Arc<BatchStats> {
        self.stats.clone()
    }

    pub fn options(&self) -> BatchOptions {
        self.opts
    }

    /// Serves jobs until `jobs` is closed and every admitted sequence has finished.
    pub fn run(mut self, jobs: Receiver<Job>) {
        let tokenizer = self.tokenizer.clone();
        let tok: &Tokenizer = &tokenizer;
        let mut queue: VecDeque<Job> = VecDeque::new();
        let mut active: Vec<Active<'_>> = Vec::new();
        let mut free: Vec<usize> = (0..self.opts.max_seqs).rev().collect();
        let max_rows = self.backend.max_rows();
        let mut tokens: Vec<u32> = Vec::with_capacity(max_rows);
        let mut spans: Vec<SeqSpan> = Vec::with_capacity(max_rows);
        // Index into `active` of each span that asked for logits, in span order.
        let mut wanting: Vec<usize> = Vec::with_capacity(max_rows);
        let mut open = true;
        let mut last_was_prefill = false;
        loop {
            // Take in whatever arrived; block only when there is nothing else to do.
            while open {
                let next = if active.is_empty() && queue.is_empty() {
                    jobs.recv().map_err(|_| TryRecvError::Disconnected)
                } else {
                    jobs.try_recv()
                };
                match next {
                    Ok(job) => queue.push_back(job),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => open = false,
                }
            }
            queue.retain(|j| {
                let keep = !j.sink.is_closed();
                if !keep {
                    self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
                }
                keep
            });
            while let Some(&slot) = free.last() {
                let Some(job) = queue.pop_front() else {
                    break;
                };
                if let Some(a) = self.admit(job, slot, tok) {
                    free.pop();
                    active.push(a);
                }
            }
            for a in active.iter_mut() {
                a.gone |= a.sink.is_closed();
            }
            self.release(&mut active, &mut free);
            self.stats.queued.store(queue.len(), Ordering::Relaxed);
            if active.is_empty() {
                if !open && queue.is_empty() {
                    return;
                }
                continue;
            }

            // Lay out the step. A step carries either prompt chunks or every decoding
            // sequence's next token, alternating while both are waiting: a new short
            // prompt then gets its first token after one short step instead of after a
            // step loaded with everyone's decode, and running streams lose the same time
            // either way (the chunk's work is done once whichever step carries it).
            tokens.clear();
            spans.clear();
            wanting.clear();
            let prefilling = active.iter().any(|a| a.fed < a.prompt.len());
            let decoding = active.iter().any(|a| a.next.is_some());
            let prefill_step = prefilling && !(decoding && last_was_prefill);
            last_was_prefill = prefill_step;
            if prefill_step {
                let mut budget = if decoding {
                    self.opts.prefill_chunk
                } else {
                    max_rows
                };
                for (i, a) in active.iter_mut().enumerate() {
                    let left = a.prompt.len() - a.fed;
                    if budget == 0 {
                        break;
                    }
                    if left == 0 {
                        continue;
                    }
                    let n = left.min(budget);
                    tokens.extend_from_slice(&a.prompt[a.fed..a.fed + n]);
                    a.fed += n;
                    self.stats.prompt_ran(a.slot, n);
                    spans.push(SeqSpan {
                        cache: a.slot,
                        n_tokens: n,
                        logits: n == left,
                    });
                    if n == left {
                        wanting.push(i);
                    }
                    budget -= n;
                }
            } else {
                for (i, a) in active.iter().enumerate() {
                    if let Some(t) = a.next {
                        tokens.push(t);
                        spans.push(SeqSpan {
                            cache: a.slot,
                            n_tokens: 1,
                            logits: true,
                        });
                        wanting.push(i);
                    }
                }
            }
            if let Err(e) = self.backend.step(&tokens, &spans) {
                let msg = e.to_string();
                tracing::warn!("batched step failed: {msg}");
                for a in active.iter_mut() {
                    a.sink
                        .send(Event::Failed(ModelError::Collective(msg.clone())));
                    a.gone = true;
                    a.failed = true;
                    self.stats.failed.fetch_add(1, Ordering::Relaxed);
                }
                self.release(&mut active, &mut free);
                continue;
            }
            self.stats.steps.fetch_add(1, Ordering::Relaxed);

            for (k, &i) in wanting.iter().enumerate() {
                let norm = self.backend.log_normalizer(k);
                let a = &mut active[i];
                let now = Instant::now();
                if a.first_token.is_none() {
                    a.first_token = Some(now);
                    self.stats.first_token(a.slot, now);
                } else {
                    a.seq.out.decode_steps += 1;
                }
                let step = match a.seq.advance(self.backend.logits(k), norm) {
                    Ok(step) => step,
                    Err(e) => {
                        // Only this sequence's logits were bad: it fails, the rest go on.
                        tracing::warn!("slot {}: {e}", a.slot);
                        a.sink.send(Event::Failed(e));
                        a.gone = true;
                        a.failed = true;
                        self.stats.failed.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                };
                a.next = step.next;
                if step.token.is_some() {
                    self.stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
                    self.stats.kept(a.slot);
                }
                if step.token.is_some() || !step.text.is_empty() {
                    // Only a kept token has a logprob entry, and only when they were asked for.
                    let logprob = step.token.and(a.seq.out.logprobs.last().cloned());
                    let ev = Event::Token {
                        text: step.text,
                        token: step.token,
                        logprob,
                    };
                    if !a.sink.send(ev) {
                        a.gone = true;
                        continue;
                    }
                }
                if a.seq.is_finished() {
                    let first = a.first_token.unwrap_or(now);
                    a.seq.out.prefill_secs = (first - a.admitted).as_secs_f64();
                    a.seq.out.decode_secs = (now - first).as_secs_f64();
                    tracing::debug!(
                        "slot {}: queued {:.1} ms, first token {:.1} ms after admission, {} tokens in {:.1} ms",
                        a.slot,
                        (a.admitted - a.submitted).as_secs_f64() * 1e3,
                        a.seq.out.prefill_secs * 1e3,
                        a.seq.out.token_ids.len(),
                        a.seq.out.decode_secs * 1e3
                    );
                    a.sink.send(Event::Done(std::mem::take(&mut a.seq.out)));
                    self.stats.completed_in(a.slot);
                    a.gone = true;
                }
            }
            self.release(&mut active, &mut free);
        }
    }

    /// Starts `job` in `slot`, or answers it with the reason it cannot run.
    fn admit<'t>(&mut self, mut job: Job, slot: usize, tok: &'t Tokenizer) -> Option<Active<'t>> {
        if let Some(needle) = &self.panic_on {
            if tok.decode(&job.req.prompt_ids).contains(needle.as_str()) {
                panic!("{PANIC_HOOK_ENV}: the prompt contains {needle:?}");
            }
        }
        let rule = job.constraint.take();
        let started = Sequence::start(tok, &job.req, self.backend.n_ctx())
            .and_then(|seq| self.backend.reset(slot).map(|()| seq.constrained(rule)));
        let seq = match started {
            Ok(seq) => seq,
            Err(e) => {
                job.sink.send(Event::Failed(e));
                self.stats.failed.fetch_add(1, Ordering::Relaxed);
                return None;
            }
        };
        self.stats
            .prompt_tokens
            .fetch_add(job.req.prompt_ids.len() as u64, Ordering::Relaxed);
        self.stats
            .admitted(slot, job.req.prompt_ids.len(), job.submitted);
        Some(Active {
            slot,
            seq,
            prompt: job.req.prompt_ids,
            fed: 0,
            next: None,
            sink: job.sink,
            submitted: job.submitted,
            admitted: Instant::now(),
            first_token: None,
            gone: false,
            failed: false,
        })
    }

    /// Drops finished and cancelled sequences, returning their slots.
    fn release(&mut self, active: &mut Vec<Active<'_>>, free: &mut Vec<usize>) {
        active.retain(|a| {
            if a.gone {
                if !a.seq.is_finished() && !a.failed {
                    self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
                }
                self.backend.release(a.slot);
                self.stats.freed(a.slot);
                free.push(a.slot);
            }
            !a.gone
        });
        self.stats.active.store(active.len(), Ordering::Relaxed);
    }
}
