//! A control connection with heartbeats. After the handshake each side's control messages
//! travel inside an envelope beside a heartbeat sent every `BEAT_EVERY`: a reader thread
//! hands messages to the owner and records when the peer was last heard, a beat thread
//! keeps the peer informed that this side is alive, even while it loads a shard or
//! computes a long prefill. Waits on the peer are bounded by its silence, not by how
//! long the work takes. The coordinator's beats carry every rank's silence, so nodes
//! learn of a stalled peer they are waiting on without a link of their own to it.

use std::io::{Read, Write};
use std::marker::PhantomData;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::activity::NodeWork;

/// How often each side says it is alive.
pub const BEAT_EVERY: Duration = Duration::from_millis(250);
/// The longest one control write may block on a peer that does not read.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// Control messages are small; anything longer is refused.
const MAX_MESSAGE: usize = 1 << 20;

/// What crosses a control connection once it is authenticated.
#[derive(Serialize, Deserialize)]
enum Envelope<T> {
    /// Alive; from the coordinator, with each rank's silence in ms (u32::MAX: lost);
    /// from a node, with its work so far.
    Beat {
        ages_ms: Vec<u32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        work: Option<NodeWork>,
    },
    Msg(T),
}

/// One side of a control connection: send `Out`, receive `In`.
pub struct ControlLink<In, Out> {
    peer: String,
    writer: Arc<Mutex<TcpStream>>,
    /// A handle to shut the socket down without the writer's lock, which a blocked write
    /// may hold.
    closer: TcpStream,
    messages: Receiver<In>,
    /// Why the reader stopped (EOF, malformed message), once it has.
    ended: Arc<Mutex<Option<String>>>,
    epoch: Instant,
    heard_ns: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    _out: PhantomData<fn(Out)>,
}

/// Called with the ages and the work of every beat received (a node's carry no ages; a
/// coordinator's no work).
pub type OnBeat = Box<dyn Fn(&[u32], Option<&NodeWork>) + Send>;

/// What the link tells its owner as it runs.
pub struct Hooks {
    pub on_beat: OnBeat,
    /// Called once when the peer ends the connection (or it breaks); not when this
    /// side closes it.
    pub on_end: Box<dyn Fn() + Send>,
    /// The ages this side's beats carry.
    pub ages: Box<dyn Fn() -> Vec<u32> + Send>,
    /// The work this side's beats report (a node's).
    pub work: Box<dyn Fn() -> Option<NodeWork> + Send>,
}

impl Hooks {
    /// Hooks that do nothing and send empty ages.
    pub fn none() -> Self {
        Hooks {
            on_beat: Box::new(|_, _| {}),
            on_end: Box::new(|| {}),
            ages: Box::new(Vec::new),
            work: Box::new(|| None),
        }
    }
}

fn write_frame<T: Serialize>(s: &mut TcpStream, msg: &T) -> Result<(), String> {
    let body = serde_json::to_vec(msg).map_err(|e| format!("encoding a control message: {e}"))?;
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(&body);
    s.write_all(&frame)
        .map_err(|e| format!("sending a control message: {e}"))
}

fn read_frame<T: DeserializeOwned>(s: &mut TcpStream) -> Result<T, String> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => "the connection closed".to_string(),
        _ => format!("reading a control message: {e}"),
    })?;
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_MESSAGE {
        return Err(format!(
            "control message of {n} bytes exceeds the {MAX_MESSAGE}-byte limit"
        ));
    }
    let mut body = vec![0u8; n];
    s.read_exact(&mut body)
        .map_err(|e| format!("reading a control message: {e}"))?;
    serde_json::from_slice(&body).map_err(|e| format!("malformed control message: {e}"))
}

