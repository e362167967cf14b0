//! Links as the simulator knows them: one-way latency of a small message, bandwidth, and
//! the transport's software cost per message. Built-in profiles for the links people
//! join machines with (sources in docs/simulate.md), more from a file.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    pub name: String,
    /// One-way time of a small message, µs (half the ping round trip).
    pub latency_us: f64,
    pub bytes_per_s: f64,
    /// Software cost of sending one message (the transport's stack), µs.
    #[serde(default)]
    pub per_message_us: f64,
}

/// (name, one-way latency µs, bandwidth GB/s, per message µs).
const BUILT_IN: &[(&str, f64, f64, f64)] = &[
    // Ping over a direct Thunderbolt 5 bridge: 0.575 ms round trip; iperf3 52-64 Gbit/s.
    ("tb5-tcp", 287.5, 7.0, 10.0),
    // perftest ib_send_lat 4.15-4.64 µs one way; ib_send_bw about 75 Gbit/s.
    ("tb5-rdma", 4.4, 9.4, 1.0),
    // Kernel TCP ping-pong, half the round trip.
    ("1gbe", 30.0, 0.118, 10.0),
    ("10gbe", 20.0, 1.18, 5.0),
    ("100gbe-rdma", 1.5, 11.8, 0.5),
    // Wi-Fi 6: round trips of 2-10 ms; about 600 Mbit/s of goodput.
    ("wifi", 2500.0, 0.075, 20.0),
    // Processes on one machine over shared-memory rings (weft's local transport):
    // measured here, a 2,560-byte all-reduce of two ranks takes 1.2 µs.
    ("shm", 0.6, 10.0, 0.3),
];

pub fn names() -> Vec<&'static str> {
    BUILT_IN.iter().map(|b| b.0).collect()
}

/// A built-in link by name.
pub fn named(name: &str) -> Result<Link, String> {
    let (name, latency_us, gb_s, per_message_us) = BUILT_IN
        .iter()
        .find(|b| b.0.eq_ignore_ascii_case(name))
        .ok_or_else(|| {
            format!(
                "no link profile named {name:?}: the built-in ones are {} (or give --profiles FILE)",
                names().join(", ")
            )
        })?;
    Ok(Link {
        name: name.to_string(),
        latency_us: *latency_us,
        bytes_per_s: gb_s * 1e9,
        per_message_us: *per_message_us,
    })
}

impl Link {
    pub fn validate(&self) -> Result<(), String> {
        let ok = |v: f64| v.is_finite() && v >= 0.0;
        if !(ok(self.latency_us) && ok(self.per_message_us)) {
            return Err(format!(
                "link {}: latency_us and per_message_us must be >= 0",
                self.name
            ));
        }
        if !(self.bytes_per_s.is_finite() && self.bytes_per_s > 0.0) {
            return Err(format!("link {}: bytes_per_s must be > 0", self.name));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_by_name_and_their_checks() {
        let l = named("TB5-RDMA").unwrap();
        assert_eq!(l.latency_us, 4.4);
        assert!(l.validate().is_ok());
        assert!(named("carrier-pigeon").unwrap_err().contains("tb5-tcp"));
        let bad = Link {
            bytes_per_s: 0.0,
            ..l
        };
        assert!(bad.validate().unwrap_err().contains("bytes_per_s"));
    }
}
