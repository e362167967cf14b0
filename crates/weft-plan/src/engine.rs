//! What an engine adds to the links' and kernels' figures: the transport's software cost
//! per message, the fixed cost of an all-reduce (a GPU engine waits for its queue first),
//! how an all-reduce is scheduled, how pipeline stages hand off (weft passes the hidden
//! state stage to stage; llama.cpp's RPC host drives every remote stage round trip by
//! round trip), what driving a remote layer costs per token, and a per-layer floor that no
//! split shrinks (kernel dispatch). weft's own costs are all measured elsewhere: its
//! defaults add nothing.

use serde::{Deserialize, Serialize};

/// How pipeline stages pass a token on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Handoff {
    /// Stage to stage: one latency and the hidden state's bytes per boundary (weft).
    #[default]
    Chain,
    /// The host holds the first stage and drives each other stage over `round_trips`
    /// round trips per token (llama.cpp RPC: set the input, compute the graph, get the
    /// output), the hidden state going out and coming back.
    Star { round_trips: f64 },
}

/// How an all-reduce of `w` ranks is scheduled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AllReduce {
    /// Every rank sends its whole vector to every other at once: one latency, and (w - 1)
    /// messages each way (weft's collectives; MLX's for small vectors).
    #[default]
    Direct,
    /// A ring: 2 (w - 1) steps, each a latency and a message of 1/w of the vector.
    Ring,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineCosts {
    pub handoff: Handoff,
    pub allreduce: AllReduce,
    /// The transport's software cost of sending one message, µs.
    pub per_message_us: f64,
    /// Fixed cost of every all-reduce on top of its messages, µs.
    pub sync_overhead_us: f64,
    /// Per token and per layer a remote stage holds: what driving it costs the host (a
    /// graph sent and rebuilt every token), µs.
    pub remote_layer_us: f64,
    /// Per token and layer, time no split shrinks (kernel dispatch), µs.
    pub layer_overhead_us: f64,
    /// Bytes of one hidden-state value on the wire (weft: f32).
    pub wire_bytes: f64,
    /// An all-reduce moves its vector in segments of this many bytes, one latency each
    /// (0: whole). weft cuts frames at 64 KiB so that two ranks sending to each other at
    /// once never both block on a full socket buffer.
    pub segment_bytes: f64,
    /// Vectors above this many bytes take the ring whatever `allreduce` says (0: never).
    pub ring_from_bytes: f64,
    /// Tensor parallelism splits the output head's vocabulary rows (weft); otherwise
    /// every rank of the last stage reads the whole head.
    pub head_split: bool,
}

/// weft's own: stage-to-stage hand-offs, direct all-reduces up to 256 KiB and a ring
/// above (weft-comm's collectives), 64 KiB segments, f32 on the wire, nothing added to
/// the links.
pub const WEFT: EngineCosts = EngineCosts {
    handoff: Handoff::Chain,
    allreduce: AllReduce::Direct,
    per_message_us: 0.0,
    sync_overhead_us: 0.0,
    remote_layer_us: 0.0,
    layer_overhead_us: 0.0,
    wire_bytes: 4.0,
    segment_bytes: 65536.0,
    ring_from_bytes: 262144.0,
    head_split: true,
};

impl Default for EngineCosts {
    fn default() -> Self {
        WEFT
    }
}

impl EngineCosts {
    /// Segments a message of `bytes` goes in (at least one).
    fn segments(&self, bytes: f64) -> f64 {
        if self.segment_bytes > 0.0 {
            (bytes / self.segment_bytes).ceil().max(1.0)
        } else {
            1.0
        }
    }