impl<In, Out> ControlLink<In, Out>
where
    In: DeserializeOwned + Send + 'static,
    Out: Serialize,
{
    /// Starts the reader and beat threads on an authenticated `stream` to `peer`.
    pub fn start(stream: TcpStream, peer: &str, hooks: Hooks) -> Result<Self, String> {
        let peer = peer.to_string();
        let mut reader = stream
            .try_clone()
            .map_err(|e| format!("control connection to {peer}: {e}"))?;
        reader
            .set_read_timeout(None)
            .map_err(|e| format!("control connection to {peer}: {e}"))?;
        // A peer that stops reading must not block a writer (and its lock) for ever.
        stream
            .set_write_timeout(Some(WRITE_TIMEOUT))
            .map_err(|e| format!("control connection to {peer}: {e}"))?;
        let closer = stream
            .try_clone()
            .map_err(|e| format!("control connection to {peer}: {e}"))?;
        let writer = Arc::new(Mutex::new(stream));
        let (tx, messages) = mpsc::channel();
        let ended = Arc::new(Mutex::new(None));
        let epoch = Instant::now();
        let heard_ns = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let Hooks {
            on_beat,
            on_end,
            ages,
            work,
        } = hooks;
        let read_thread = {
            let (ended, heard_ns, stop) = (ended.clone(), heard_ns.clone(), stop.clone());
            std::thread::Builder::new()
                .name("weft-control-read".into())
                .spawn(move || {
                    let why = loop {
                        match read_frame::<Envelope<In>>(&mut reader) {
                            Ok(env) => {
                                heard_ns
                                    .store(epoch.elapsed().as_nanos() as u64, Ordering::Relaxed);
                                match env {
                                    Envelope::Beat { ages_ms, work } => {
                                        on_beat(&ages_ms, work.as_ref())
                                    }
                                    Envelope::Msg(m) => {
                                        if tx.send(m).is_err() {
                                            break "the owner has gone".to_string();
                                        }
                                    }
                                }
                            }
                            Err(e) => break e,
                        }
                    };
                    if !stop.load(Ordering::Relaxed) {
                        tracing::debug!("control connection ended: {why}");
                    }
                    if let Ok(mut g) = ended.lock() {
                        *g = Some(why);
                    }
                    // A link this side closed (dropped) says nothing of the peer.
                    if !stop.load(Ordering::SeqCst) {
                        on_end();
                    }
                })
                .map_err(|e| format!("starting a control reader: {e}"))?
        };
        let beat_thread = {
            let (writer, stop) = (writer.clone(), stop.clone());
            std::thread::Builder::new()
                .name("weft-heartbeat".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let beat: Envelope<()> = Envelope::Beat {
                            ages_ms: ages(),
                            work: work(),
                        };
                        let sent = match writer.lock() {
                            Ok(mut w) => write_frame(&mut w, &beat),
                            Err(_) => Err("poisoned".into()),
                        };
                        if sent.is_err() {
                            break;
                        }
                        std::thread::park_timeout(BEAT_EVERY);
                    }
                })
                .map_err(|e| format!("starting a heartbeat thread: {e}"))?
        };
        Ok(ControlLink {
            peer,
            writer,
            closer,
            messages,
            ended,
            epoch,
            heard_ns,
            stop,
            threads: vec![read_thread, beat_thread],
            _out: PhantomData,
        })
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// The local address this connection uses (the interface the peer reaches us on).
    pub fn local_ip(&self) -> Result<std::net::IpAddr, String> {
        let w = self
            .writer
            .lock()
            .map_err(|_| "the control writer panicked".to_string())?;
        w.local_addr()
            .map(|a| a.ip())
            .map_err(|e| format!("control connection to {}: {e}", self.peer))
    }

    /// How long since anything (message or beat) arrived from the peer.
    pub fn silent_for(&self) -> Duration {
        let heard = Duration::from_nanos(self.heard_ns.load(Ordering::Relaxed));
        self.epoch.elapsed().saturating_sub(heard)
    }

    pub fn send(&self, msg: &Out) -> Result<(), String> {
        let mut w = self
            .writer
            .lock()
            .map_err(|_| "the control writer panicked".to_string())?;
        write_frame(&mut w, &Envelope::Msg(msg))
    }

    /// Sends a message of another type than `Out`, for a link that turned out to carry
    /// another conversation (membership requests: `members::MemberReply`).
    pub fn send_as<T: Serialize>(&self, msg: &T) -> Result<(), String> {
        let mut w = self
            .writer
            .lock()
            .map_err(|_| "the control writer panicked".to_string())?;
        write_frame(&mut w, &Envelope::Msg(msg))
    }

    /// The next message, waiting as long as the peer keeps beating; fails once it has
    /// been silent for `silence`, or its connection ended.
    pub fn recv(&self, silence: Duration) -> Result<In, String> {
        loop {
            match self.messages.recv_timeout(BEAT_EVERY) {
                Ok(m) => return Ok(m),
                Err(RecvTimeoutError::Timeout) => {
                    let quiet = self.silent_for();
                    if quiet >= silence {
                        return Err(format!(
                            "no message or heartbeat for {:.1} s (the limit is {:.1} s)",
                            quiet.as_secs_f64(),
                            silence.as_secs_f64()
                        ));
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let why = self.ended.lock().ok().and_then(|g| g.clone());
                    return Err(why.unwrap_or_else(|| "the connection closed".into()));
                }
            }
        }
    }
}

