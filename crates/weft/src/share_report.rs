//! One line per node that fetched its shard: how much, from whom, how fast.

use weft_model::memory::human_bytes;
use weft_share::FetchReport;

pub fn line(addr: &str, f: &FetchReport) -> String {
    let rate = if f.seconds > 0.0 {
        f.fetched_bytes as f64 / f.seconds / 1e6
    } else {
        0.0
    };
    let from: Vec<String> = f
        .sources
        .iter()
        .filter(|s| s.bytes > 0 || s.bad > 0)
        .map(|s| {
            let bad = if s.bad > 0 {
                format!(" ({} bad pieces refetched)", s.bad)
            } else {
                String::new()
            };
            format!("{} from {}{bad}", human_bytes(s.bytes as u128), s.name)
        })
        .collect();
    format!(
        "node {addr}: shard {} ({} of {} pieces cached already), fetched {} in {:.2} s ({rate:.0} MB/s){}{}",
        human_bytes(f.shard_bytes as u128),
        f.already,
        f.wanted,
        human_bytes(f.fetched_bytes as u128),
        f.seconds,
        if from.is_empty() { "" } else { ": " },
        from.join(", ")
    )
}
