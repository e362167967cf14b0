//! Machines as the simulator knows them: memory, memory bandwidth, compute throughput and
//! the share of each an engine reaches (the efficiency factors). Built-in profiles for
//! the machines people cluster, "this" machine from weft's own measurements, and more
//! from a file.

use serde::{Deserialize, Serialize};
use weft_plan::NodeProfile;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hardware {
    pub name: String,
    /// Memory a node offers for weights and caches, bytes.
    pub memory_bytes: f64,
    /// Peak memory read bandwidth, bytes/s.
    pub bandwidth_bytes_per_s: f64,
    /// Peak dense matrix throughput at the precision prefill runs in, operations/s.
    pub compute_ops_per_s: f64,
    /// The share of the bandwidth decode reaches (weights streamed / peak).
    #[serde(default = "default_decode_efficiency")]
    pub decode_efficiency: f64,
    /// The share of the compute peak prefill reaches.
    #[serde(default = "default_prefill_efficiency")]
    pub prefill_efficiency: f64,
    /// The share of its decode rate a node keeps while every node of a simulated cluster
    /// shares this one machine (its memory bandwidth and cores) and computes at once (0:
    /// nodes are machines of their own). A share, not a rate, so that calibrating the
    /// single-node rate carries over to the shared one.
    #[serde(default)]
    pub shared_decode_share: f64,
    /// The share of its prefill rate a node keeps while every node of the cluster shares
    /// this one machine and computes at once (0: not measured, as alone).
    #[serde(default)]
    pub shared_prefill_share: f64,
}

fn default_decode_efficiency() -> f64 {
    0.6
}

fn default_prefill_efficiency() -> f64 {
    0.4
}

const GB: f64 = 1e9;
const TERA: f64 = 1e12;

/// Built-in machines: (name, memory GB, bandwidth GB/s, compute TFLOPS FP16).
/// Sources in docs/simulate.md; memory is the largest configuration sold.
const BUILT_IN: &[(&str, f64, f64, f64)] = &[
    ("m3-ultra", 512.0, 819.2, 28.0),
    ("m4-max", 128.0, 546.0, 17.0),
    ("dgx-spark", 128.0, 273.0, 100.0),
    ("ryzen-ai-max-395", 128.0, 256.0, 59.0),
    ("raspberry-pi-5", 16.0, 17.1, 0.15),
];

/// The names `--hardware` takes ("this" is measured by the caller).
pub fn names() -> Vec<&'static str> {
    BUILT_IN
        .iter()
        .map(|b| b.0)
        .chain(std::iter::once("this"))
        .collect()
}

/// A built-in machine by name.
pub fn named(name: &str) -> Result<Hardware, String> {
    let (name, mem, bw, tflops) = BUILT_IN
        .iter()
        .find(|b| b.0.eq_ignore_ascii_case(name))
        .ok_or_else(|| {
            format!(
                "no hardware profile named {name:?}: the built-in ones are {} (or give --profiles FILE)",
                names().join(", ")
            )
        })?;
    Ok(Hardware {
        name: name.to_string(),
        // The OS and runtime keep some: a node offers nine tenths.
        memory_bytes: mem * GB * 0.9,
        bandwidth_bytes_per_s: bw * GB,
        compute_ops_per_s: tflops * TERA,
        decode_efficiency: default_decode_efficiency(),
        prefill_efficiency: default_prefill_efficiency(),
        shared_decode_share: 0.0,
        shared_prefill_share: 0.0,
    })
}

