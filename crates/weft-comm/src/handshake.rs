//! The connection handshake: a short hello (magic, protocol version, ranks), a SPAKE2
//! password-authenticated key exchange keyed by the cluster secret, then key confirmation
//! in which the dialler proves first and the acceptor answers only once that proof checks.
//! Host identities travel only after that, masked under the fresh session key, so neither
//! a stranger nor an eavesdropper learns who the host is or anything to test a guess with.
//!
//! On the wire (D = dialler, A = acceptor; T = every byte sent so far, both ways, in order):
//!
//! ```text
//! D → A  hello_D (20) ‖ SPAKE2 message X (33)
//! A → D  hello_A (20) ‖ SPAKE2 message Y (33)     (or hello_A and a close, hello refused)
//! D → A  HMAC(K, "weft-confirm-dialler" ‖ T ‖ host_D ⊕ pad_D) (32) ‖ host_D ⊕ pad_D (16)
//! A → D  'N' and a close                           (proof wrong: nothing derived from K)
//!     or 'Y' ‖ HMAC(K, "weft-confirm-acceptor" ‖ T ‖ 'Y' ‖ host_A ⊕ pad_A) ‖ host_A ⊕ pad_A
//! ```
//!
//! K is the SPAKE2 key, fresh per connection; pads are HMAC(K, label). A stranger gets one
//! online guess per connection and nothing it could check a guess against afterwards.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use spake2::{Ed25519Group, Identity, Password, Spake2};

pub use crate::secret::random_secret;

/// 3: a node's plan carries spare experts (`ep_spares`); a node of version 2 would drop
/// them and compute its whole range, so some expert choices would run twice.
/// 4: a byte after the handshake names the channel (control or shard sharing).
/// 5: a plan's share root may be empty, for the node to ask the coordinator's share
/// port for its manifest (the coordinator hashes its file only when a node needs it).
pub const PROTOCOL_VERSION: u32 = 5;
const HELLO_MAGIC: &[u8; 8] = b"WEFTHELO";
/// Magic, version, rank, size. Version 1 put the same four fields first, so a version-1
/// peer is still told apart by its version rather than taken for garbage.
pub const HELLO_LEN: usize = 8 + 4 + 4 + 4;
/// A SPAKE2 Ed25519 message: a side byte and a compressed curve point.
pub const PAKE_LEN: usize = 33;
pub const MAC_LEN: usize = 32;
pub const HOST_LEN: usize = 16;
const ACCEPT: u8 = b'Y';
const REFUSE: u8 = b'N';
const ID_DIALLER: &[u8] = b"weft-dialler";
const ID_ACCEPTOR: &[u8] = b"weft-acceptor";
const CONFIRM_DIALLER: &[u8] = b"weft-confirm-dialler";
const CONFIRM_ACCEPTOR: &[u8] = b"weft-confirm-acceptor";
const PAD_DIALLER: &[u8] = b"weft-host-pad-dialler";
const PAD_ACCEPTOR: &[u8] = b"weft-host-pad-acceptor";

#[derive(Clone, Debug)]
pub struct Hello {
    pub version: u32,
    pub rank: u32,
    pub size: u32,
    /// A hash of the host's boot id: equal on both sides means shared memory and one clock.
    /// Never sent in the clear; the peer's is filled in only once both sides are proven.
    pub host: [u8; HOST_LEN],
}

impl Hello {
    pub fn new(rank: usize, size: usize) -> Self {
        Hello {
            version: PROTOCOL_VERSION,
            rank: rank as u32,
            size: size as u32,
            host: host_id(),
        }
    }

    /// The hello as sent on the wire (public so tests can impersonate a peer). It carries
    /// no host identity.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[..8].copy_from_slice(HELLO_MAGIC);
        b[8..12].copy_from_slice(&self.version.to_le_bytes());
        b[12..16].copy_from_slice(&self.rank.to_le_bytes());
        b[16..20].copy_from_slice(&self.size.to_le_bytes());
        b
    }

    /// A peer's hello; errors name what is wrong.
    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Self, String> {
        if &b[..8] != HELLO_MAGIC {
            return Err(format!(
                "not the weft protocol (first bytes {:?})",
                String::from_utf8_lossy(&b[..8])
            ));
        }
        let word = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        Ok(Hello {
            version: word(8),
            rank: word(12),
            size: word(16),
            host: [0; HOST_LEN],
        })
    }
}

