//! The continuous batcher gives every request what it gets alone, whatever joins or
//! leaves around it: staggered arrivals, a queue beyond the slot cap, chunked long
//! prompts, a cancelled client, and a request that cannot run.

use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::Arc;

use weft_gguf::GgmlType;
use weft_model::synthetic::{synthetic_model, SyntheticSpec};
use weft_model::{
    Arch, BatchOptions, Batcher, Engine, Event, EventSink, GenerateRequest, Job, SamplingParams,
};

struct TestSink {
    tx: mpsc::Sender<(usize, Event)>,
    id: usize,
    /// Hang up after this many token events.
    hang_up_after: Option<usize>,
    tokens: usize,
}

impl EventSink for TestSink {
    fn send(&mut self, event: Event) -> bool {
        if matches!(event, Event::Token { .. }) {
            self.tokens += 1;
        }
        let _ = self.tx.send((self.id, event));
        self.hang_up_after.is_none_or(|n| self.tokens < n)
    }
    fn is_closed(&self) -> bool {
        self.hang_up_after.is_some_and(|n| self.tokens >= n)
    }
}

fn request(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt_ids: prompt,
        max_tokens,
        sampling: SamplingParams::greedy(),
        stop: Vec::new(),
        logprobs: 2,
    }
}

#[test]
fn batched_requests_match_running_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    synthetic_model(&SyntheticSpec::small(Arch::Gemma3, GgmlType::F32))
        .write_file(&path)
        .unwrap();
    // Prompts of several lengths; one crosses the 128-token micro-batch.
    let prompts: Vec<Vec<u32>> = [5usize, 17, 150, 2, 40]
        .iter()
        .enumerate()
        .map(|(k, &n)| {
            (0..n)
                .map(|i| 4 + ((i * 31 + k * 7) % 500) as u32)
                .collect()
        })
        .collect();
    let mut alone = Engine::load(&path, 2, 512, &mut |_, _| {}).unwrap();
    let want: Vec<_> = prompts
        .iter()
        .map(|p| {
            alone
                .generate(&request(p.clone(), 12), &mut |_| {})
                .unwrap()
        })
        .collect();
    drop(alone);

    let engine = Engine::load(&path, 2, 512, &mut |_, _| {}).unwrap();
    let (backend, tokenizer) = engine.into_batch(3, 512);
    let opts = BatchOptions {
        max_seqs: 3,
        prefill_chunk: 16,
    };
    let batcher = Batcher::new(backend, Arc::new(tokenizer), opts);
    let stats = batcher.stats();
    let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
    let worker = std::thread::spawn(move || batcher.run(jobs_rx));
    let (tx, rx) = mpsc::channel();
    let submit = |id: usize, req: GenerateRequest, hang_up_after: Option<usize>| {
        let sink = TestSink {
            tx: tx.clone(),
            id,
            hang_up_after,
            tokens: 0,
        };
        jobs_tx.send(Job::new(req, Box::new(sink))).unwrap();
    };
    // A client that hangs up after 2 tokens, then the real requests, one too long.
    submit(99, request(prompts[2].clone(), 50), Some(2));
    for (i, p) in prompts.iter().enumerate() {
        submit(i, request(p.clone(), 12), None);
        if i == 1 {
            std::thread::sleep(std::time::Duration::from_millis(30));
        }
    }
    submit(7, request(vec![5; 600], 4), None);
    drop(jobs_tx);
    worker.join().unwrap();
    drop(tx);

    let mut text = vec![String::new(); prompts.len()];
    let mut done = vec![None; prompts.len()];
    let mut failed = Vec::new();
    for (id, ev) in rx.iter() {
        match (id, ev) {
            (99, _) => {}
            (7, Event::Failed(e)) => failed.push(e.to_string()),
            (i, Event::Token { text: t, .. }) => text[i].push_str(&t),
            (i, Event::Done(g)) => done[i] = Some(g),
            (i, Event::Failed(e)) => panic!("request {i} failed: {e}"),
        }
    }
    for (i, w) in want.iter().enumerate() {
        assert_eq!(
            w.token_ids.len(),
            12,
            "request {i} runs to max_tokens alone"
        );
        let got = done[i]
            .as_ref()
            .unwrap_or_else(|| panic!("request {i} lost"));
        assert_eq!(got.token_ids, w.token_ids, "request {i} tokens");
        assert_eq!(got.text, w.text, "request {i} text");
        assert_eq!(text[i], w.text, "request {i} streamed text");
        assert_eq!(got.finish, w.finish, "request {i} finish");
        assert_eq!(got.logprobs.len(), w.logprobs.len(), "request {i} logprobs");
        for (a, b) in got.logprobs.iter().zip(&w.logprobs) {
            assert!(
                (a.0 - b.0).abs() < 1e-3,
                "request {i} logprob {} vs {}",
                a.0,
                b.0
            );
        }
    }
    assert_eq!(failed.len(), 1);
    assert!(failed[0].contains("600 tokens"), "{}", failed[0]);
    assert_eq!(
        stats.completed.load(Ordering::Relaxed),
        prompts.len() as u64
    );
    assert_eq!(stats.cancelled.load(Ordering::Relaxed), 1);
    assert_eq!(stats.failed.load(Ordering::Relaxed), 1);
    assert_eq!(stats.active.load(Ordering::Relaxed), 0);
}

