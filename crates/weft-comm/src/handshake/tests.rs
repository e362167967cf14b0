//! Handshake tests over real sockets through a recording relay: acceptance, refusal, what a
//! stranger is sent, and that a recorded transcript lets no one check a guessed secret.
//! They use a short pass phrase on purpose: SPAKE2 must hold even then.

use super::*;
use std::net::{Shutdown, TcpListener};
use std::thread::JoinHandle;

const HOST_D: [u8; HOST_LEN] = *b"dialler-host-id!";
const HOST_A: [u8; HOST_LEN] = *b"acceptor-host-id";
const T: Duration = Duration::from_secs(5);

struct Run {
    dialler: Result<Hello, String>,
    acceptor: Result<Hello, String>,
    /// Every byte the dialler sent, and every byte the acceptor sent, each until EOF.
    d2a: Vec<u8>,
    a2d: Vec<u8>,
}

fn hello(rank: usize, host: [u8; HOST_LEN]) -> Hello {
    Hello {
        host,
        ..Hello::new(rank, 2)
    }
}

/// Copies `from` to `to` until EOF, returning what passed.
fn relay(mut from: TcpStream, mut to: TcpStream) -> JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    seen.extend_from_slice(&buf[..n]);
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to.shutdown(Shutdown::Write);
        seen
    })
}