/// Runs the handshake on a fresh connection; returns the peer's hello, its host filled in
/// only after both sides proved the secret. `expect_rank` is the rank we dialled (None when
/// we accepted). The whole handshake, not each read, is bounded by `timeout`.
pub fn handshake(
    stream: &mut TcpStream,
    me: &Hello,
    secret: &[u8],
    expect_rank: Option<usize>,
    timeout: Duration,
) -> Result<Hello, String> {
    let mut io = Wire::new(stream, timeout)?;
    let peer = match expect_rank {
        Some(r) => dial(&mut io, me, secret, r)?,
        None => accept(&mut io, me, secret)?,
    };
    stream
        .set_read_timeout(None)
        .and_then(|()| stream.set_write_timeout(None))
        .map_err(|e| format!("clearing the handshake timeout: {e}"))?;
    Ok(peer)
}

fn dial(io: &mut Wire, me: &Hello, secret: &[u8], want: usize) -> Result<Hello, String> {
    let (pake, msg_x) = Spake2::<Ed25519Group>::start_a(
        &Password::new(secret),
        &Identity::new(ID_DIALLER),
        &Identity::new(ID_ACCEPTOR),
    );
    io.send(&[&me.encode()[..], &msg_x].concat(), "hello")?;
    let mut h = [0u8; HELLO_LEN];
    io.recv(&mut h, "hello", "")?;
    let mut peer = Hello::decode(&h)?;
    check_peer(&peer, me, Some(want))?;
    let mut msg_y = [0u8; PAKE_LEN];
    io.recv(
        &mut msg_y,
        "key exchange message",
        ": the peer refused our hello (its log says why)",
    )?;
    let keys = Keys::new(
        &pake
            .finish(&msg_y)
            .map_err(|e| format!("the peer's key exchange message is invalid ({e})"))?,
    );
    let sealed = keys.seal(PAD_DIALLER, &me.host)?;
    let proof = keys.mac(CONFIRM_DIALLER, &[&io.transcript, &sealed])?;
    io.send(&[&proof[..], &sealed].concat(), "proof")?;
    let mut verdict = [0u8; 1];
    io.recv(&mut verdict, "verdict", "")?;
    match verdict[0] {
        ACCEPT => {}
        REFUSE => return Err("wrong cluster secret (the peer refused our proof)".into()),
        b => return Err(format!("the peer sent verdict byte {b:#04x}, not Y or N")),
    }
    let before = io.transcript.len();
    let mut reply = [0u8; MAC_LEN + HOST_LEN];
    io.recv(&mut reply, "peer's proof", "")?;
    let (theirs, sealed) = reply.split_at(MAC_LEN);
    if !keys.verify(
        CONFIRM_ACCEPTOR,
        &[&io.transcript[..before], sealed],
        theirs,
    )? {
        // The peer accepted our proof, so it holds K; a bad answer means tampering.
        return Err("the peer accepted our proof but its own does not match: \
                    the connection was tampered with"
            .into());
    }
    peer.host = keys.seal(PAD_ACCEPTOR, sealed)?;
    Ok(peer)
}

fn accept(io: &mut Wire, me: &Hello, secret: &[u8]) -> Result<Hello, String> {
    let mut h = [0u8; HELLO_LEN];
    io.recv(&mut h, "hello", "")?;
    // Garbage gets no answer at all.
    let mut peer = Hello::decode(&h)?;
    if let Err(e) = check_peer(&peer, me, None) {
        // Our hello alone (no host, nothing keyed) lets the caller say which side is off.
        io.send(&me.encode(), "hello")?;
        return Err(e);
    }
    let mut msg_x = [0u8; PAKE_LEN];
    io.recv(&mut msg_x, "key exchange message", "")?;
    let (pake, msg_y) = Spake2::<Ed25519Group>::start_b(
        &Password::new(secret),
        &Identity::new(ID_DIALLER),
        &Identity::new(ID_ACCEPTOR),
    );
    let keys = Keys::new(
        &pake
            .finish(&msg_x)
            .map_err(|e| format!("the caller's key exchange message is invalid ({e})"))?,
    );
    io.send(&[&me.encode()[..], &msg_y].concat(), "hello")?;
    let before = io.transcript.len();
    let mut proof = [0u8; MAC_LEN + HOST_LEN];
    io.recv(&mut proof, "proof", "")?;
    let (theirs, sealed) = proof.split_at(MAC_LEN);
    if !keys.verify(CONFIRM_DIALLER, &[&io.transcript[..before], sealed], theirs)? {
        // One byte so an honest caller with the wrong secret can say so; nothing from K.
        io.send(&[REFUSE], "verdict")?;
        return Err("wrong cluster secret (the caller's proof does not match)".into());
    }
    peer.host = keys.seal(PAD_DIALLER, sealed)?;
    let mine = keys.seal(PAD_ACCEPTOR, &me.host)?;
    let answer = keys.mac(CONFIRM_ACCEPTOR, &[&io.transcript, &[ACCEPT], &mine])?;
    // One write for verdict and answer: two small writes would meet Nagle and delayed ACK.
    io.send(&[&[ACCEPT][..], &answer, &mine].concat(), "verdict")?;
    Ok(peer)
}

