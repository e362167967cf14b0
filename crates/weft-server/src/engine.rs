//! The bridge between async handlers and the synchronous batcher thread: a request goes
//! in as a `Job`, its events come back on a tokio channel, and a dropped receiver (the
//! client went away) cancels the generation at the next step.

use std::sync::mpsc;
use std::sync::Arc;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use weft_model::{
    BatchBackend, BatchOptions, BatchStats, Batcher, Event, EventSink, GenerateRequest, Job,
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
        std::thread::Builder::new()
            .name("weft-batcher".into())
            .spawn(move || batcher.run(rx))?;
        Ok(EngineHandle {
            jobs,
            stats,
            options,
            n_ctx,
        })
    }

    /// Queues `req`; its events arrive on the returned channel.
    pub fn submit(&self, req: GenerateRequest) -> Result<UnboundedReceiver<Event>, ApiError> {
        let (tx, rx) = unbounded_channel();
        self.jobs
            .send(Job::new(req, Box::new(ChannelSink(tx))))
            .map_err(|_| ApiError::unavailable("the inference engine has stopped"))?;
        Ok(rx)
    }
}
