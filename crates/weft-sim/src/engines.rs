//! Engines as the simulator knows them: what each adds to the links and kernels (weft-plan's
//! `EngineCosts`), where its coordinator sits, and what its cache holds per value. The
//! constants come from single-node measurements and from latencies stated on their own,
//! never from the multi-node results the simulator is checked against (docs/simulate.md
//! derives each).

use serde::Serialize;
use weft_plan::engine::WEFT;
use weft_plan::{AllReduce, EngineCosts, Handoff};

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Engine {
    pub name: &'static str,
    pub costs: EngineCosts,
    /// The coordinator is a process of its own whose links to every node cross the link
    /// (weft); otherwise it is the first node's host.
    pub coordinator_apart: bool,
    /// Bytes per cached key/value value.
    pub kv_bytes: usize,
}

/// Kernel dispatch per layer and token on Apple GPUs, from two single-node llama.cpp
/// figures on one M3 Ultra (Llama 3.2 3B Q4_K_M 171 tok/s, DeepSeek R1 Q4_K_M 20.2
/// tok/s): 1.95 GB over 28 layers and 22.4 GB over 61 layers solve to 494 GB/s and 68 µs.
const APPLE_GPU_LAYER_US: f64 = 68.0;

/// llama.cpp's RPC host, per token and remote layer: this machine's two rpc-servers on
/// loopback decoded Gemma 3 270M at 38.9 tok/s against 47.2 alone (shared/reference),
/// 4.52 ms a token, less 3 round trips of 76 µs to each of 2 servers, over 18 layers.
const RPC_REMOTE_LAYER_US: f64 = 226.0;

/// exo's all-reduce on top of its messages: the GPU queue waits for the exchange. One
/// exchange "under 50 µs" over RDMA (stated for exo's Thunderbolt 5 RDMA), less the
/// link's 4.4 µs and a message.
const MLX_SYNC_US: f64 = 44.6;

pub const CATALOG: &[Engine] = &[
    Engine {
        name: "weft",
        costs: WEFT,
        coordinator_apart: true,
        kv_bytes: 4,
    },
    Engine {
        name: "llama.cpp",
        costs: EngineCosts {
            handoff: Handoff::Star { round_trips: 3.0 },
            remote_layer_us: RPC_REMOTE_LAYER_US,
            layer_overhead_us: APPLE_GPU_LAYER_US,
            // RPC sends whole f32 tensors.
            segment_bytes: 0.0,
            ring_from_bytes: 0.0,
            ..WEFT
        },
        coordinator_apart: false,
        kv_bytes: 2,
    },
    Engine {
        name: "exo",
        costs: EngineCosts {
            // MLX's JACCL (December 2025): every rank posts its whole vector to every
            // peer, 4 KiB frames two in flight, bf16, whatever the size.
            allreduce: AllReduce::Direct,
            sync_overhead_us: MLX_SYNC_US,
            layer_overhead_us: APPLE_GPU_LAYER_US,
            wire_bytes: 2.0,
            segment_bytes: 8192.0,
            ring_from_bytes: 0.0,
            // exo's sharding strategies leave lm_head whole on every rank.
            head_split: false,
            ..WEFT
        },
        coordinator_apart: false,
        kv_bytes: 2,
    },
];

pub fn names() -> Vec<&'static str> {
    CATALOG.iter().map(|e| e.name).collect()
}

pub fn named(name: &str) -> Result<Engine, String> {
    CATALOG
        .iter()
        .find(|e| e.name.eq_ignore_ascii_case(name))
        .copied()
        .ok_or_else(|| {
            format!(
                "no engine named {name:?}: the known ones are {}",
                names().join(", ")
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_apple_layer_floor_solves_both_single_node_figures() {
        // t = bytes / bandwidth + layers x floor, for both llama.cpp figures.
        let bw = 494e9;
        for (gb, layers, tok_s) in [(1.95, 28.0, 171.0), (22.4, 61.0, 20.21)] {
            let t = gb * 1e9 / bw + layers * APPLE_GPU_LAYER_US * 1e-6;
            assert!((t * tok_s - 1.0).abs() < 0.02, "{gb} GB: {}", 1.0 / t);
        }
        // And the RPC figure: 4.52 ms a token over 18 remote layers and 6 round trips.
        let t = 18.0 * RPC_REMOTE_LAYER_US + 6.0 * 76.0;
        assert!(
            (t / 1e3 - (1.0 / 38.9 - 1.0 / 47.2) * 1e3).abs() < 0.05,
            "{t}"
        );
        assert!(named("vllm").unwrap_err().contains("exo"));
    }
}