fn check_peer(peer: &Hello, me: &Hello, expect_rank: Option<usize>) -> Result<(), String> {
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
    Ok(())
}

/// Every session key the handshakes in this process derived, so a test can show that the
/// transcript slicing it checks guesses against is the one the real key verifies.
#[cfg(test)]
static SESSION_KEYS: std::sync::Mutex<Vec<Vec<u8>>> = std::sync::Mutex::new(Vec::new());

/// The session key from SPAKE2 and what is derived from it.
struct Keys(Vec<u8>);

impl Keys {
    fn new(k: &[u8]) -> Self {
        #[cfg(test)]
        SESSION_KEYS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(k.to_vec());
        Keys(k.to_vec())
    }

    fn hmac(&self, label: &[u8], parts: &[&[u8]]) -> Result<Hmac<Sha256>, String> {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0)
            .map_err(|e| format!("keying HMAC: {e}"))?;
        m.update(label);
        for p in parts {
            m.update(p);
        }
        Ok(m)
    }

    fn mac(&self, label: &[u8], parts: &[&[u8]]) -> Result<[u8; MAC_LEN], String> {
        Ok(self.hmac(label, parts)?.finalize().into_bytes().into())
    }

    /// Constant-time comparison, so timing tells a forger nothing.
    fn verify(&self, label: &[u8], parts: &[&[u8]], tag: &[u8]) -> Result<bool, String> {
        Ok(self.hmac(label, parts)?.verify_slice(tag).is_ok())
    }

    /// XOR with a K-derived pad: seals a host id, and unseals it again.
    fn seal(&self, pad_label: &[u8], host: &[u8]) -> Result<[u8; HOST_LEN], String> {
        let pad = self.mac(pad_label, &[])?;
        let mut out = [0u8; HOST_LEN];
        for (i, o) in out.iter_mut().enumerate() {
            *o = host.get(i).copied().unwrap_or(0) ^ pad[i];
        }
        Ok(out)
    }
}

/// The stream under one deadline, recording every byte both ways for key confirmation.
struct Wire<'a> {
    s: &'a mut TcpStream,
    end: Instant,
    timeout: Duration,
    transcript: Vec<u8>,
}

impl<'a> Wire<'a> {
    fn new(s: &'a mut TcpStream, timeout: Duration) -> Result<Self, String> {
        s.set_write_timeout(Some(timeout.max(Duration::from_millis(1))))
            .map_err(|e| format!("setting the handshake timeout: {e}"))?;
        Ok(Wire {
            s,
            end: Instant::now() + timeout,
            timeout,
            transcript: Vec::new(),
        })
    }

    fn send(&mut self, b: &[u8], what: &str) -> Result<(), String> {
        self.s.write_all(b).map_err(|e| match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => {
                format!("could not send our {what} within {:?}", self.timeout)
            }
            _ => format!("sending our {what}: {e}"),
        })?;
        self.transcript.extend_from_slice(b);
        Ok(())
    }

    /// Fills `buf` before the deadline; each partial read waits only for what is left, so
    /// a peer trickling bytes cannot stretch the handshake. `on_close` explains an EOF.
    fn recv(&mut self, buf: &mut [u8], what: &str, on_close: &str) -> Result<(), String> {
        let late = || format!("no {what} within {:?}", self.timeout);
        let mut got = 0;
        while got < buf.len() {
            let left = self.end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(late());
            }
            self.s
                .set_read_timeout(Some(left))
                .map_err(|e| format!("setting the handshake timeout: {e}"))?;
            match self.s.read(&mut buf[got..]) {
                Ok(0) => return Err(format!("connection closed before the {what}{on_close}")),
                Ok(n) => got += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Err(late())
                }
                Err(e) => return Err(format!("reading the {what}: {e}")),
            }
        }
        self.transcript.extend_from_slice(buf);
        Ok(())
    }
}

/// This host's identity: the kernel boot id where there is one, else the host name.
fn host_id() -> [u8; HOST_LEN] {
    let raw = std::fs::read("/proc/sys/kernel/random/boot_id")
        .unwrap_or_else(|_| std::env::var("HOSTNAME").unwrap_or_default().into_bytes());
    let d = Sha256::digest(&raw);
    let mut h = [0u8; HOST_LEN];
    h.copy_from_slice(&d[..HOST_LEN]);
    h
}

#[cfg(test)]
mod tests;