    /// Seconds of one all-reduce of `bytes` over `w` ranks whose slowest pair has round
    /// trip `rtt_us` and bandwidth `bytes_per_s`.
    pub fn allreduce_s(&self, w: usize, bytes: f64, rtt_us: f64, bytes_per_s: f64) -> f64 {
        if w < 2 {
            return 0.0;
        }
        let bw = bytes_per_s.max(1.0);
        let latency = rtt_us * 0.5e-6;
        let msg = self.per_message_us * 1e-6;
        let ring = self.allreduce == AllReduce::Ring
            || (self.ring_from_bytes > 0.0 && bytes > self.ring_from_bytes);
        let peers = (w - 1) as f64;
        let link = if ring {
            // 2 (w - 1) steps, each 1/w of the vector in its segments.
            let part = bytes / w as f64;
            2.0 * peers * (self.segments(part) * (latency + msg) + part / bw)
        } else {
            // Each segment round: one latency, a message to every peer.
            let k = self.segments(bytes);
            k * latency + peers * (k * msg + bytes / bw)
        };
        link + self.sync_overhead_us * 1e-6
    }

    /// Seconds to bring `bytes` into a stage of `layers` layers over a link of round trip
    /// `rtt_us` and bandwidth `bytes_per_s`.
    pub fn handoff_s(&self, bytes: f64, rtt_us: f64, bytes_per_s: f64, layers: usize) -> f64 {
        let bw = bytes_per_s.max(1.0);
        let msg = self.per_message_us * 1e-6;
        let link = match self.handoff {
            Handoff::Chain => rtt_us * 0.5e-6 + msg + bytes / bw,
            Handoff::Star { round_trips } => {
                round_trips * (rtt_us * 1e-6 + 2.0 * msg) + 2.0 * bytes / bw
            }
        };
        link + layers as f64 * self.remote_layer_us * 1e-6
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weft_adds_nothing_to_the_links_but_its_segments() {
        let p = EngineCosts::default();
        // Two ranks, 300 µs round trip, 2560 bytes at 1 GB/s: 150 µs + 2.56 µs.
        let t = p.allreduce_s(2, 2560.0, 300.0, 1e9);
        assert!((t - 152.56e-6).abs() < 1e-9, "{t}");
        assert_eq!(p.allreduce_s(1, 2560.0, 300.0, 1e9), 0.0);
        // 200 KB direct: four 64 KiB segments, a latency each.
        let t = p.allreduce_s(2, 200e3, 300.0, 1e9);
        assert!((t - (4.0 * 150e-6 + 200e-6)).abs() < 1e-9, "{t}");
        // 400 KB takes the ring: 2 steps of 200 KB, four segments each.
        let t = p.allreduce_s(2, 400e3, 300.0, 1e9);
        assert!((t - 2.0 * (4.0 * 150e-6 + 200e-6)).abs() < 1e-9, "{t}");
        let h = p.handoff_s(2560.0, 300.0, 1e9, 40);
        assert!((h - 152.56e-6).abs() < 1e-9, "{h}");
    }

    #[test]
    fn a_ring_pays_a_latency_per_step_and_rpc_pays_per_remote_layer() {
        let ring = EngineCosts {
            allreduce: AllReduce::Ring,
            sync_overhead_us: 10.0,
            ..EngineCosts::default()
        };
        assert_eq!(ring.segments(4000.0 / 4.0), 1.0);
        // 4 ranks: 6 steps of 5 µs (a 10 µs round trip) and a quarter vector each.
        let t = ring.allreduce_s(4, 4000.0, 10.0, 1e9);
        assert!((t - (6.0 * (5e-6 + 1e-6) + 10e-6)).abs() < 1e-12, "{t}");
        let direct = EngineCosts {
            per_message_us: 2.0,
            ..EngineCosts::default()
        };
        // 4 ranks: one latency, three messages of 4000 bytes each.
        let t = direct.allreduce_s(4, 4000.0, 10.0, 1e9);
        assert!((t - (5e-6 + 3.0 * 6e-6)).abs() < 1e-12, "{t}");
        let rpc = EngineCosts {
            handoff: Handoff::Star { round_trips: 3.0 },
            remote_layer_us: 200.0,
            ..EngineCosts::default()
        };
        let h = rpc.handoff_s(0.0, 100.0, 1e9, 10);
        assert!((h - (300e-6 + 2e-3)).abs() < 1e-12, "{h}");
    }
}
