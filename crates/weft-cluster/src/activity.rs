//! What each node is doing, as its heartbeats tell the coordinator: time spent computing
//! and waiting on the network in steps, steps run, and its shard's loading progress. A
//! node keeps `WorkCounters` (atomics its stepper and loader bump: nothing allocated per
//! step); a coordinator that wants to watch keeps an `ActivityBoard`, per node address,
//! fed by the beats and by the end of each control link.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// A node's work since it started, as one beat carries it (cumulative, so a reader takes
/// differences between two beats for rates; a lost beat loses nothing). A field a peer
/// leaves out reads as 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct NodeWork {
    /// µs since the node started, on its own clock: the span the other counters grew in
    /// between two beats.
    pub uptime_us: u64,
    /// Microseconds of steps spent computing, and waiting in collectives or hand-offs.
    pub compute_us: u64,
    pub network_us: u64,
    pub steps: u64,
    /// While a shard loads: layers (and the head) done, of how many.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loading: Option<[u32; 2]>,
    /// While its shard's bytes are fetched from other machines: bytes done, of how many.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fetching: Option<[u64; 2]>,
}

/// The node's side: updated by the stepper and the loader, read by the beat thread.
#[derive(Debug)]
pub struct WorkCounters {
    started: Instant,
    compute_us: AtomicU64,
    network_us: AtomicU64,
    steps: AtomicU64,
    loading: AtomicBool,
    load_done: AtomicU32,
    load_total: AtomicU32,
    fetching: AtomicBool,
    fetch_done: AtomicU64,
    fetch_total: AtomicU64,
}

impl Default for WorkCounters {
    fn default() -> Self {
        WorkCounters {
            started: Instant::now(),
            compute_us: AtomicU64::new(0),
            network_us: AtomicU64::new(0),
            steps: AtomicU64::new(0),
            loading: AtomicBool::new(false),
            load_done: AtomicU32::new(0),
            load_total: AtomicU32::new(0),
            fetching: AtomicBool::new(false),
            fetch_done: AtomicU64::new(0),
            fetch_total: AtomicU64::new(0),
        }
    }
}

impl WorkCounters {
    /// One step done: `compute` and `network` seconds of it.
    pub fn step(&self, compute: f64, network: f64) {
        let us = |s: f64| (s.max(0.0) * 1e6) as u64;
        self.compute_us.fetch_add(us(compute), Ordering::Relaxed);
        self.network_us.fetch_add(us(network), Ordering::Relaxed);
        self.steps.fetch_add(1, Ordering::Relaxed);
    }

    /// A shard is loading: `done` of `total` parts so far.
    pub fn load_progress(&self, done: usize, total: usize) {
        let clamp = |n: usize| n.min(u32::MAX as usize) as u32;
        self.load_done.store(clamp(done), Ordering::Relaxed);
        self.load_total.store(clamp(total), Ordering::Relaxed);
        self.loading.store(true, Ordering::Relaxed);
    }

    /// The shard's missing bytes are being fetched: `done` of `total` so far.
    pub fn fetch_progress(&self, done: u64, total: u64) {
        self.fetch_done.store(done, Ordering::Relaxed);
        self.fetch_total.store(total, Ordering::Relaxed);
        self.fetching.store(true, Ordering::Relaxed);
    }

    /// The fetch ended (the load goes on).
    pub fn fetch_ended(&self) {
        self.fetching.store(false, Ordering::Relaxed);
    }

    /// The load ended (loaded or failed).
    pub fn load_ended(&self) {
        self.loading.store(false, Ordering::Relaxed);
        self.fetching.store(false, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> NodeWork {
        NodeWork {
            uptime_us: self.started.elapsed().as_micros() as u64,
            compute_us: self.compute_us.load(Ordering::Relaxed),
            network_us: self.network_us.load(Ordering::Relaxed),
            steps: self.steps.load(Ordering::Relaxed),
            loading: self.loading.load(Ordering::Relaxed).then(|| {
                [
                    self.load_done.load(Ordering::Relaxed),
                    self.load_total.load(Ordering::Relaxed),
                ]
            }),
            fetching: self.fetching.load(Ordering::Relaxed).then(|| {
                [
                    self.fetch_done.load(Ordering::Relaxed),
                    self.fetch_total.load(Ordering::Relaxed),
                ]
            }),
        }
    }
}

/// A node as the coordinator last heard it.
#[derive(Clone, Copy, Debug)]
pub struct NodeActivity {
    /// The work its last beat reported (None: a node that reports none).
    pub work: Option<NodeWork>,
    pub heard: Instant,
    /// Its control link ended after it was last heard.
    pub ended: bool,
}

/// What a watching coordinator knows of each node it has a control link to, by address.
#[derive(Debug, Default)]
pub struct ActivityBoard {
    nodes: Mutex<HashMap<String, NodeActivity>>,
}

/// A node's state as a watcher shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeState {
    Ready,
    Loading,
    Lost,
}

impl NodeState {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Ready => "ready",
            NodeState::Loading => "loading",
            NodeState::Lost => "lost",
        }
    }
}

