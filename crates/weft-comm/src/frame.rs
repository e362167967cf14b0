//! The data frame: a fixed 24-byte header (magic, tag, length, send time) and raw bytes.
//! Hand-rolled rather than serde: it is read on every collective step and must not allocate.

use crate::error::Fault;

pub const HEADER_LEN: usize = 24;
const MAGIC: u32 = u32::from_le_bytes(*b"WFD1");

/// Frame kinds, the top byte of the tag; the low 24 bits are the collective's sequence
/// number, so two ranks that fall out of step notice at once.
pub const KIND_DATA: u32 = 1;
pub const KIND_ABORT: u32 = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: u32,
    pub seq: u32,
    pub len: u32,
    /// The sender's CLOCK_MONOTONIC in ns, for injected one-way delay on the same host.
    pub sent_ns: u64,
}

impl Header {
    pub fn data(seq: u32, len: usize, sent_ns: u64) -> Self {
        Header {
            kind: KIND_DATA,
            seq: seq & 0xff_ffff,
            len: len as u32,
            sent_ns,
        }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&((self.kind << 24) | (self.seq & 0xff_ffff)).to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[16..24].copy_from_slice(&self.sent_ns.to_le_bytes());
        b
    }

    /// Parses a header, refusing anything that is not one of ours or is longer than `max_len`.
    pub fn decode(b: &[u8; HEADER_LEN], max_len: usize) -> Result<Self, Fault> {
        let word = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        if word(0) != MAGIC {
            return Err(Fault::Malformed(format!(
                "bad magic {:08x}, not a weft data frame",
                word(0)
            )));
        }
        let tag = word(4);
        let kind = tag >> 24;
        if kind != KIND_DATA && kind != KIND_ABORT {
            return Err(Fault::Malformed(format!("unknown frame kind {kind}")));
        }
        let len = word(8);
        if len as usize > max_len {
            return Err(Fault::Malformed(format!(
                "frame of {len} bytes exceeds the {max_len}-byte limit"
            )));
        }
        let mut t = [0u8; 8];
        t.copy_from_slice(&b[16..24]);
        Ok(Header {
            kind,
            seq: tag & 0xff_ffff,
            len,
            sent_ns: u64::from_le_bytes(t),
        })
    }
}

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process on a host.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_refuses_garbage() {
        let h = Header::data(0x123456, 2560, 99);
        assert_eq!(Header::decode(&h.encode(), 4096).unwrap(), h);
        let mut bad = h.encode();
        bad[0] = b'X';
        assert!(Header::decode(&bad, 4096)
            .unwrap_err()
            .to_string()
            .contains("magic"));
        assert!(Header::decode(&h.encode(), 100)
            .unwrap_err()
            .to_string()
            .contains("limit"));
    }
}