impl Hardware {
    /// A machine from what weft measured on it: its peak read bandwidth and integer-dot
    /// peak (operations/s), its kernels' decode and prefill rates over the model's weights
    /// (bytes/s and weight bytes × tokens/s, for a model of `bits` per weight), and the
    /// memory it offers. The efficiencies are what the kernels reach of the peaks; the
    /// shares kept while nodes share the machine are set apart, when measured.
    pub fn measured(
        name: &str,
        memory_bytes: f64,
        peaks: (f64, f64),
        rates: (f64, f64),
        bits: f64,
    ) -> Hardware {
        let (peak_bw, peak_ops) = peaks;
        let (decode, prefill) = rates;
        let prefill_ops = prefill * 2.0 * 8.0 / bits.max(0.1);
        // A peak below what the kernels reach was a slow probe: the kernels' figure stands.
        let bandwidth = peak_bw.max(decode);
        let compute = peak_ops.max(prefill_ops);
        Hardware {
            name: name.into(),
            memory_bytes,
            bandwidth_bytes_per_s: bandwidth,
            compute_ops_per_s: compute,
            decode_efficiency: decode / bandwidth,
            prefill_efficiency: prefill_ops / compute,
            shared_decode_share: 0.0,
            shared_prefill_share: 0.0,
        }
    }

    /// Checks the figures; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        for (what, v) in [
            ("memory_bytes", self.memory_bytes),
            ("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s),
            ("compute_ops_per_s", self.compute_ops_per_s),
            ("decode_efficiency", self.decode_efficiency),
            ("prefill_efficiency", self.prefill_efficiency),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!(
                    "hardware {}: {what} must be > 0, not {v}",
                    self.name
                ));
            }
        }
        if self.decode_efficiency > 1.0 || self.prefill_efficiency > 1.0 {
            return Err(format!(
                "hardware {}: an efficiency is a share of the peak, at most 1",
                self.name
            ));
        }
        for (what, v) in [
            ("shared_decode_share", self.shared_decode_share),
            ("shared_prefill_share", self.shared_prefill_share),
        ] {
            if !(v.is_finite() && (0.0..=1.0).contains(&v)) {
                return Err(format!(
                    "hardware {}: {what} is a share kept while sharing, 0 to 1, not {v}",
                    self.name
                ));
            }
        }
        Ok(())
    }

    /// The planner's node for a model of `bits` per weight: decode streams at the bandwidth it reaches;
    /// prefill does two operations per weight per token, a weight being
    /// bytes × 8 / bits of the model's mean bits.
    pub fn node(&self, bits: f64, index: usize) -> NodeProfile {
        let weights_per_byte = 8.0 / bits.max(0.1);
        let prefill = self.compute_ops_per_s * self.prefill_efficiency / (2.0 * weights_per_byte);
        NodeProfile {
            name: format!("{}-{index}", self.name),
            memory_bytes: self.memory_bytes as u64,
            decode_bytes_per_s: self.bandwidth_bytes_per_s * self.decode_efficiency,
            prefill_bytes_per_s: prefill,
            loaded_decode_bytes_per_s: self.bandwidth_bytes_per_s
                * self.decode_efficiency
                * self.shared_decode_share.clamp(0.0, 1.0),
            loaded_prefill_bytes_per_s: prefill * self.shared_prefill_share.clamp(0.0, 1.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_in_machines_have_their_bandwidth_and_bad_figures_are_named() {
        let m = named("M3-Ultra").unwrap();
        assert_eq!(m.bandwidth_bytes_per_s, 819.2e9);
        assert!(m.validate().is_ok());
        let e = named("cray-1").unwrap_err();
        assert!(e.contains("raspberry-pi-5") && e.contains("this"), "{e}");
        let bad = Hardware {
            decode_efficiency: 1.5,
            ..m.clone()
        };
        assert!(bad.validate().unwrap_err().contains("at most 1"));
        let bad = Hardware {
            shared_decode_share: 1.2,
            ..m.clone()
        };
        assert!(bad.validate().unwrap_err().contains("shared_decode_share"));
        let bad = Hardware {
            memory_bytes: f64::NAN,
            ..m.clone()
        };
        assert!(bad.validate().unwrap_err().contains("memory_bytes"));
        // Sharing is a share of the calibrated rate: calibrating the single-node rate
        // down carries the contention with it.
        let mut shared = Hardware::measured("t", 1e9, (10e9, 1e12), (5e9, 1e9), 4.5);
        shared.shared_decode_share = 0.8;
        shared.decode_efficiency *= 0.5;
        let n = shared.node(4.5, 0);
        assert!((n.loaded_decode_bytes_per_s / n.decode_bytes_per_s - 0.8).abs() < 1e-9);
    }
}
