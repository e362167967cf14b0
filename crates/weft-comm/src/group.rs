//! A group of ranks connected peer to peer: building the mesh (dial lower ranks, accept
//! higher ones, handshake, pick TCP or shared memory per link) and the framed send and
//! receive that collectives use, with injected delay, deadlines and peer-loss reporting.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{CommError, Fault};
use crate::frame::{monotonic_ns, Header, HEADER_LEN, KIND_ABORT};
use crate::handshake::{handshake, Hello};
use crate::link::{Deadline, Link};
use crate::liveness::Liveness;
use crate::ring::RingLink;
use crate::tcp::TcpLink;

/// Which transport links use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    Tcp,
    /// Shared-memory rings; every peer must be on this host.
    Shm,
    /// Shared memory to peers on this host, TCP to the others.
    Auto,
}

impl std::str::FromStr for TransportKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "tcp" => Ok(TransportKind::Tcp),
            "shm" => Ok(TransportKind::Shm),
            "auto" => Ok(TransportKind::Auto),
            _ => Err(format!("unknown transport {s:?} (tcp, shm or auto)")),
        }
    }
}

#[derive(Clone, Debug)]
pub struct GroupOptions {
    pub secret: Vec<u8>,
    pub transport: TransportKind,
    /// The deadline of every wait on a peer (with `liveness`: of every silence).
    pub timeout: Duration,
    /// Heartbeat-fed liveness of the group's ranks: with it, a wait past `timeout` goes
    /// on while every rank is heard from (a peer computing a long prefill is not lost),
    /// up to `max_wait`, and gives up naming a rank silent for `timeout`.
    pub liveness: Option<Arc<Liveness>>,
    /// The longest any single wait may last while every rank is alive.
    pub max_wait: Duration,
    /// How long building the mesh may take (peers start at different times).
    pub connect_timeout: Duration,
    /// The most a waiting receiver busy-polls before it blocks.
    pub spin: Duration,
    /// Injected one-way delay on every incoming link, to emulate a slower network.
    pub delay: Duration,
    /// Per-peer overrides of `delay`.
    pub peer_delays: BTreeMap<usize, Duration>,
    /// The largest frame accepted; anything longer is malformed.
    pub max_frame: usize,
    /// Ranks that block instead of spinning while they wait (a coordinator that is idle
    /// most of a step); they do not count towards this host's load, and with `Auto` their
    /// links are TCP.
    pub passive: Vec<usize>,
}

impl Default for GroupOptions {
    fn default() -> Self {
        GroupOptions {
            secret: Vec::new(),
            transport: TransportKind::Auto,
            timeout: Duration::from_secs(10),
            liveness: None,
            max_wait: Duration::from_secs(3600),
            connect_timeout: Duration::from_secs(30),
            spin: Duration::from_micros(200),
            delay: Duration::ZERO,
            peer_delays: BTreeMap::new(),
            max_frame: 1 << 20,
            passive: Vec::new(),
        }
    }
}

pub(crate) struct Peer {
    pub rank: usize,
    pub addr: String,
    link: Box<dyn Link>,
    /// Same host: one CLOCK_MONOTONIC, so the sender's timestamp can time the delay.
    same_clock: bool,
    delay_ns: u64,
    sent: u32,
    received: u32,
}

/// One rank's view of the group.
pub struct Group {
    rank: usize,
    size: usize,
    peers: Vec<Option<Peer>>,
    opts: GroupOptions,
    failed: Option<(usize, String, String)>,
    pub(crate) send_buf: Vec<u8>,
    pub(crate) scratch: Vec<Vec<f32>>,
    pub(crate) counts: Vec<usize>,
    pub(crate) everyone: Vec<usize>,
    pub(crate) ring_tmp: Vec<f32>,
    pub(crate) topk_send: Vec<u8>,
    pub(crate) topk_recv: Vec<u8>,
}