/// A real handshake between rank 1 (dialling) and rank 0 (accepting), through a relay
/// that records both directions.
fn run(secret_d: &'static [u8], secret_a: &'static [u8]) -> Run {
    let acceptor_l = TcpListener::bind("127.0.0.1:0").unwrap();
    let acceptor_addr = acceptor_l.local_addr().unwrap();
    let relay_l = TcpListener::bind("127.0.0.1:0").unwrap();
    let relay_addr = relay_l.local_addr().unwrap();
    let acceptor = std::thread::spawn(move || {
        let (mut s, _) = acceptor_l.accept().unwrap();
        handshake(&mut s, &hello(0, HOST_A), secret_a, None, T)
    });
    let relays = std::thread::spawn(move || {
        let (d, _) = relay_l.accept().unwrap();
        let a = TcpStream::connect(acceptor_addr).unwrap();
        let d2a = relay(d.try_clone().unwrap(), a.try_clone().unwrap());
        let a2d = relay(a, d);
        (d2a.join().unwrap(), a2d.join().unwrap())
    });
    let dialler = {
        let mut c = TcpStream::connect(relay_addr).unwrap();
        handshake(&mut c, &hello(1, HOST_D), secret_d, Some(0), T)
    };
    let acceptor = acceptor.join().unwrap();
    let (d2a, a2d) = relays.join().unwrap();
    Run {
        dialler,
        acceptor,
        d2a,
        a2d,
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn same_secret_is_accepted_and_hosts_exchanged() {
    let r = run(b"abcd", b"abcd");
    let (d, a) = (r.dialler.unwrap(), r.acceptor.unwrap());
    assert_eq!((d.rank, d.host), (0, HOST_A));
    assert_eq!((a.rank, a.host), (1, HOST_D));
    // Even with the right secret, an eavesdropper sees neither host id.
    for host in [HOST_A, HOST_D] {
        assert!(!contains(&r.d2a, &host) && !contains(&r.a2d, &host));
    }
    assert_eq!(r.d2a.len(), HELLO_LEN + PAKE_LEN + MAC_LEN + HOST_LEN);
    assert_eq!(r.a2d.len(), HELLO_LEN + PAKE_LEN + 1 + MAC_LEN + HOST_LEN);
}

#[test]
fn wrong_secret_is_refused_on_both_sides() {
    let r = run(b"abce", b"abcd");
    assert_eq!(
        r.dialler.unwrap_err(),
        "wrong cluster secret (the peer refused our proof)"
    );
    assert_eq!(
        r.acceptor.unwrap_err(),
        "wrong cluster secret (the caller's proof does not match)"
    );
}

#[test]
fn a_caller_with_the_wrong_secret_gets_a_refusal_byte_and_nothing_more() {
    let r = run(b"wrong", b"abcd");
    assert!(r.acceptor.is_err());
    // Hello and SPAKE2 message, then the single refusal byte, then EOF.
    assert_eq!(r.a2d.len(), HELLO_LEN + PAKE_LEN + 1, "{:?}", r.a2d);
    assert_eq!(r.a2d[HELLO_LEN + PAKE_LEN], REFUSE);
    assert!(!contains(&r.a2d, &HOST_A), "the acceptor's host id leaked");
    assert!(
        !contains(&r.d2a, &HOST_D),
        "the dialler's host id went in the clear"
    );
    // The hello names no host: magic, version, rank, size and nothing else.
    assert_eq!(&r.a2d[..HELLO_LEN], &hello(0, HOST_A).encode());
}

/// HMAC(secret, "weft-auth-v1" ‖ challenge ‖ own nonce ‖ rank): version 1's proof, which
/// an eavesdropper could recompute for each guess and compare.
fn v1_proof(secret: &[u8], challenge: &[u8], own: &[u8], rank: u32) -> [u8; 32] {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret).unwrap();
    m.update(b"weft-auth-v1");
    m.update(challenge);
    m.update(own);
    m.update(&rank.to_le_bytes());
    m.finalize().into_bytes().into()
}

/// Whether some version-1 proof of `guess` over the transcript's bytes appears in it.
fn v1_guess_checks(guess: &[u8], d2a: &[u8], a2d: &[u8]) -> bool {
    let all = [d2a, a2d].concat();
    a2d.windows(32).any(|c| {
        d2a.windows(32).any(|o| {
            [0, 1].iter().any(|&rank| {
                contains(&all, &v1_proof(guess, c, o, rank))
                    || contains(&all, &v1_proof(guess, o, c, rank))
            })
        })
    })
}

#[test]
fn the_v1_check_does_catch_a_v1_transcript() {
    // Version 1 as recorded: hello (header, nonce, host), then each side's proof.
    let (nd, na) = ([1u8; 32], [2u8; 32]);
    let side = |rank: usize, own: [u8; 32], other: [u8; 32]| {
        let mut b = hello(rank, HOST_D).encode().to_vec();
        b.extend_from_slice(&own);
        b.extend_from_slice(&HOST_D);
        b.extend_from_slice(&v1_proof(b"abcd", &other, &own, rank as u32));
        b
    };
    let (d2a, a2d) = (side(1, nd, na), side(0, na, nd));
    assert!(v1_guess_checks(b"abcd", &d2a, &a2d));
    assert!(!v1_guess_checks(b"abce", &d2a, &a2d));
}

#[test]
fn a_recorded_transcript_verifies_no_guess() {
    let r = run(b"abcd", b"abcd");
    assert!(r.dialler.is_ok() && r.acceptor.is_ok());
    let msg_x = &r.d2a[HELLO_LEN..HELLO_LEN + PAKE_LEN];
    let msg_y = &r.a2d[HELLO_LEN..HELLO_LEN + PAKE_LEN];
    let first = HELLO_LEN + PAKE_LEN;
    let proof = &r.d2a[first..first + MAC_LEN];
    let sealed = &r.d2a[first + MAC_LEN..];
    // The transcript the dialler's proof covers: both first messages, in order.
    let t = [&r.d2a[..first], &r.a2d[..first]].concat();
    let all = [&r.d2a[..], &r.a2d[..]].concat();
    // Control: the session key itself does reproduce the recorded proof from `t`.
    let keys = SESSION_KEYS.lock().unwrap().clone();
    assert!(keys.iter().any(|k| {
        let m = Keys::new(k).mac(CONFIRM_DIALLER, &[&t, sealed]).unwrap();
        m[..] == *proof
    }));
    for guess in [&b"abcd"[..], b"abce"] {
        // (i) Version 1's proof, over any two 32-byte windows as nonces, appears nowhere.
        assert!(!v1_guess_checks(guess, &r.d2a, &r.a2d));
        // (ii) Playing either side of SPAKE2 with the guess, against the recorded other
        // side's message, yields a key whose proof differs from the recorded one, for the
        // right guess as for the wrong: the eavesdropper lacks the recorded scalars.
        let ids = (Identity::new(ID_DIALLER), Identity::new(ID_ACCEPTOR));
        let (as_d, _) = Spake2::<Ed25519Group>::start_a(&Password::new(guess), &ids.0, &ids.1);
        let (as_a, _) = Spake2::<Ed25519Group>::start_b(&Password::new(guess), &ids.0, &ids.1);
        for k in [as_d.finish(msg_y).unwrap(), as_a.finish(msg_x).unwrap()] {
            let mine = Keys::new(&k).mac(CONFIRM_DIALLER, &[&t, sealed]).unwrap();
            assert_ne!(&mine[..], proof, "guess {guess:?} verified offline");
            assert!(!contains(&all, &mine));
        }
    }
}

/// Serves one connection with a raw script: sends `send`, then reads until EOF.
fn fake_peer(send: Vec<u8>) -> (std::net::SocketAddr, JoinHandle<Vec<u8>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        let _ = s.write_all(&send);
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        got
    });
    (addr, t)
}

