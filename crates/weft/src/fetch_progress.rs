//! The coordinator's terminal while nodes fetch their shards: one progress bar per node
//! (bytes, rate, time left) from the fetch progress its heartbeats carry; hidden when
//! stderr is not a terminal.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use weft_cluster::activity::ActivityBoard;

/// Draws the bars until dropped.
pub struct FetchBars {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl FetchBars {
    pub fn start(board: Arc<ActivityBoard>, peers: Vec<String>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("weft-fetch-bars".into())
            .spawn(move || draw(&board, &peers, &s))
            .ok();
        FetchBars { stop, thread }
    }
}

impl Drop for FetchBars {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn draw(board: &ActivityBoard, peers: &[String], stop: &AtomicBool) {
    let multi = MultiProgress::new();
    let style = ProgressStyle::with_template(
        "fetching {prefix}'s shard [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} {eta} left",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    let mut bars: HashMap<&str, ProgressBar> = HashMap::new();
    while !stop.load(Ordering::Relaxed) {
        for addr in peers {
            let Some([done, total]) = board.get(addr).and_then(|a| a.work?.fetching) else {
                continue;
            };
            let bar = bars.entry(addr).or_insert_with(|| {
                let b = multi.add(ProgressBar::new(total));
                b.set_style(style.clone());
                b.set_prefix(addr.clone());
                b
            });
            bar.set_length(total);
            bar.set_position(done);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    for b in bars.values() {
        b.finish_and_clear();
    }
}
