//! The connection handshake: hello (magic, protocol version, ranks, nonce, host identity),
//! then a mutual HMAC-SHA256 challenge-response keyed by the cluster secret, which never
//! crosses the wire, then a verdict byte so both sides learn why a connection failed.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::{Digest, Sha256};

pub const PROTOCOL_VERSION: u32 = 1;
const HELLO_MAGIC: &[u8; 8] = b"WEFTHELO";
const HELLO_LEN: usize = 8 + 4 + 4 + 4 + 32 + 16;
const AUTH_CONTEXT: &[u8] = b"weft-auth-v1";

#[derive(Clone, Debug)]
pub struct Hello {
    pub version: u32,
    pub rank: u32,
    pub size: u32,
    pub nonce: [u8; 32],
    /// A hash of the host's boot id: equal on both sides means shared memory and one clock.
    pub host: [u8; 16],
}

impl Hello {
    pub fn new(rank: usize, size: usize) -> Self {
        let mut nonce = [0u8; 32];
        rand::thread_rng().fill_bytes(&mut nonce);
        Hello {
            version: PROTOCOL_VERSION,
            rank: rank as u32,
            size: size as u32,
            nonce,
            host: host_id(),
        }
    }

    /// The hello as sent on the wire (public so tests can impersonate a peer).
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[..8].copy_from_slice(HELLO_MAGIC);
        b[8..12].copy_from_slice(&self.version.to_le_bytes());
        b[12..16].copy_from_slice(&self.rank.to_le_bytes());
        b[16..20].copy_from_slice(&self.size.to_le_bytes());
        b[20..52].copy_from_slice(&self.nonce);
        b[52..68].copy_from_slice(&self.host);
        b
    }

    fn decode(b: &[u8; HELLO_LEN]) -> Result<Self, String> {
        if &b[..8] != HELLO_MAGIC {
            return Err(format!(
                "not the weft protocol (first bytes {:?})",
                String::from_utf8_lossy(&b[..8])
            ));
        }
        let word = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut h = Hello {
            version: word(8),
            rank: word(12),
            size: word(16),
            nonce: [0; 32],
            host: [0; 16],
        };
        h.nonce.copy_from_slice(&b[20..52]);
        h.host.copy_from_slice(&b[52..68]);
        Ok(h)
    }
}

/// Runs the handshake on a fresh connection; returns the peer's hello. `expect_rank` is
/// the rank we dialled (None when we accepted).
pub fn handshake(
    stream: &mut TcpStream,
    me: &Hello,
    secret: &[u8],
    expect_rank: Option<usize>,
    timeout: Duration,
) -> Result<Hello, String> {
    let io = |what: &str, e: std::io::Error| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            format!("no {what} within {timeout:?}")
        }
        std::io::ErrorKind::UnexpectedEof => format!("connection closed before the {what}"),
        _ => format!("{what}: {e}"),
    };
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| io("setting a timeout", e))?;
    stream.write_all(&me.encode()).map_err(|e| io("hello", e))?;
    let mut b = [0u8; HELLO_LEN];
    stream.read_exact(&mut b).map_err(|e| io("hello", e))?;
    let peer = Hello::decode(&b)?;
    if peer.version != PROTOCOL_VERSION {
        return Err(format!(
            "peer speaks protocol version {}, this build speaks {PROTOCOL_VERSION}",
            peer.version
        ));
    }
    if peer.size != me.size {
        return Err(format!(
            "peer thinks the group has {} ranks, we have {}",
            peer.size, me.size
        ));
    }
    if peer.rank >= me.size || peer.rank == me.rank {
        return Err(format!(
            "peer claims rank {}, which is not valid here",
            peer.rank
        ));
    }
    if let Some(r) = expect_rank {
        if peer.rank as usize != r {
            return Err(format!(
                "dialled rank {r} but the peer is rank {}",
                peer.rank
            ));
        }
    }
    stream
        .write_all(&proof(secret, &peer.nonce, &me.nonce, me.rank))
        .map_err(|e| io("proof", e))?;
    let mut theirs = [0u8; 32];
    stream.read_exact(&mut theirs).map_err(|e| io("proof", e))?;
    let ok = verifier(secret, &me.nonce, &peer.nonce, peer.rank)
        .verify_slice(&theirs)
        .is_ok();
    stream
        .write_all(if ok { b"Y" } else { b"N" })
        .map_err(|e| io("verdict", e))?;
    let mut verdict = [0u8; 1];
    stream
        .read_exact(&mut verdict)
        .map_err(|e| io("verdict", e))?;
    if !ok {
        return Err("wrong cluster secret (the peer's proof does not match ours)".into());
    }
    if verdict[0] != b'Y' {
        return Err("the peer refused our proof: the cluster secrets differ".into());
    }
    stream
        .set_read_timeout(None)
        .map_err(|e| io("clearing the timeout", e))?;
    Ok(peer)
}

/// HMAC(secret, context ‖ challenge ‖ own nonce ‖ own rank): proves knowledge of the
/// secret for this connection only.
fn proof(secret: &[u8], challenge: &[u8; 32], own: &[u8; 32], rank: u32) -> [u8; 32] {
    verifier(secret, challenge, own, rank)
        .finalize()
        .into_bytes()
        .into()
}

fn verifier(secret: &[u8], challenge: &[u8; 32], own: &[u8; 32], rank: u32) -> Hmac<Sha256> {
    // HMAC accepts keys of any length, so this cannot fail.
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes any key length");
    m.update(AUTH_CONTEXT);
    m.update(challenge);
    m.update(own);
    m.update(&rank.to_le_bytes());
    m
}

/// A fresh random cluster secret (32 hex digits), for clusters one process starts itself.
pub fn random_secret() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// This host's identity: the kernel boot id where there is one, else the host name.
fn host_id() -> [u8; 16] {
    let raw = std::fs::read("/proc/sys/kernel/random/boot_id")
        .unwrap_or_else(|_| std::env::var("HOSTNAME").unwrap_or_default().into_bytes());
    let d = Sha256::digest(&raw);
    let mut h = [0u8; 16];
    h.copy_from_slice(&d[..16]);
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair(
        secret_a: &'static [u8],
        secret_b: &'static [u8],
    ) -> (Result<Hello, String>, Result<Hello, String>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            handshake(
                &mut s,
                &Hello::new(0, 2),
                secret_a,
                None,
                Duration::from_secs(5),
            )
        });
        let mut c = TcpStream::connect(addr).unwrap();
        let b = handshake(
            &mut c,
            &Hello::new(1, 2),
            secret_b,
            Some(0),
            Duration::from_secs(5),
        );
        (t.join().unwrap(), b)
    }

    #[test]
    fn same_secret_is_accepted_on_both_sides() {
        let (a, b) = pair(b"s3cret", b"s3cret");
        assert_eq!(a.unwrap().rank, 1);
        assert_eq!(b.unwrap().rank, 0);
    }

    #[test]
    fn wrong_secret_is_refused_on_both_sides() {
        let (a, b) = pair(b"s3cret", b"other");
        assert!(a.unwrap_err().contains("secret"));
        assert!(b.unwrap_err().contains("secret"));
    }
}
