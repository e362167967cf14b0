//! The bridge between async handlers and the synchronous batcher thread: a request goes
//! in as a `Job`, its events come back on a tokio channel, and a dropped receiver (the
//! client went away) cancels the generation at the next step.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use weft_model::{
    BatchBackend, BatchOptions, BatchStats, Batcher, Event, EventSink, GenerateRequest, Job,
    TokenConstraint,
};
use weft_tokenizer::Tokenizer;

use crate::error::ApiError;

struct ChannelSink(UnboundedSender<Event>);

impl EventSink for ChannelSink {
    fn send(&mut self, event: Event) -> bool {
        self.0.send(event).is_ok()
    }
    fn is_closed(&self) -> bool {
        self.0.is_closed()
    }
}

/// Submits requests to the batcher thread.
pub struct EngineHandle {
    jobs: mpsc::Sender<Job>,
    pub stats: Arc<BatchStats>,
    pub options: BatchOptions,
    pub n_ctx: usize,
    /// Set (with the panic's message) when the batcher thread died: nothing can be
    /// served any more, so /health says so and the server exits for a supervisor to
    /// restart it.
    stopped: Arc<Mutex<Option<String>>>,
    /// The backend exists and the batcher runs (a deferred one is still being built:
    /// a cluster forming, its nodes loading their shards).
    ready: Arc<AtomicBool>,
}

/// Runs the batcher thread's body; a panic is recorded in `dead` with its message.
fn guarded(dead: &Mutex<Option<String>>, body: impl FnOnce()) {
    // A normal return means the server dropped its handle (shutting down); only a panic
    // leaves a server that can no longer answer.
    if let Err(p) = std::panic::catch_unwind(AssertUnwindSafe(body)) {
        let why = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panicked".into());
        tracing::error!("the batcher thread died: {why}");
        if let Ok(mut s) = dead.lock() {
            *s = Some(why);
        }
    }
}

impl EngineHandle {
    /// Starts the batcher on its own thread over `backend`.
    pub fn start<B: BatchBackend + Send + 'static>(
        backend: B,
        tokenizer: Arc<Tokenizer>,
        opts: BatchOptions,
    ) -> std::io::Result<Self> {
        let n_ctx = backend.n_ctx();
        let batcher = Batcher::new(backend, tokenizer, opts);
        let stats = batcher.stats();
        let options = batcher.options();
        let (jobs, rx) = mpsc::channel();
        let stopped = Arc::new(Mutex::new(None));
        let dead = stopped.clone();
        std::thread::Builder::new()
            .name("weft-batcher".into())
            .spawn(move || guarded(&dead, || batcher.run(rx)))?;
        Ok(EngineHandle {
            jobs,
            stats,
            options,
            n_ctx,
            stopped,
            ready: Arc::new(AtomicBool::new(true)),
        })
    }

    /// Starts the batcher thread, which first builds its backend with `build` (forming a
    /// cluster: minutes for a large model) while the server already answers. Requests
    /// queue meanwhile; a failed build stops the engine with its error. `n_ctx` and
    /// `opts` are what the backend will have.
    pub fn start_deferred<B, F>(
        build: F,
        tokenizer: Arc<Tokenizer>,
        opts: BatchOptions,
        n_ctx: usize,
    ) -> std::io::Result<Self>
    where
        B: BatchBackend + 'static,
        F: FnOnce() -> Result<B, String> + Send + 'static,
    {
        let stats = Arc::new(BatchStats::new(opts.max_seqs.max(1)));
        let (jobs, rx) = mpsc::channel();
        let stopped = Arc::new(Mutex::new(None));
        let ready = Arc::new(AtomicBool::new(false));
        let (dead, up, counts) = (stopped.clone(), ready.clone(), stats.clone());
        std::thread::Builder::new()
            .name("weft-batcher".into())
            .spawn(move || {
                guarded(&dead, || match build() {
                    Ok(backend) => {
                        let batcher = Batcher::with_stats(backend, tokenizer, opts, counts);
                        up.store(true, Ordering::Release);
                        batcher.run(rx)
                    }
                    Err(e) => {
                        // The caller reports it (`wait_ready`, /health).
                        if let Ok(mut s) = dead.lock() {
                            *s = Some(e);
                        }
                    }
                })
            })?;
        Ok(EngineHandle {
            jobs,
            stats,
            options: opts,
            n_ctx,
            stopped,
            ready,
        })
    }

    /// Whether the backend is built and serving (false while a cluster forms).
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Resolves once the backend is built (Ok) or the engine has stopped (its reason).
    pub async fn wait_ready(&self) -> Result<(), String> {
        loop {
            if let Some(why) = self.stopped() {
                return Err(why);
            }
            if self.is_ready() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Why the batcher thread died, if it did.
    pub fn stopped(&self) -> Option<String> {
        // A poisoned lock still holds the reason.
        match self.stopped.lock() {
            Ok(s) => s.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// Resolves once the batcher thread has died (polled: it happens at most once).
    pub async fn wait_stopped(&self) -> String {
        loop {
            if let Some(why) = self.stopped() {
                return why;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Queues `req`, its tokens held to `rule` if one is given; its events arrive on the
    /// returned channel.
    pub fn submit(
        &self,
        req: GenerateRequest,
        rule: Option<Box<dyn TokenConstraint>>,
    ) -> Result<UnboundedReceiver<Event>, ApiError> {
        let (tx, rx) = unbounded_channel();
        let mut job = Job::new(req, Box::new(ChannelSink(tx)));
        job.constraint = rule;
        if !self.is_ready() {
            // The batcher counts its queue once it runs; until then the jobs wait here.
            self.stats.queued.fetch_add(1, Ordering::Relaxed);
        }
        self.jobs
            .send(job)
            .map_err(|_| ApiError::unavailable("the inference engine has stopped"))?;
        Ok(rx)
    }
}