impl<In, Out> Drop for ControlLink<In, Out> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.closer.shutdown(Shutdown::Both);
        for t in self.threads.drain(..) {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::sync::atomic::AtomicUsize;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    #[test]
    fn messages_pass_and_beats_keep_a_quiet_peer_alive() {
        let (a, b) = pair();
        let beats = Arc::new(AtomicUsize::new(0));
        let seen = beats.clone();
        let hooks = Hooks {
            on_beat: Box::new(move |ages, work| {
                assert_eq!(ages, &[7, 9]);
                assert_eq!(work.map(|w| w.steps), Some(3));
                seen.fetch_add(1, Ordering::Relaxed);
            }),
            ..Hooks::none()
        };
        let left: ControlLink<String, String> = ControlLink::start(a, "b", hooks).unwrap();
        let right: ControlLink<String, String> = ControlLink::start(
            b,
            "a",
            Hooks {
                ages: Box::new(|| vec![7, 9]),
                work: Box::new(|| {
                    Some(NodeWork {
                        steps: 3,
                        ..NodeWork::default()
                    })
                }),
                ..Hooks::none()
            },
        )
        .unwrap();
        // Nothing but beats for three times the silence limit: still no error.
        let t = Instant::now();
        let waiter = std::thread::spawn(move || {
            let got = left.recv(Duration::from_millis(600));
            (got, left)
        });
        std::thread::sleep(Duration::from_millis(1800));
        right.send(&"hello".to_string()).unwrap();
        let (got, left) = waiter.join().unwrap();
        assert_eq!(got.unwrap(), "hello");
        assert!(t.elapsed() >= Duration::from_millis(1800));
        assert!(beats.load(Ordering::Relaxed) >= 4);
        drop(right);
        let e = left.recv(Duration::from_secs(5)).unwrap_err();
        assert!(e.contains("closed"), "{e}");
    }

    #[test]
    fn only_the_peer_closing_the_link_calls_on_end() {
        let counting = |n: &Arc<AtomicUsize>| {
            let n = n.clone();
            Hooks {
                on_end: Box::new(move || {
                    n.fetch_add(1, Ordering::Relaxed);
                }),
                ..Hooks::none()
            }
        };
        let (left_ends, right_ends) =
            (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (a, b) = pair();
        let left: ControlLink<String, String> =
            ControlLink::start(a, "b", counting(&left_ends)).unwrap();
        let right: ControlLink<String, String> =
            ControlLink::start(b, "a", counting(&right_ends)).unwrap();
        // Left closes its own side: its peer (right) ended, left itself heard nothing.
        drop(left);
        let t = Instant::now();
        while right_ends.load(Ordering::Relaxed) == 0 && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(
            right_ends.load(Ordering::Relaxed),
            1,
            "the peer's close is an end"
        );
        assert_eq!(left_ends.load(Ordering::Relaxed), 0, "our own close is not");
        drop(right);
        assert_eq!(right_ends.load(Ordering::Relaxed), 1, "once");
    }

    #[test]
    fn a_silent_peer_is_named_within_the_limit() {
        let (a, b) = pair();
        let link: ControlLink<String, String> = ControlLink::start(a, "b", Hooks::none()).unwrap();
        // `b` is held open but never beats: a stalled process.
        let t = Instant::now();
        let e = link.recv(Duration::from_millis(500)).unwrap_err();
        assert!(e.contains("no message or heartbeat"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(3));
        drop(b);
    }
}