/// Allows one fixed token sequence, then nothing more.
struct Script {
    want: Vec<u32>,
    at: usize,
}

impl weft_model::TokenConstraint for Script {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        let keep = self.want[self.at] as usize;
        for (i, l) in logits.iter_mut().enumerate() {
            if i != keep {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }
    fn accept(&mut self, token: u32) -> Result<(), String> {
        if token != self.want[self.at] {
            return Err(format!("token {token} was not allowed"));
        }
        self.at += 1;
        Ok(())
    }
    fn finished(&self) -> bool {
        self.at == self.want.len()
    }
}

#[test]
fn a_rule_holds_its_sequence_and_leaves_its_neighbours_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    synthetic_model(&SyntheticSpec::small(Arch::Llama, GgmlType::F32))
        .write_file(&path)
        .unwrap();
    let prompt: Vec<u32> = (0..20).map(|i| 4 + (i * 13 % 300) as u32).collect();
    let mut alone = Engine::load(&path, 2, 256, &mut |_, _| {}).unwrap();
    let free = alone
        .generate(&request(prompt.clone(), 8), &mut |_| {})
        .unwrap();
    drop(alone);
    // Tokens the model would not pick greedily.
    let scripted: Vec<u32> = free
        .token_ids
        .iter()
        .map(|&t| 300 + (t % 100))
        .take(5)
        .collect();

    let engine = Engine::load(&path, 2, 256, &mut |_, _| {}).unwrap();
    let (backend, tokenizer) = engine.into_batch(2, 256);
    let opts = BatchOptions {
        max_seqs: 2,
        prefill_chunk: 16,
    };
    let batcher = Batcher::new(backend, Arc::new(tokenizer), opts);
    let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
    let worker = std::thread::spawn(move || batcher.run(jobs_rx));
    let (tx, rx) = mpsc::channel();
    for id in 0..2 {
        let sink = TestSink {
            tx: tx.clone(),
            id,
            hang_up_after: None,
            tokens: 0,
        };
        let mut job = Job::new(request(prompt.clone(), 8), Box::new(sink));
        if id == 1 {
            job.constraint = Some(Box::new(Script {
                want: scripted.clone(),
                at: 0,
            }));
        }
        jobs_tx.send(job).unwrap();
    }
    drop(jobs_tx);
    worker.join().unwrap();
    drop(tx);
    let mut done = [None, None];
    for (id, ev) in rx.iter() {
        match ev {
            Event::Done(g) => done[id] = Some(g),
            Event::Failed(e) => panic!("request {id} failed: {e}"),
            Event::Token { .. } => {}
        }
    }
    let [Some(plain), Some(ruled)] = done else {
        panic!("a request was lost");
    };
    assert_eq!(
        plain.token_ids, free.token_ids,
        "the unconstrained neighbour"
    );
    // The rule's tokens, ended as a stop when the rule was complete (before max_tokens).
    assert_eq!(ruled.token_ids, scripted);
    assert_eq!(ruled.finish, weft_model::FinishReason::Stop);
    // Logprobs are the model's own, read before the mask: finite and below zero.
    assert!(ruled
        .logprobs
        .iter()
        .all(|(l, _)| l.is_finite() && *l < 0.0));
}