#[test]
fn a_version_mismatch_names_both_versions() {
    // A version-1 node answers a dialler with its 68-byte hello.
    let mut v1 = hello(0, HOST_A);
    v1.version = 1;
    let mut old = v1.encode().to_vec();
    old.extend_from_slice(&[7u8; 48]);
    let (addr, t) = fake_peer(old);
    let mut c = TcpStream::connect(addr).unwrap();
    let e = handshake(&mut c, &hello(1, HOST_D), b"abcd", Some(0), T).unwrap_err();
    assert_eq!(
        e,
        format!("peer speaks protocol version 1, this build speaks {PROTOCOL_VERSION}")
    );
    drop(c);
    t.join().unwrap();

    // A version-1 caller is refused with our hello alone, which names no host.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let acceptor = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        handshake(&mut s, &hello(0, HOST_A), b"abcd", None, T)
    });
    let mut c = TcpStream::connect(addr).unwrap();
    let mut v1 = hello(1, HOST_D);
    v1.version = 1;
    c.write_all(&v1.encode()).unwrap();
    c.write_all(&[7u8; 48]).unwrap();
    let e = acceptor.join().unwrap().unwrap_err();
    assert_eq!(
        e,
        format!("peer speaks protocol version 1, this build speaks {PROTOCOL_VERSION}")
    );
    let mut got = Vec::new();
    c.set_read_timeout(Some(T)).unwrap();
    let _ = c.read_to_end(&mut got);
    assert_eq!(got, hello(0, HOST_A).encode());
}

#[test]
fn garbage_and_silence_are_refused_within_the_timeout() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let acceptor = std::thread::spawn(move || {
        let mut errs = Vec::new();
        for _ in 0..2 {
            let (mut s, _) = l.accept().unwrap();
            let short = Duration::from_millis(300);
            errs.push(handshake(&mut s, &hello(0, HOST_A), b"abcd", None, short));
        }
        errs
    });
    let mut c = TcpStream::connect(addr).unwrap();
    c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut got = Vec::new();
    let _ = c.read_to_end(&mut got);
    assert!(got.is_empty(), "garbage must get no answer: {got:?}");
    // A caller that sends its hello, then stalls mid-message.
    let mut c2 = TcpStream::connect(addr).unwrap();
    c2.write_all(&hello(1, HOST_D).encode()).unwrap();
    c2.write_all(&[0u8; 10]).unwrap();
    let start = Instant::now();
    let errs = acceptor.join().unwrap();
    assert!(start.elapsed() < Duration::from_secs(3));
    assert!(errs[0]
        .as_ref()
        .unwrap_err()
        .contains("not the weft protocol"));
    let e = errs[1].as_ref().unwrap_err();
    assert!(e.contains("no key exchange message within"), "{e}");
}

#[test]
fn a_corrupt_key_exchange_message_is_refused_without_a_panic() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let acceptor = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        handshake(&mut s, &hello(0, HOST_A), b"abcd", None, T)
    });
    let mut c = TcpStream::connect(addr).unwrap();
    c.write_all(&hello(1, HOST_D).encode()).unwrap();
    c.write_all(&[0x41; PAKE_LEN]).unwrap();
    let e = acceptor.join().unwrap().unwrap_err();
    assert!(e.contains("key exchange message is invalid"), "{e}");
    let mut got = Vec::new();
    let _ = c.read_to_end(&mut got);
    assert!(got.is_empty(), "{got:?}");
}