impl ActivityBoard {
    /// A beat from `addr`, with what it reported.
    pub fn heard(&self, addr: &str, work: Option<NodeWork>) {
        let now = NodeActivity {
            work,
            heard: Instant::now(),
            ended: false,
        };
        if let Ok(mut m) = self.nodes.lock() {
            // Four times a second per node: the address is copied only the first time.
            match m.get_mut(addr) {
                Some(a) => *a = now,
                None => {
                    m.insert(addr.to_string(), now);
                }
            }
        }
    }

    /// `addr` said it is ready: its last beat's loading progress is over (the next beat,
    /// up to a beat later, would say so too).
    pub fn loaded(&self, addr: &str) {
        if let Ok(mut m) = self.nodes.lock() {
            if let Some(w) = m.get_mut(addr).and_then(|a| a.work.as_mut()) {
                w.loading = None;
                w.fetching = None;
            }
        }
    }

    /// `addr`'s control link ended.
    pub fn ended(&self, addr: &str) {
        if let Ok(mut m) = self.nodes.lock() {
            if let Some(a) = m.get_mut(addr) {
                a.ended = true;
            }
        }
    }

    pub fn get(&self, addr: &str) -> Option<NodeActivity> {
        self.nodes.lock().ok()?.get(addr).copied()
    }

    /// The nodes heard within `silence` whose links are open, with their state and work,
    /// by address.
    pub fn alive(&self, silence: Duration) -> Vec<(String, NodeState, Option<NodeWork>)> {
        let Ok(m) = self.nodes.lock() else {
            return Vec::new();
        };
        let mut out: Vec<(String, NodeState, Option<NodeWork>)> = m
            .iter()
            .filter(|(_, a)| !a.ended && a.heard.elapsed() <= silence)
            .map(|(addr, a)| {
                let loading = a
                    .work
                    .is_some_and(|w| w.loading.is_some() || w.fetching.is_some());
                let state = if loading {
                    NodeState::Loading
                } else {
                    NodeState::Ready
                };
                (addr.clone(), state, a.work)
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// `addr`'s state: lost once its link ended or it has been silent for `silence`
    /// (a node beats four times a second, even while it loads or computes).
    pub fn state(&self, addr: &str, silence: Duration) -> NodeState {
        match self.get(addr) {
            None => NodeState::Lost,
            Some(a) if a.ended || a.heard.elapsed() > silence => NodeState::Lost,
            Some(a)
                if a.work
                    .is_some_and(|w| w.loading.is_some() || w.fetching.is_some()) =>
            {
                NodeState::Loading
            }
            Some(_) => NodeState::Ready,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_add_up_and_tell_loading() {
        let c = WorkCounters::default();
        c.step(0.5, 0.25);
        c.step(0.000_001, 0.0);
        c.load_progress(3, 19);
        std::thread::sleep(Duration::from_millis(2));
        let w = c.snapshot();
        assert!(w.uptime_us >= 2_000, "{w:?}");
        assert_eq!(w.compute_us, 500_001);
        assert_eq!(w.network_us, 250_000);
        assert_eq!(w.steps, 2);
        assert_eq!(w.loading, Some([3, 19]));
        c.load_ended();
        assert_eq!(c.snapshot().loading, None);
        // What a beat carries survives its JSON form.
        let back: NodeWork = serde_json::from_str(&serde_json::to_string(&w).unwrap()).unwrap();
        assert_eq!(back, w);
        // A peer that sends fewer fields (an older or newer node) still parses.
        let sparse: NodeWork = serde_json::from_str(r#"{"steps": 7}"#).unwrap();
        assert_eq!(
            (sparse.steps, sparse.compute_us, sparse.loading),
            (7, 0, None)
        );
    }

    #[test]
    fn the_board_tells_ready_loading_and_lost() {
        let b = ActivityBoard::default();
        let long = Duration::from_secs(60);
        assert_eq!(b.state("a:1", long), NodeState::Lost, "never heard");
        let loading = NodeWork {
            loading: Some([1, 4]),
            ..NodeWork::default()
        };
        b.heard("a:1", Some(loading));
        assert_eq!(b.state("a:1", long), NodeState::Loading);
        b.heard("b:2", Some(NodeWork::default()));
        assert_eq!(
            b.alive(long),
            vec![
                ("a:1".to_string(), NodeState::Loading, Some(loading)),
                (
                    "b:2".to_string(),
                    NodeState::Ready,
                    Some(NodeWork::default())
                )
            ]
        );
        b.loaded("a:1");
        assert_eq!(
            b.state("a:1", long),
            NodeState::Ready,
            "it said it is ready"
        );
        b.heard("a:1", Some(NodeWork::default()));
        assert_eq!(b.state("a:1", long), NodeState::Ready);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(b.state("a:1", Duration::from_millis(5)), NodeState::Lost);
        b.ended("a:1");
        assert_eq!(b.state("a:1", long), NodeState::Lost, "its link ended");
        b.heard("a:1", None);
        assert_eq!(b.state("a:1", long), NodeState::Ready, "a new link beats");
    }
}