impl Group {
    /// Joins the group: listens on `addrs[rank]`, dials lower ranks, accepts higher ones.
    pub fn connect(rank: usize, addrs: &[String], opts: GroupOptions) -> Result<Group, CommError> {
        if rank >= addrs.len() {
            return Err(CommError::Config(format!(
                "rank {rank} is outside a group of {} addresses",
                addrs.len()
            )));
        }
        let listener = bind(&addrs[rank])?;
        Self::with_listener(rank, addrs, listener, opts)
    }

    /// As `connect`, with this rank's listener already bound.
    pub fn with_listener(
        rank: usize,
        addrs: &[String],
        listener: TcpListener,
        opts: GroupOptions,
    ) -> Result<Group, CommError> {
        let size = addrs.len();
        let mut g = Group::empty(rank, size, opts);
        let me = Hello::new(rank, size);
        let end = Instant::now() + g.opts.connect_timeout;
        for (j, addr) in addrs.iter().enumerate().take(rank) {
            let peer = g.dial(j, addr, &me, end)?;
            g.peers[j] = Some(peer);
        }
        listener.set_nonblocking(true).map_err(|e| CommError::Io {
            what: format!("listener on {}", addrs[rank]),
            source: e,
        })?;
        while g
            .peers
            .iter()
            .enumerate()
            .any(|(j, p)| j > rank && p.is_none())
        {
            if Instant::now() >= end {
                let missing: Vec<String> = (rank + 1..size)
                    .filter(|&j| g.peers[j].is_none())
                    .map(|j| format!("rank {j} ({})", addrs[j]))
                    .collect();
                return Err(CommError::Config(format!(
                    "rank {rank}: no connection from {} within {:?}",
                    missing.join(", "),
                    g.opts.connect_timeout
                )));
            }
            match listener.accept() {
                Ok((stream, from)) => match g.accept(stream, from, &me, addrs) {
                    Ok(peer) => {
                        let j = peer.rank;
                        g.peers[j] = Some(peer);
                    }
                    Err(e) => tracing::warn!("rank {rank}: refused a connection from {from}: {e}"),
                },
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(2))
                }
                Err(e) => tracing::warn!("rank {rank}: accept failed: {e}"),
            }
        }
        g.note_host_load();
        Ok(g)
    }

    /// Ranks on this host beyond its cores must yield while they wait (see `link::pause`).
    fn note_host_load(&self) {
        let busy = |r: usize| !self.opts.passive.contains(&r);
        let local = usize::from(busy(self.rank))
            + self
                .peers
                .iter()
                .flatten()
                .filter(|p| p.same_clock && busy(p.rank))
                .count();
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        crate::link::set_oversubscribed(local > cores);
    }

    /// `n` ranks in this process, linked by in-memory rings (tests, single-process TP).
    pub fn in_process(n: usize, opts: GroupOptions) -> Result<Vec<Group>, CommError> {
        let mut groups: Vec<Group> = (0..n).map(|r| Group::empty(r, n, opts.clone())).collect();
        for i in 0..n {
            for j in i + 1..n {
                let (a, b) = RingLink::pair(opts.spin).map_err(CommError::Config)?;
                groups[i].peers[j] =
                    Some(groups[i].peer(j, format!("in-process rank {j}"), Box::new(a), true));
                groups[j].peers[i] =
                    Some(groups[j].peer(i, format!("in-process rank {i}"), Box::new(b), true));
            }
        }
        Ok(groups)
    }

    fn empty(rank: usize, size: usize, opts: GroupOptions) -> Group {
        Group {
            rank,
            size,
            peers: (0..size).map(|_| None).collect(),
            opts,
            failed: None,
            send_buf: Vec::new(),
            scratch: (0..size).map(|_| Vec::new()).collect(),
            counts: Vec::new(),
            everyone: (0..size).collect(),
            ring_tmp: Vec::new(),
            topk_send: Vec::new(),
            topk_recv: Vec::new(),
        }
    }

    fn peer(&self, rank: usize, addr: String, link: Box<dyn Link>, same_clock: bool) -> Peer {
        let delay = self
            .opts
            .peer_delays
            .get(&rank)
            .copied()
            .unwrap_or(self.opts.delay);
        Peer {
            rank,
            addr,
            link,
            same_clock,
            delay_ns: delay.as_nanos() as u64,
            sent: 0,
            received: 0,
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// The address and transport of the link to `rank` (None for ourselves).
    pub fn link_info(&self, rank: usize) -> Option<(String, &'static str)> {
        self.peers
            .get(rank)?
            .as_ref()
            .map(|p| (p.addr.clone(), p.link.kind()))
    }

    fn dial(&self, j: usize, addr: &str, me: &Hello, end: Instant) -> Result<Peer, CommError> {
        let target = resolve(addr)?;
        let mut stream = loop {
            match TcpStream::connect_timeout(&target, Duration::from_millis(500)) {
                Ok(s) => break s,
                Err(e) if Instant::now() < end => {
                    tracing::debug!(
                        "rank {}: dialling rank {j} at {addr}: {e}; retrying",
                        self.rank
                    );
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => {
                    return Err(CommError::Peer {
                        rank: j,
                        addr: addr.to_string(),
                        fault: Fault::Io(e),
                    })
                }
            }
        };
        let hs_timeout = end
            .saturating_duration_since(Instant::now())
            .max(Duration::from_secs(1));
        let hello = handshake(&mut stream, me, &self.opts.secret, Some(j), hs_timeout).map_err(
            |reason| {
                tracing::warn!("rank {}: rank {j} at {addr} refused: {reason}", self.rank);
                CommError::Handshake {
                    addr: format!("rank {j} at {addr}"),
                    reason,
                }
            },
        )?;
        let same_host = hello.host == me.host;
        // A passive rank blocks while it waits: in poll(2) on TCP it is truly idle, where
        // napping on a ring would wake it thousands of times a second on a busy core.
        let passive = self.opts.passive.contains(&j) || self.opts.passive.contains(&self.rank);
        let use_shm = match self.opts.transport {
            _ if passive && self.opts.transport != TransportKind::Shm => false,
            TransportKind::Tcp => false,
            TransportKind::Auto => same_host,
            TransportKind::Shm if same_host => true,
            TransportKind::Shm => {
                return Err(CommError::Config(format!(
                    "shared memory needs every rank on one host; rank {j} at {addr} is on another"
                )))
            }
        };
        let link = self.negotiate_dialler(j, addr, stream, use_shm)?;
        Ok(self.peer(j, addr.to_string(), link, same_host))
    }

    /// The dialler proposes the transport: 'T', or 'S' with the ring files it created.
    fn negotiate_dialler(
        &self,
        j: usize,
        addr: &str,
        mut stream: TcpStream,
        use_shm: bool,
    ) -> Result<Box<dyn Link>, CommError> {
        let err = |what: String| CommError::Peer {
            rank: j,
            addr: addr.to_string(),
            fault: Fault::Malformed(what),
        };
        let io = |e: std::io::Error| CommError::Peer {
            rank: j,
            addr: addr.to_string(),
            fault: Fault::Io(e),
        };
        if !use_shm {
            stream.write_all(b"T").map_err(io)?;
            let link = TcpLink::new(stream, self.opts.spin).map_err(io)?;
            return Ok(Box::new(link));
        }
        let dir = shm_dir();
        let stem = format!(
            "weft-{}-{}to{}-{:x}",
            std::process::id(),
            self.rank,
            j,
            rand::random::<u64>()
        );
        let tx = dir.join(format!("{stem}.a"));
        let rx = dir.join(format!("{stem}.b"));
        let watch = stream.try_clone().map_err(io)?;
        let link = RingLink::create_files(&tx, &rx, watch, self.opts.spin);
        let link = match link {
            Ok(l) => l,
            Err(e) => {
                let _ = std::fs::remove_file(&tx);
                let _ = std::fs::remove_file(&rx);
                return Err(CommError::Config(format!("shared memory to rank {j}: {e}")));
            }
        };
        let mut msg = b"S".to_vec();
        for p in [&tx, &rx] {
            let s = p.to_string_lossy();
            msg.extend_from_slice(&(s.len() as u16).to_le_bytes());
            msg.extend_from_slice(s.as_bytes());
        }
        let sent = stream.write_all(&msg).map_err(io);
        let mut verdict = [0u8; 1];
        let got = sent.and_then(|_| stream.read_exact(&mut verdict).map_err(io));
        // Both sides have the files mapped (or failed): the names are no longer needed.
        let _ = std::fs::remove_file(&tx);
        let _ = std::fs::remove_file(&rx);
        got?;
        if verdict[0] != b'Y' {
            return Err(err("could not map our shared-memory rings".into()));
        }
        Ok(Box::new(link))
    }

    fn accept(
        &self,
        mut stream: TcpStream,
        _from: SocketAddr,
        me: &Hello,
        addrs: &[String],
    ) -> Result<Peer, String> {
        stream.set_nonblocking(false).map_err(|e| e.to_string())?;
        let hello = handshake(
            &mut stream,
            me,
            &self.opts.secret,
            None,
            Duration::from_secs(5),
        )?;
        let j = hello.rank as usize;
        if j <= self.rank {
            return Err(format!("rank {j} should be dialled by us, not dial us"));
        }
        if self.peers[j].is_some() {
            return Err(format!("rank {j} is already connected"));
        }
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| e.to_string())?;
        let mut kind = [0u8; 1];
        stream
            .read_exact(&mut kind)
            .map_err(|e| format!("transport choice: {e}"))?;
        let link: Box<dyn Link> = match kind[0] {
            b'T' => {
                stream.set_read_timeout(None).map_err(|e| e.to_string())?;
                Box::new(TcpLink::new(stream, self.opts.spin).map_err(|e| e.to_string())?)
            }
            b'S' => {
                let mut paths = Vec::new();
                for _ in 0..2 {
                    let mut len = [0u8; 2];
                    stream
                        .read_exact(&mut len)
                        .map_err(|e| format!("ring path: {e}"))?;
                    let mut p = vec![0u8; u16::from_le_bytes(len) as usize];
                    stream
                        .read_exact(&mut p)
                        .map_err(|e| format!("ring path: {e}"))?;
                    paths.push(PathBuf::from(String::from_utf8_lossy(&p).into_owned()));
                }
                stream.set_read_timeout(None).map_err(|e| e.to_string())?;
                let watch = stream.try_clone().map_err(|e| e.to_string())?;
                // The dialler's tx ring is our rx ring.
                match RingLink::open_files(&paths[1], &paths[0], watch, self.opts.spin) {
                    Ok(l) => {
                        stream.write_all(b"Y").map_err(|e| e.to_string())?;
                        // `watch` (a dup of this socket) keeps the connection open: it is
                        // how each side sees the other die.
                        Box::new(l)
                    }
                    Err(e) => {
                        let _ = stream.write_all(b"N");
                        return Err(format!("shared memory: {e}"));
                    }
                }
            }
            other => return Err(format!("unknown transport choice byte {other}")),
        };
        Ok(self.peer(j, addrs[j].clone(), link, hello.host == me.host))
    }

    fn fault(&self, rank: usize, fault: Fault) -> CommError {
        let addr = self.peers[rank]
            .as_ref()
            .map(|p| p.addr.clone())
            .unwrap_or_default();
        CommError::Peer { rank, addr, fault }
    }

    /// Fails fast once a peer has been lost: every later operation reports the same peer.
    pub(crate) fn check(&self) -> Result<(), CommError> {
        match &self.failed {
            None => Ok(()),
            Some((lost, addr, reason)) => Err(CommError::Aborted {
                lost: *lost,
                addr: addr.clone(),
                reporter: self.rank,
                reason: reason.clone(),
            }),
        }
    }

    /// Records a lost peer and tells every other peer, so that ranks waiting on someone
    /// else learn whom the group lost instead of timing out on a healthy neighbour.
    pub(crate) fn fail(&mut self, err: CommError) -> CommError {
        let Some(lost) = err.lost_rank() else {
            return err;
        };
        if self.failed.is_some() {
            return err;
        }
        let addr = self.peers[lost]
            .as_ref()
            .map(|p| p.addr.clone())
            .unwrap_or_default();
        let reason = match &err {
            CommError::Aborted { reason, .. } => reason.clone(),
            e => e.to_string(),
        };
        self.failed = Some((lost, addr, reason.clone()));
        let mut payload = (lost as u32).to_le_bytes().to_vec();
        payload.extend_from_slice(reason.as_bytes());
        payload.truncate(1024);
        let deadline = Deadline::after(Duration::from_millis(200));
        for p in self.peers.iter_mut().flatten() {
            if p.rank == lost {
                continue;
            }
            let h = Header {
                kind: KIND_ABORT,
                seq: p.sent,
                len: payload.len() as u32,
                sent_ns: monotonic_ns(),
            };
            let _ = p.link.write_all(&h.encode(), &mut deadline.clone());
            let _ = p.link.write_all(&payload, &mut deadline.clone());
        }
        // A dead link is dropped so that its socket or rings are released now.
        if !matches!(err, CommError::Aborted { .. }) {
            self.peers[lost] = None;
        }
        err
    }

    fn live(&mut self, rank: usize) -> Result<&mut Peer, CommError> {
        let me = self.rank;
        self.peers
            .get_mut(rank)
            .and_then(|p| p.as_mut())
            .ok_or_else(|| CommError::Config(format!("rank {me} has no link to rank {rank}")))
    }

    /// Sends one frame of `payload` to `to`.
    /// A deadline for one wait of this rank, following the heartbeats when there are any.
    fn deadline(&self, timeout: Duration) -> Deadline {
        Deadline::patient(
            timeout,
            self.opts.liveness.as_ref(),
            self.rank,
            self.opts.max_wait,
        )
    }

    pub(crate) fn send_frame(&mut self, to: usize, payload: &[u8]) -> Result<(), CommError> {
        let mut deadline = self.deadline(self.opts.timeout);
        let mut buf = std::mem::take(&mut self.send_buf);
        let r = (|| {
            let p = self.live(to).map_err(|_| (to, Fault::Closed))?;
            let h = Header::data(p.sent, payload.len(), monotonic_ns());
            // One write per frame: with TCP_NODELAY two writes would be two packets.
            buf.clear();
            buf.extend_from_slice(&h.encode());
            buf.extend_from_slice(payload);
            p.sent = p.sent.wrapping_add(1);
            p.link.write_all(&buf, &mut deadline).map_err(|f| (to, f))
        })();
        self.send_buf = buf;
        match r {
            Ok(()) => Ok(()),
            Err(e) => Err(self.fail_with(e)),
        }
    }

    /// Receives the next frame from `from`, which must be exactly `buf.len()` bytes.
    pub(crate) fn recv_frame(&mut self, from: usize, buf: &mut [u8]) -> Result<(), CommError> {
        let t = self.opts.timeout;
        self.recv_frame_within(from, buf, t)
    }

    /// `recv_frame` with its own deadline.
    pub(crate) fn recv_frame_within(
        &mut self,
        from: usize,
        buf: &mut [u8],
        timeout: Duration,
    ) -> Result<(), CommError> {
        // An idle wait (longer than the group's timeout) lasts while the group is heard
        // from: a coordinator whose host lost power sends no FIN, but falls silent.
        let mut deadline = if timeout > self.opts.timeout {
            match &self.opts.liveness {
                Some(l) => Deadline::patient(self.opts.timeout, Some(l), self.rank, timeout),
                None => Deadline::after(timeout),
            }
        } else {
            self.deadline(timeout)
        };
        let max = self.opts.max_frame;
        let me = self.rank;
        let r: Result<Option<(usize, String)>, (usize, Fault)> = (|| {
            let p = self.live(from).map_err(|_| (from, Fault::Closed))?;
            let mut hb = [0u8; HEADER_LEN];
            p.link
                .read_exact(&mut hb, &mut deadline)
                .map_err(|f| (from, f))?;
            let h = Header::decode(&hb, max).map_err(|f| (from, f))?;
            let arrived = monotonic_ns();
            if h.kind == KIND_ABORT {
                let mut body = vec![0u8; h.len as usize];
                p.link
                    .read_exact(&mut body, &mut deadline)
                    .map_err(|f| (from, f))?;
                if body.len() < 4 {
                    return Err((from, Fault::Malformed("short abort frame".into())));
                }
                let lost = u32::from_le_bytes([body[0], body[1], body[2], body[3]]) as usize;
                return Ok(Some((
                    lost,
                    String::from_utf8_lossy(&body[4..]).into_owned(),
                )));
            }
            if h.seq != p.received & 0xff_ffff {
                return Err((
                    from,
                    Fault::Malformed(format!(
                        "frame {} arrived where frame {} was due: the ranks are out of step",
                        h.seq,
                        p.received & 0xff_ffff
                    )),
                ));
            }
            if h.len as usize != buf.len() {
                return Err((
                    from,
                    Fault::Malformed(format!(
                        "frame of {} bytes where rank {me} expects {}",
                        h.len,
                        buf.len()
                    )),
                ));
            }
            p.link
                .read_exact(buf, &mut deadline)
                .map_err(|f| (from, f))?;
            p.received = p.received.wrapping_add(1);
            if p.delay_ns > 0 {
                let start = if p.same_clock { h.sent_ns } else { arrived };
                let due = start + p.delay_ns;
                while monotonic_ns() < due {
                    std::hint::spin_loop();
                }
            }
            Ok(None)
        })();
        match r {
            Ok(None) => Ok(()),
            Ok(Some((lost, reason))) => {
                let addr = self
                    .peers
                    .get(lost)
                    .and_then(|p| p.as_ref())
                    .map(|p| p.addr.clone());
                let e = CommError::Aborted {
                    lost,
                    addr: addr.unwrap_or_else(|| "(unknown)".into()),
                    reporter: from,
                    reason,
                };
                Err(self.fail(e))
            }
            Err(e) => Err(self.fail_with(e)),
        }
    }

    fn fail_with(&mut self, (rank, fault): (usize, Fault)) -> CommError {
        // A silent rank is the one to blame, whichever peer this rank was waiting on.
        let rank = match fault {
            Fault::Silent { rank: silent, .. } if silent < self.size && silent != self.rank => {
                silent
            }
            _ => rank,
        };
        let e = self.fault(rank, fault);
        self.fail(e)
    }
}

fn resolve(addr: &str) -> Result<SocketAddr, CommError> {
    addr.to_socket_addrs()
        .map_err(|e| CommError::Config(format!("address {addr:?}: {e}")))?
        .next()
        .ok_or_else(|| CommError::Config(format!("address {addr:?} resolves to nothing")))
}

/// Binds a listener with SO_REUSEADDR, so a restarted rank can take its port back at once.
pub fn bind(addr: &str) -> Result<TcpListener, CommError> {
    let a = resolve(addr)?;
    let io = |e: std::io::Error| CommError::Io {
        what: format!("listening on {addr}"),
        source: e,
    };
    let s = socket2::Socket::new(socket2::Domain::for_address(a), socket2::Type::STREAM, None)
        .map_err(io)?;
    s.set_reuse_address(true).map_err(io)?;
    s.bind(&a.into()).map_err(io)?;
    s.listen(128).map_err(io)?;
    Ok(s.into())
}

fn shm_dir() -> PathBuf {
    let d = PathBuf::from("/dev/shm");
    if d.is_dir() {
        d
    } else {
        std::env::temp_dir()
    }
}
