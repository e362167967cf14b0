//! Link probes: round-trip time and bandwidth between every pair of ranks, measured one
//! pair at a time so pairs do not disturb each other; every rank gets the whole matrix.

use std::time::Instant;

use serde::Serialize;

use crate::error::CommError;
use crate::group::Group;

#[derive(Clone, Debug, Serialize)]
pub struct LinkMatrix {
    /// Median round trip of a 64-byte message, µs; 0 on the diagonal.
    pub rtt_us: Vec<Vec<f64>>,
    /// One-way bandwidth of a large transfer, GB/s; 0 on the diagonal.
    pub bandwidth_gb_s: Vec<Vec<f64>>,
    /// The transport of each link ("tcp", "shm", "in-process"; "" on the diagonal).
    pub transport: Vec<Vec<String>>,
}

impl Group {
    /// Measures every pair: `pings` round trips of 64 bytes, then `bulk` bytes one way.
    pub fn probe_links(&mut self, pings: usize, bulk: usize) -> Result<LinkMatrix, CommError> {
        let (me, n) = (self.rank(), self.size());
        let mut row = vec![0f32; 2 * n];
        let mut small = [0u8; 64];
        let mut big = vec![0u8; bulk.max(1)];
        let mut ack = [0u8; 1];
        for i in 0..n {
            for j in i + 1..n {
                if me == i {
                    let mut rtts = Vec::with_capacity(pings);
                    for _ in 0..pings {
                        let t = Instant::now();
                        self.send(j, &small)?;
                        self.recv(j, &mut small)?;
                        rtts.push(t.elapsed().as_secs_f64() * 1e6);
                    }
                    rtts.sort_by(f64::total_cmp);
                    row[j] = rtts.get(rtts.len() / 2).copied().unwrap_or(0.0) as f32;
                    let t = Instant::now();
                    self.send(j, &big)?;
                    self.recv(j, &mut ack)?;
                    row[n + j] = (big.len() as f64 / t.elapsed().as_secs_f64() / 1e9) as f32;
                } else if me == j {
                    for _ in 0..pings {
                        self.recv(i, &mut small)?;
                        self.send(i, &small)?;
                    }
                    self.recv(i, &mut big)?;
                    self.send(i, &ack)?;
                }
            }
        }
        let mut all = vec![0f32; 2 * n * n];
        let counts = vec![2 * n; n];
        self.all_gather(&row, &counts, &mut all)?;
        let mut m = LinkMatrix {
            rtt_us: vec![vec![0.0; n]; n],
            bandwidth_gb_s: vec![vec![0.0; n]; n],
            transport: vec![vec![String::new(); n]; n],
        };
        for i in 0..n {
            for j in i + 1..n {
                let (rtt, bw) = (all[i * 2 * n + j] as f64, all[i * 2 * n + n + j] as f64);
                m.rtt_us[i][j] = rtt;
                m.rtt_us[j][i] = rtt;
                m.bandwidth_gb_s[i][j] = bw;
                m.bandwidth_gb_s[j][i] = bw;
            }
            if let Some((_, kind)) = self.link_info(i) {
                m.transport[me][i] = kind.to_string();
            }
        }
        Ok(m)
    }
}
