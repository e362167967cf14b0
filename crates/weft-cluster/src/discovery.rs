//! Membership: how the nodes of one cluster find each other, and how each learns that
//! one has gone. A node announces itself with DNS-SD over mDNS (`_weft._tcp.local.`, TXT:
//! cluster id, protocol version, control address, name, instance id) and browses for the
//! others; on networks without multicast `--join ADDR` names one member, and members
//! swap their lists of live members (gossip) over authenticated control connections
//! (the cluster secret's handshake). Every member found is watched over such a
//! connection: asked for its member list every `PROBE_EVERY`, heard through its
//! heartbeats, and marked lost at once when the connection closes (a killed process) or
//! after `LOST_AFTER` of silence (a stalled or cut-off host), or when its mDNS goodbye
//! arrives (a clean exit). A node of another protocol version is refused and named.
//!
//! The cluster id is a slow hash of the secret (65,536 rounds of SHA-256, 64 bits shown):
//! browsers skip other clusters' nodes without dialling them, and the secret itself never
//! leaves the machine. Anyone who hears the announcement can test guesses of the secret
//! against the id offline, at that cost per guess; the 128-bit floor on secrets (and
//! `weft secret`'s 256 random bits) is what makes that hopeless, and `--no-mdns` keeps
//! even the id off the network.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use mdns_sd::{IfKind, RecvTimeoutError, ServiceDaemon, ServiceEvent, ServiceInfo};
use serde::Serialize;
use sha2::{Digest, Sha256};
use weft_comm::handshake::PROTOCOL_VERSION;

use crate::control::{self, FromNode, ToNode};
use crate::heartbeat::{ControlLink, Hooks};
pub use crate::members::{Gossip, MemberInfo, MemberList, MemberReply};

/// The DNS-SD service type nodes announce.
pub const SERVICE_TYPE: &str = "_weft._tcp.local.";
/// How often each member is asked for its member list (and so checked).
pub const PROBE_EVERY: Duration = Duration::from_secs(1);
/// Silence (no answer, no heartbeat) after which a member that was up is lost.
pub const LOST_AFTER: Duration = Duration::from_secs(3);
/// Connecting and authenticating to a member.
const DIAL_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a refused member (another protocol, another secret) waits to be tried again.
const REFUSED_RETRY: Duration = Duration::from_secs(10);
/// A member lost or unreachable for this long is dropped from the table.
const FORGET_AFTER: Duration = Duration::from_secs(600);
/// How long a node waits for the next request on a member link.
const LINK_SILENCE: Duration = Duration::from_secs(10);
/// Members one table holds; a member list longer than this is cut.
pub const MAX_MEMBERS: usize = 1024;
/// Member links a node serves at once.
const MAX_MEMBER_LINKS: usize = 256;
/// Longest node name kept (characters).
const MAX_NAME: usize = 64;
const ID_DOMAIN: &[u8] = b"weft-cluster-id-v1\0";
const ID_ROUNDS: u32 = 1 << 16;

/// The public id of the cluster whose secret is `secret`: 16 hex digits.
pub fn cluster_id(secret: &[u8]) -> String {
    let mut d: [u8; 32] = Sha256::new()
        .chain_update(ID_DOMAIN)
        .chain_update(secret)
        .finalize()
        .into();
    for _ in 1..ID_ROUNDS {
        d = Sha256::digest(d).into();
    }
    hex(&d[..8])
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A fresh id for this process (64 random bits, hex): tells one node from another
/// whatever address it is reached by, and a node from itself.
pub fn instance_id() -> String {
    hex(&rand::random::<u64>().to_le_bytes())
}

/// The host name, for a node started without `--name`.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "node".into())
}

/// How a member was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// Its mDNS announcement.
    Mdns,
    /// `--join`, or another member's list.
    Join,
    /// Given to this command (`--peers`).
    Peers,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Mdns => "mdns",
            Source::Join => "join",
            Source::Peers => "peers",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// Found, not reached yet.
    Found,
    /// Answering.
    Up,
    /// Was up, then closed its connection, went silent or said goodbye.
    Lost,
    /// Never reached.
    Unreachable,
    /// Reached, and refused: another protocol version or another cluster secret.
    Refused,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Found => "found",
            State::Up => "up",
            State::Lost => "lost",
            State::Unreachable => "unreachable",
            State::Refused => "refused",
        }
    }
}

/// One member as this process sees it now.
#[derive(Clone, Debug, Serialize)]
pub struct Member {
    pub name: String,
    pub addr: String,
    /// Protocol version (0: not known yet).
    pub version: u32,
    pub id: String,
    pub found: Vec<Source>,
    pub state: State,
    /// Why it is lost, unreachable or refused.
    pub reason: Option<String>,
    /// When it last answered.
    #[serde(skip)]
    pub last_seen: Option<Instant>,
    /// Milliseconds since it last answered (None: never).
    pub silent_ms: Option<u64>,
}

struct Entry {
    info: MemberInfo,
    found: BTreeSet<Source>,
    state: State,
    reason: Option<String>,
    last_seen: Option<Instant>,
    changed: Instant,
    /// Its mDNS instance name, to match a goodbye.
    mdns_name: Option<String>,
}

impl Entry {
    fn new(info: MemberInfo, source: Source) -> Self {
        Entry {
            info,
            found: BTreeSet::from([source]),
            state: State::Found,
            reason: None,
            last_seen: None,
            changed: Instant::now(),
            mdns_name: None,
        }
    }
}

struct Shared {
    secret: Vec<u8>,
    cluster: String,
    me: Option<MemberInfo>,
    table: Mutex<BTreeMap<String, Entry>>,
    stop: AtomicBool,
    /// Member links this node serves now.
    links: AtomicUsize,
}

/// What to do with a watcher after an answer.
enum Heard {
    Keep,
    /// The address is this process, or another address of a member already up.
    Drop,
}

/// How a conversation with a member ended.
enum Ended {
    Stop,
    Lost(String),
    Refused(String),
}

impl Shared {
    fn table(&self) -> MutexGuard<'_, BTreeMap<String, Entry>> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// Sleeps `d`, waking early when stopped.
    fn sleep(&self, d: Duration) {
        let end = Instant::now() + d;
        while !self.stopped() {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            std::thread::sleep(left.min(Duration::from_millis(100)));
        }
    }

    fn is_me(&self, info: &MemberInfo) -> bool {
        self.me
            .as_ref()
            .is_some_and(|me| (!me.id.is_empty() && me.id == info.id) || me.addr == info.addr)
    }

    fn name_of(&self, addr: &str) -> String {
        self.table()
            .get(addr)
            .map(|e| e.info.name.clone())
            .unwrap_or_else(|| addr.to_string())
    }

    /// Members known to be up, for a membership request or answer.
    fn up_infos(&self) -> Vec<MemberInfo> {
        self.table()
            .values()
            .filter(|e| e.state == State::Up)
            .map(|e| e.info.clone())
            .collect()
    }

    /// Notes a member found by `source`, watching it if it is new.
    fn found(self: &Arc<Self>, info: MemberInfo, source: Source) -> Option<String> {
        if self.is_me(&info) {
            return None;
        }
        let addr = info.addr.clone();
        let mut t = self.table();
        if let Some(e) = t.get_mut(&addr) {
            e.found.insert(source);
            if e.info.name == e.info.addr && !info.name.is_empty() {
                e.info.name = info.name;
            }
            if e.info.id.is_empty() {
                e.info.id = info.id;
            }
            return Some(addr);
        }
        // Another address of a member already listed (same instance id): not a new one.
        if !info.id.is_empty() {
            if let Some(e) = t.values_mut().find(|e| e.info.id == info.id) {
                e.found.insert(source);
                return Some(e.info.addr.clone());
            }
        }
        if t.len() >= MAX_MEMBERS {
            tracing::warn!(
                "member table full ({MAX_MEMBERS}): not adding {} ({addr})",
                info.name
            );
            return None;
        }
        tracing::debug!("found {} ({addr}) by {}", info.name, source.as_str());
        t.insert(addr.clone(), Entry::new(info, source));
        drop(t);
        let (shared, a) = (self.clone(), addr.clone());
        if let Err(e) = std::thread::Builder::new()
            .name("weft-member".into())
            .spawn(move || watch(shared, a))
        {
            tracing::warn!("cannot watch member {addr}: {e}");
            self.table().remove(&addr);
            return None;
        }
        Some(addr)
    }

    fn set_state(&self, addr: &str, state: State, reason: Option<String>) {
        let mut t = self.table();
        let Some(e) = t.get_mut(addr) else {
            return;
        };
        if e.state != state {
            match (state, &reason) {
                (State::Up, _) => tracing::info!("member {} ({addr}) is up", e.info.name),
                (_, Some(r)) => {
                    tracing::info!("member {} ({addr}) {}: {r}", e.info.name, state.as_str())
                }
                (_, None) => tracing::info!("member {} ({addr}) {}", e.info.name, state.as_str()),
            }
            e.changed = Instant::now();
        }
        e.state = state;
        e.reason = reason;
    }

    /// The connection to a member ended: lost if it was up, unreachable if never reached.
    fn lost(&self, addr: &str, why: String) {
        let state = match self.table().get(addr).map(|e| e.state) {
            Some(State::Up) => State::Lost,
            Some(State::Found) | Some(State::Unreachable) => State::Unreachable,
            // Lost already (a goodbye came first) or refused: keep the first reason.
            _ => return,
        };
        self.set_state(addr, state, Some(why));
    }

    /// A dial failed: how long to wait before the next.
    fn dial_failed(&self, addr: &str, err: &str) -> Duration {
        let name = self.name_of(addr);
        if let Some(v) = peer_version(err) {
            let why = format!(
                "node {name} ({addr}) speaks protocol {v}, this build speaks {PROTOCOL_VERSION}"
            );
            if let Some(e) = self.table().get_mut(addr) {
                e.info.version = v;
            }
            self.set_state(addr, State::Refused, Some(why));
            return REFUSED_RETRY;
        }
        if err.contains("wrong cluster secret") {
            self.set_state(
                addr,
                State::Refused,
                Some(format!("node {name} ({addr}) holds another cluster secret")),
            );
            return REFUSED_RETRY;
        }
        self.lost(addr, format!("cannot connect to {addr}: {err}"));
        PROBE_EVERY
    }

    /// A member's answer: it is up, and its list names more members.
    fn heard(self: &Arc<Self>, addr: &str, list: MemberList) -> Heard {
        let me = match checked(list.me, addr, "me") {
            Ok(m) => Some(m),
            Err(e) => {
                tracing::debug!("{e}");
                None
            }
        };
        {
            let mut t = self.table();
            if let Some(m) = &me {
                let me_again = self
                    .me
                    .as_ref()
                    .is_some_and(|me| !m.id.is_empty() && me.id == m.id);
                if me_again {
                    tracing::debug!("{addr} is this node itself");
                    t.remove(addr);
                    return Heard::Drop;
                }
                // The same node by two addresses: keep the one that is up.
                let twin = t
                    .iter()
                    .find(|(a, e)| {
                        a.as_str() != addr
                            && !m.id.is_empty()
                            && e.info.id == m.id
                            && e.state == State::Up
                    })
                    .map(|(a, _)| a.clone());
                if let Some(twin) = twin {
                    let found = t.remove(addr).map(|e| e.found).unwrap_or_default();
                    if let Some(e) = t.get_mut(&twin) {
                        e.found.extend(found);
                    }
                    tracing::debug!("{addr} is {twin} by another address");
                    return Heard::Drop;
                }
            }
            let Some(e) = t.get_mut(addr) else {
                return Heard::Drop;
            };
            if let Some(m) = me {
                e.info.name = m.name;
                e.info.id = m.id;
                e.info.version = if m.version == 0 {
                    PROTOCOL_VERSION
                } else {
                    m.version
                };
            }
            e.last_seen = Some(Instant::now());
        }
        // Its list first, so that a caller waiting for every member to settle never sees
        // this one up before the members it names are listed.
        self.learn(list.members, None, addr);
        self.set_state(addr, State::Up, None);
        Heard::Keep
    }

    /// Members named by `from` (its list, or its request): each is found by `Join`. An
    /// unspecified IP is `peer_ip` (the address `from` reached us from) or skipped.
    fn learn(self: &Arc<Self>, infos: Vec<MemberInfo>, peer_ip: Option<IpAddr>, from: &str) {
        for (i, info) in infos.into_iter().take(MAX_MEMBERS).enumerate() {
            let field = if peer_ip.is_some() {
                "me".to_string()
            } else {
                format!("members[{i}]")
            };
            let mut m = match checked(info, from, &field) {
                Ok(m) => m,
                Err(e) => {
                    tracing::debug!("{e}");
                    continue;
                }
            };
            if let Ok(mut a) = m.addr.parse::<SocketAddr>() {
                if a.ip().is_unspecified() {
                    let Some(ip) = peer_ip else {
                        continue;
                    };
                    a.set_ip(ip);
                    m.addr = a.to_string();
                }
            }
            if m.version != 0 && m.version != PROTOCOL_VERSION {
                tracing::debug!(
                    "{from} names {} ({}), which speaks protocol {}",
                    m.name,
                    m.addr,
                    m.version
                );
                continue;
            }
            self.found(m, Source::Join);
        }
    }

    /// An mDNS announcement resolved.
    fn announced(
        self: &Arc<Self>,
        fullname: &str,
        txt: &BTreeMap<String, String>,
        v4: &[Ipv4Addr],
        port: u16,
    ) {
        match read_announcement(&self.cluster, txt, v4, port) {
            Announced::Foreign => {
                tracing::debug!("mDNS: {fullname} belongs to another cluster")
            }
            Announced::Malformed(e) => tracing::debug!("mDNS: {fullname}: {e}"),
            Announced::Member(info) => {
                if self.is_me(&info) {
                    return;
                }
                if let Some(addr) = self.found(info, Source::Mdns) {
                    if let Some(e) = self.table().get_mut(&addr) {
                        e.mdns_name = Some(fullname.to_string());
                    }
                }
            }
            Announced::Refused(info, why) => {
                if self.is_me(&info) {
                    return;
                }
                let addr = info.addr.clone();
                let mut t = self.table();
                if !t.contains_key(&addr) && t.len() >= MAX_MEMBERS {
                    return;
                }
                let e = t
                    .entry(addr.clone())
                    .or_insert_with(|| Entry::new(info.clone(), Source::Mdns));
                e.found.insert(Source::Mdns);
                e.info.version = info.version;
                e.mdns_name = Some(fullname.to_string());
                drop(t);
                self.set_state(&addr, State::Refused, Some(why));
            }
        }
    }

    /// An mDNS goodbye (or expiry): a member that was up has left.
    fn goodbye(&self, fullname: &str) {
        let hit = self
            .table()
            .iter()
            .find(|(_, e)| e.mdns_name.as_deref() == Some(fullname))
            .map(|(a, e)| {
                (
                    a.clone(),
                    e.state,
                    e.found.len() == 1 && e.found.contains(&Source::Mdns),
                )
            });
        match hit {
            Some((addr, State::Up, _)) => {
                self.set_state(&addr, State::Lost, Some("left (mDNS goodbye)".into()))
            }
            // A refused node that only mDNS knew of: nothing watches it, drop it.
            Some((addr, State::Refused, true)) => {
                self.table().remove(&addr);
            }
            _ => {}
        }
    }

    /// Whether the watcher of `addr` should go on: it is listed, and not lost for long.
    fn keep_watching(&self, addr: &str) -> bool {
        let mut t = self.table();
        let Some(e) = t.get(addr) else {
            return false;
        };
        if matches!(e.state, State::Lost | State::Unreachable) && e.changed.elapsed() > FORGET_AFTER
        {
            tracing::info!("forgetting member {} ({addr})", e.info.name);
            t.remove(addr);
            return false;
        }
        true
    }
}

/// The version a handshake error says the peer speaks, if it says so.
fn peer_version(err: &str) -> Option<u32> {
    let rest = err.split("speaks protocol version ").nth(1)?;
    rest.split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// A member description from the network, checked: `from` and `field` name it in errors.
fn checked(info: MemberInfo, from: &str, field: &str) -> Result<MemberInfo, String> {
    let addr: SocketAddr = info.addr.parse().map_err(|_| {
        format!(
            "member list from {from}: {field}.addr {:?} is not IP:PORT",
            truncate(&info.addr, 80)
        )
    })?;
    if addr.port() == 0 {
        return Err(format!(
            "member list from {from}: {field}.addr {addr} has port 0"
        ));
    }
    let name = clean_name(&info.name);
    let id: String = info
        .id
        .chars()
        .filter(|c| c.is_ascii_hexdigit())
        .take(32)
        .collect();
    Ok(MemberInfo {
        name: if name.is_empty() {
            addr.to_string()
        } else {
            name
        },
        addr: addr.to_string(),
        version: info.version,
        id,
    })
}

fn truncate(s: &str, n: usize) -> String {
    s.chars().take(n).collect()
}

/// A name fit to print: no control characters, at most `MAX_NAME` characters.
pub fn clean_name(s: &str) -> String {
    s.trim()
        .chars()
        .filter(|c| !c.is_control())
        .take(MAX_NAME)
        .collect()
}

/// What an mDNS announcement says.
#[derive(Debug, PartialEq)]
pub enum Announced {
    /// Another cluster's node (or no weft node): ignored.
    Foreign,
    /// A member of this cluster.
    Member(MemberInfo),
    /// A node of this cluster speaking another protocol version.
    Refused(MemberInfo, String),
    Malformed(String),
}

/// Reads a `_weft._tcp` announcement's TXT record and addresses for cluster `cluster`.
pub fn read_announcement(
    cluster: &str,
    txt: &BTreeMap<String, String>,
    v4: &[Ipv4Addr],
    port: u16,
) -> Announced {
    if txt.get("cluster").map(String::as_str) != Some(cluster) {
        return Announced::Foreign;
    }
    let given = txt
        .get("addr")
        .and_then(|a| a.parse::<SocketAddr>().ok())
        .filter(|a| !a.ip().is_unspecified() && a.port() != 0);
    let addr = match given {
        Some(a) => a,
        None => {
            // Any address it resolved to, a routable one first.
            let mut ips = v4.to_vec();
            ips.sort_by_key(|ip| (ip.is_loopback() || ip.is_link_local(), *ip));
            let Some(ip) = ips.first() else {
                return Announced::Malformed("no usable address (TXT addr or A record)".into());
            };
            if port == 0 {
                return Announced::Malformed("port 0".into());
            }
            SocketAddr::from((*ip, port))
        }
    };
    let name = clean_name(txt.get("name").map(String::as_str).unwrap_or(""));
    let id: String = txt
        .get("id")
        .map(|s| {
            s.chars()
                .filter(|c| c.is_ascii_hexdigit())
                .take(32)
                .collect()
        })
        .unwrap_or_default();
    let info = |version| MemberInfo {
        name: if name.is_empty() {
            addr.to_string()
        } else {
            name.clone()
        },
        addr: addr.to_string(),
        version,
        id: id.clone(),
    };
    let Some(proto) = txt.get("proto") else {
        return Announced::Malformed("no TXT proto".into());
    };
    match proto.parse::<u32>() {
        Ok(v) if v == PROTOCOL_VERSION => Announced::Member(info(v)),
        Ok(v) => {
            let m = info(v);
            let why = format!(
                "node {} ({}) speaks protocol {v}, this build speaks {PROTOCOL_VERSION}",
                m.name, m.addr
            );
            Announced::Refused(m, why)
        }
        Err(_) => Announced::Malformed(format!(
            "TXT proto {:?} is not a number",
            truncate(proto, 20)
        )),
    }
}

/// Watches one member until it is dropped or the membership stops: dial, converse, and
/// after a failure dial again.
fn watch(shared: Arc<Shared>, addr: String) {
    while !shared.stopped() && shared.keep_watching(&addr) {
        let wait = match control::dial(&addr, &shared.secret, DIAL_TIMEOUT) {
            Err(e) => shared.dial_failed(&addr, &e),
            Ok(stream) => {
                match ControlLink::<MemberReply, ToNode>::start(stream, &addr, Hooks::none()) {
                    Err(e) => shared.dial_failed(&addr, &e),
                    Ok(link) => match converse(&shared, &addr, &link) {
                        Ended::Stop => return,
                        Ended::Lost(why) => {
                            shared.lost(&addr, why);
                            PROBE_EVERY
                        }
                        Ended::Refused(why) => {
                            shared.set_state(&addr, State::Refused, Some(why));
                            REFUSED_RETRY
                        }
                    },
                }
            }
        };
        shared.sleep(wait);
    }
}

/// Asks `addr` for its member list every `PROBE_EVERY` until the link fails.
fn converse(shared: &Arc<Shared>, addr: &str, link: &ControlLink<MemberReply, ToNode>) -> Ended {
    loop {
        if shared.stopped() {
            return Ended::Stop;
        }
        let req = Gossip {
            me: shared.me.clone(),
            known: shared.up_infos(),
        };
        if let Err(e) = link.send(&ToNode::Members(Box::new(req))) {
            return Ended::Lost(e);
        }
        match link.recv(LOST_AFTER) {
            Ok(MemberReply::Members(list)) => {
                if let Heard::Drop = shared.heard(addr, *list) {
                    return Ended::Stop;
                }
            }
            Ok(MemberReply::Failed { error }) => {
                return Ended::Refused(format!(
                    "node {} ({addr}) answered: {error}",
                    shared.name_of(addr)
                ))
            }
            Err(e) => return Ended::Lost(e),
        }
        shared.sleep(PROBE_EVERY);
    }
}

/// How a membership starts.
#[derive(Clone, Debug, Default)]
pub struct MembershipOptions {
    pub secret: Vec<u8>,
    /// This process's own identity when it is a node: told to the members it dials, never
    /// watched itself.
    pub me: Option<MemberInfo>,
    /// Browse mDNS for this cluster's nodes (and allow `announce`).
    pub mdns: bool,
}

/// The members this process knows of, kept current by a watcher per member and, with
/// mDNS, a browser. Dropping it stops them.
pub struct Membership {
    shared: Arc<Shared>,
    daemon: Option<ServiceDaemon>,
}

impl fmt::Debug for Membership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Membership")
            .field("cluster", &self.shared.cluster)
            .field("me", &self.shared.me)
            .field("mdns", &self.daemon.is_some())
            .finish()
    }
}

/// An mDNS daemon limited to IPv4 and routable interfaces: a loopback-only node is not
/// announced, and nodes reach each other over IPv4 control addresses.
fn mdns_daemon() -> Result<ServiceDaemon, String> {
    let d = ServiceDaemon::new().map_err(|e| format!("starting mDNS: {e}"))?;
    for kind in [IfKind::IPv6, IfKind::LoopbackV4, IfKind::LoopbackV6] {
        d.disable_interface(kind)
            .map_err(|e| format!("configuring mDNS: {e}"))?;
    }
    Ok(d)
}

impl Membership {
    pub fn start(opts: MembershipOptions) -> Result<Membership, String> {
        let shared = Arc::new(Shared {
            cluster: cluster_id(&opts.secret),
            secret: opts.secret,
            me: opts.me,
            table: Mutex::new(BTreeMap::new()),
            stop: AtomicBool::new(false),
            links: AtomicUsize::new(0),
        });
        let daemon = if opts.mdns {
            let d = mdns_daemon()?;
            let rx = d
                .browse(SERVICE_TYPE)
                .map_err(|e| format!("browsing mDNS for {SERVICE_TYPE}: {e}"))?;
            let s = shared.clone();
            std::thread::Builder::new()
                .name("weft-mdns-browse".into())
                .spawn(move || {
                    while !s.stopped() {
                        match rx.recv_timeout(Duration::from_millis(200)) {
                            Ok(ServiceEvent::ServiceResolved(svc)) => {
                                let txt: BTreeMap<String, String> = svc
                                    .get_properties()
                                    .iter()
                                    .map(|p| (p.key().to_string(), p.val_str().to_string()))
                                    .collect();
                                let v4: Vec<Ipv4Addr> =
                                    svc.get_addresses_v4().into_iter().collect();
                                s.announced(svc.get_fullname(), &txt, &v4, svc.get_port());
                            }
                            Ok(ServiceEvent::ServiceRemoved(_, fullname)) => s.goodbye(&fullname),
                            Ok(_) | Err(RecvTimeoutError::Timeout) => {}
                            Err(RecvTimeoutError::Disconnected) => break,
                        }
                    }
                })
                .map_err(|e| format!("starting the mDNS browser: {e}"))?;
            Some(d)
        } else {
            None
        };
        Ok(Membership { shared, daemon })
    }

    /// The cluster id this membership announces and browses for.
    pub fn cluster_id(&self) -> &str {
        &self.shared.cluster
    }

    pub fn me(&self) -> Option<&MemberInfo> {
        self.shared.me.as_ref()
    }

    /// Adds a member by address (`--join`, `--peers`); host names are resolved once.
    pub fn add(&self, addr: &str, source: Source) -> Result<(), String> {
        let a = addr
            .to_socket_addrs()
            .map_err(|e| format!("member address {addr:?}: {e}"))?
            .next()
            .ok_or_else(|| format!("member address {addr:?} resolves to nothing"))?;
        if a.ip().is_unspecified() || a.port() == 0 {
            return Err(format!(
                "member address {addr:?}: give the IP and port it listens on"
            ));
        }
        self.shared.found(
            MemberInfo {
                name: a.to_string(),
                addr: a.to_string(),
                version: 0,
                id: String::new(),
            },
            source,
        );
        Ok(())
    }

    /// Every member known, by name.
    pub fn members(&self) -> Vec<Member> {
        let now = Instant::now();
        let mut v: Vec<Member> = self
            .shared
            .table()
            .values()
            .map(|e| Member {
                name: e.info.name.clone(),
                addr: e.info.addr.clone(),
                version: e.info.version,
                id: e.info.id.clone(),
                found: e.found.iter().copied().collect(),
                state: e.state,
                reason: e.reason.clone(),
                last_seen: e.last_seen,
                silent_ms: e
                    .last_seen
                    .map(|t| now.duration_since(t).as_millis() as u64),
            })
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name).then_with(|| a.addr.cmp(&b.addr)));
        v
    }

    /// Whether every member has been reached or given up on (none still `Found`).
    pub fn settled(&self) -> bool {
        self.shared
            .table()
            .values()
            .all(|e| e.state != State::Found)
    }

    /// Announces this node over mDNS until the announcer is stopped or dropped.
    pub fn announce(&self, a: &Announcement) -> Result<Announcer, String> {
        let daemon = self
            .daemon
            .clone()
            .ok_or("mDNS is off for this membership")?;
        Announcer::start(daemon, &self.shared.cluster, a)
    }

    /// The node's side of a member link whose first request was `first`: answer it and
    /// every later one until the link closes or goes quiet. `from` is the peer's address.
    pub fn serve_link(&self, link: &ControlLink<ToNode, FromNode>, first: Gossip, from: &str) {
        struct Count<'a>(&'a AtomicUsize);
        impl Drop for Count<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        let n = self.shared.links.fetch_add(1, Ordering::Relaxed);
        let _count = Count(&self.shared.links);
        if n >= MAX_MEMBER_LINKS {
            let _ = link.send(&FromNode::Failed {
                error: format!("busy: serving {MAX_MEMBER_LINKS} member links"),
            });
            return;
        }
        let Some(me) = self.shared.me.clone() else {
            let _ = link.send(&FromNode::Failed {
                error: "this process is not a node".into(),
            });
            return;
        };
        let peer_ip = from.parse::<SocketAddr>().ok().map(|a| a.ip());
        let mut req = first;
        loop {
            if let Some(m) = req.me.take() {
                self.shared.learn(vec![m], peer_ip, from);
            }
            self.shared
                .learn(std::mem::take(&mut req.known), None, from);
            let reply = MemberList {
                me: me.clone(),
                members: self.shared.up_infos(),
            };
            if link
                .send_as(&MemberReply::Members(Box::new(reply)))
                .is_err()
                || self.shared.stopped()
            {
                return;
            }
            match link.recv(LINK_SILENCE) {
                Ok(ToNode::Members(g)) => req = *g,
                Ok(_) => {
                    let _ = link.send(&FromNode::Failed {
                        error: "a member link carries only membership requests".into(),
                    });
                    return;
                }
                Err(e) => {
                    tracing::debug!("member link from {from} ended: {e}");
                    return;
                }
            }
        }
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(d) = &self.daemon {
            let _ = d.shutdown();
        }
    }
}

/// What a node announces.
#[derive(Clone, Debug)]
pub struct Announcement {
    pub name: String,
    /// The control address (an unspecified IP: every IPv4 address of the host).
    pub addr: SocketAddr,
    pub id: String,
}

/// A node's mDNS registration; `stop` (or dropping it) sends the goodbye.
pub struct Announcer {
    daemon: ServiceDaemon,
    fullname: String,
    stopped: AtomicBool,
}

/// A DNS label from a node name: letters, digits and dashes.
fn dns_label(s: &str) -> String {
    let l: String = s
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .take(40)
        .collect();
    let l = l.trim_matches('-').to_string();
    if l.is_empty() {
        "weft".into()
    } else {
        l
    }
}

impl Announcer {
    fn start(daemon: ServiceDaemon, cluster: &str, a: &Announcement) -> Result<Self, String> {
        let id8: String = a.id.chars().take(8).collect();
        let label = dns_label(&a.name);
        // Unique on the link even for nodes of one host with one name: the id's first digits.
        let instance = format!("{label}-{id8}");
        let host = format!("{label}-{id8}.local.");
        let ip = a.addr.ip();
        let addr_txt = if ip.is_unspecified() {
            String::new()
        } else {
            a.addr.to_string()
        };
        let name = clean_name(&a.name);
        let proto = PROTOCOL_VERSION.to_string();
        let props = [
            ("cluster", cluster),
            ("proto", proto.as_str()),
            ("addr", addr_txt.as_str()),
            ("name", name.as_str()),
            ("id", a.id.as_str()),
        ];
        let ips: Vec<IpAddr> = if ip.is_unspecified() {
            Vec::new()
        } else {
            vec![ip]
        };
        let mut info = ServiceInfo::new(
            SERVICE_TYPE,
            &instance,
            &host,
            &ips[..],
            a.addr.port(),
            &props[..],
        )
        .map_err(|e| format!("mDNS service for {}: {e}", a.addr))?;
        if ip.is_unspecified() {
            info = info.enable_addr_auto();
            info.set_interfaces(vec![IfKind::IPv4]);
        } else {
            // Only on the interface that holds the control address.
            info.set_interfaces(vec![IfKind::Addr(ip)]);
        }
        let fullname = info.get_fullname().to_string();
        daemon
            .register(info)
            .map_err(|e| format!("announcing {fullname} over mDNS: {e}"))?;
        tracing::info!("announcing {fullname} over mDNS (cluster {cluster})");
        Ok(Announcer {
            daemon,
            fullname,
            stopped: AtomicBool::new(false),
        })
    }

    pub fn fullname(&self) -> &str {
        &self.fullname
    }

    /// Withdraws the announcement (mDNS goodbye), waiting up to a second for it to go out.
    pub fn stop(&self) {
        if self.stopped.swap(true, Ordering::Relaxed) {
            return;
        }
        if let Ok(rx) = self.daemon.unregister(&self.fullname) {
            let _ = rx.recv_timeout(Duration::from_secs(1));
        }
    }
}

impl Drop for Announcer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Finds the members of the cluster of `secret`: by mDNS (when `mdns`) for `wait`, and
/// through the member lists of `peers`; each found member is dialled and reported up,
/// lost, unreachable or refused. Without mDNS it returns as soon as every member is
/// settled. The membership is returned too, so a caller can keep watching.
pub fn discover(
    secret: &[u8],
    peers: &[String],
    mdns: bool,
    wait: Duration,
) -> Result<(Membership, Vec<Member>), String> {
    let m = Membership::start(MembershipOptions {
        secret: secret.to_vec(),
        me: None,
        mdns,
    })?;
    for p in peers {
        m.add(p, Source::Peers)?;
    }
    let start = Instant::now();
    // Members found late still need their dial and first answer.
    let limit = wait + DIAL_TIMEOUT + PROBE_EVERY;
    // Without mDNS there is nothing to listen for: done once every member answered.
    let least = if mdns {
        wait
    } else {
        wait.min(Duration::from_millis(300))
    };
    while start.elapsed() < limit && !(start.elapsed() >= least && m.settled()) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let members = m.members();
    Ok((m, members))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn cluster_ids_are_stable_short_and_differ_by_secret() {
        let a = cluster_id(b"one secret");
        assert_eq!(a, cluster_id(b"one secret"));
        assert_eq!(a.len(), 16);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, cluster_id(b"another secret"));
        assert!(!a.contains("secret"));
    }

    fn txt(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn announcements_are_read_filtered_and_refused_by_version() {
        let id = cluster_id(b"s");
        let ip = [Ipv4Addr::new(10, 77, 0, 2)];
        let ok = txt(&[
            ("cluster", &id),
            ("proto", &PROTOCOL_VERSION.to_string()),
            ("addr", "10.77.0.2:7411"),
            ("name", "n1"),
            ("id", "00aa"),
        ]);
        match read_announcement(&id, &ok, &ip, 7411) {
            Announced::Member(m) => {
                assert_eq!((m.name.as_str(), m.addr.as_str()), ("n1", "10.77.0.2:7411"))
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            read_announcement(&cluster_id(b"t"), &ok, &ip, 7411),
            Announced::Foreign
        );
        // No TXT addr: the resolved address and the SRV port.
        let mut no_addr = ok.clone();
        no_addr.insert("addr".into(), String::new());
        match read_announcement(&id, &no_addr, &[Ipv4Addr::LOCALHOST, ip[0]], 7500) {
            Announced::Member(m) => assert_eq!(m.addr, "10.77.0.2:7500"),
            other => panic!("{other:?}"),
        }
        let other = PROTOCOL_VERSION + 1;
        let mut newer = ok.clone();
        newer.insert("proto".into(), other.to_string());
        match read_announcement(&id, &newer, &ip, 7411) {
            Announced::Refused(_, why) => assert_eq!(
                why,
                format!(
                    "node n1 (10.77.0.2:7411) speaks protocol {other}, this build speaks {PROTOCOL_VERSION}"
                )
            ),
            other => panic!("{other:?}"),
        }
        let mut junk = ok.clone();
        junk.insert("proto".into(), "x\u{0}".into());
        assert!(matches!(
            read_announcement(&id, &junk, &ip, 7411),
            Announced::Malformed(_)
        ));
        junk.insert("proto".into(), PROTOCOL_VERSION.to_string());
        junk.insert("name".into(), "\u{1b}[31mred\n".repeat(40));
        match read_announcement(&id, &junk, &ip, 7411) {
            Announced::Member(m) => {
                assert!(m.name.chars().all(|c| !c.is_control()) && m.name.chars().count() <= 64)
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn member_lists_from_the_network_are_checked_with_names() {
        let bad = MemberInfo {
            name: "x".into(),
            addr: "not an address".into(),
            version: 2,
            id: String::new(),
        };
        let e = checked(bad, "10.0.0.9:7411", "members[3]").unwrap_err();
        assert!(
            e.contains("10.0.0.9:7411") && e.contains("members[3].addr"),
            "{e}"
        );
        assert_eq!(
            peer_version("peer speaks protocol version 3, this build speaks 2"),
            Some(3)
        );
        assert_eq!(peer_version("connection refused"), None);
    }

    /// A stand-in node: authenticates, then serves member links with its membership.
    struct FakeNode {
        m: Arc<Membership>,
        addr: String,
        conns: Arc<Mutex<Vec<std::net::TcpStream>>>,
        dead: Arc<AtomicBool>,
    }

    impl FakeNode {
        fn start(secret: &'static [u8], name: &str) -> FakeNode {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap().to_string();
            let m = Arc::new(
                Membership::start(MembershipOptions {
                    secret: secret.to_vec(),
                    me: Some(MemberInfo {
                        name: name.into(),
                        addr: addr.clone(),
                        version: PROTOCOL_VERSION,
                        id: instance_id(),
                    }),
                    mdns: false,
                })
                .unwrap(),
            );
            let conns: Arc<Mutex<Vec<std::net::TcpStream>>> = Arc::default();
            let dead = Arc::new(AtomicBool::new(false));
            let (mm, cc, dd) = (m.clone(), conns.clone(), dead.clone());
            std::thread::spawn(move || {
                for s in l.incoming() {
                    let Ok(mut s) = s else { continue };
                    if dd.load(Ordering::Relaxed) {
                        let _ = s.shutdown(std::net::Shutdown::Both);
                        continue;
                    }
                    cc.lock().unwrap().push(s.try_clone().unwrap());
                    let mm = mm.clone();
                    std::thread::spawn(move || {
                        if control::accept(&mut s, secret, Duration::from_secs(3)).is_err() {
                            return;
                        }
                        let from = s.peer_addr().unwrap().to_string();
                        let link: ControlLink<ToNode, FromNode> =
                            ControlLink::start(s, &from, Hooks::none()).unwrap();
                        if let Ok(ToNode::Members(g)) = link.recv(Duration::from_secs(5)) {
                            mm.serve_link(&link, *g, &from);
                        }
                    });
                }
            });
            FakeNode {
                m,
                addr,
                conns,
                dead,
            }
        }

        /// As a killed process: every connection closes, new ones are closed at once.
        fn kill(&self) {
            self.dead.store(true, Ordering::Relaxed);
            self.m.shared.stop.store(true, Ordering::Relaxed);
            for c in self.conns.lock().unwrap().iter() {
                let _ = c.shutdown(std::net::Shutdown::Both);
            }
        }
    }

    /// A node that answers the first membership request, then neither answers nor beats
    /// (a stopped process, a cut cable): its connections stay open.
    fn stalling_node(secret: &'static [u8], name: &'static str) -> String {
        use std::io::{Read, Write};
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let a = addr.clone();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            let mut answered = false;
            for s in l.incoming() {
                let Ok(mut s) = s else { continue };
                if control::accept(&mut s, secret, Duration::from_secs(3)).is_err() {
                    continue;
                }
                if !answered {
                    answered = true;
                    // Skip frames until the request, then send one answer.
                    loop {
                        let mut len = [0u8; 4];
                        s.read_exact(&mut len).unwrap();
                        let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
                        s.read_exact(&mut body).unwrap();
                        if String::from_utf8_lossy(&body).contains("Members") {
                            break;
                        }
                    }
                    let reply = serde_json::json!({"Msg": {"Members": {
                        "me": {"name": name, "addr": a, "version": PROTOCOL_VERSION, "id": "ab"},
                        "members": []}}});
                    let body = serde_json::to_vec(&reply).unwrap();
                    s.write_all(&(body.len() as u32).to_le_bytes()).unwrap();
                    s.write_all(&body).unwrap();
                }
                held.push(s);
            }
        });
        addr
    }

    fn state_of(m: &[Member], name: &str) -> Option<State> {
        m.iter().find(|x| x.name == name).map(|x| x.state)
    }

    fn wait_until(what: impl Fn() -> bool) {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(10) && !what() {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    const S: &[u8] = b"a test secret that is long enough";

    #[test]
    fn joined_nodes_list_each_other_and_a_killed_one_is_lost_by_name() {
        let a = FakeNode::start(S, "alpha");
        let b = FakeNode::start(S, "beta");
        b.m.add(&a.addr, Source::Join).unwrap();
        wait_until(|| {
            state_of(&a.m.members(), "beta") == Some(State::Up)
                && state_of(&b.m.members(), "alpha") == Some(State::Up)
        });
        assert_eq!(
            state_of(&a.m.members(), "beta"),
            Some(State::Up),
            "{:?}",
            a.m.members()
        );
        assert_eq!(state_of(&b.m.members(), "alpha"), Some(State::Up));
        // A tool that knows only alpha learns of beta through alpha's list.
        let (watch, found) = discover(
            S,
            std::slice::from_ref(&a.addr),
            false,
            Duration::from_secs(5),
        )
        .unwrap();
        let names: Vec<_> = found.iter().map(|m| (m.name.as_str(), m.state)).collect();
        assert_eq!(
            names,
            [("alpha", State::Up), ("beta", State::Up)],
            "{found:?}"
        );
        assert!(found
            .iter()
            .any(|m| m.addr == b.addr && m.found == [Source::Join]));
        assert!(found
            .iter()
            .any(|m| m.addr == a.addr && m.found.contains(&Source::Peers)));
        b.kill();
        let t = Instant::now();
        wait_until(|| state_of(&watch.members(), "beta") == Some(State::Lost));
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        let beta = watch
            .members()
            .into_iter()
            .find(|m| m.name == "beta")
            .unwrap();
        assert_eq!(beta.state, State::Lost, "{beta:?}");
        assert!(beta.reason.is_some());
        wait_until(|| state_of(&a.m.members(), "beta") == Some(State::Lost));
        assert_eq!(state_of(&a.m.members(), "beta"), Some(State::Lost));
        assert_eq!(state_of(&watch.members(), "alpha"), Some(State::Up));
    }

    #[test]
    fn a_silent_member_is_lost_within_seconds() {
        let addr = stalling_node(S, "quiet");
        let watch = Membership::start(MembershipOptions {
            secret: S.to_vec(),
            ..Default::default()
        })
        .unwrap();
        watch.add(&addr, Source::Peers).unwrap();
        wait_until(|| state_of(&watch.members(), "quiet") == Some(State::Up));
        let up = Instant::now();
        assert_eq!(state_of(&watch.members(), "quiet"), Some(State::Up));
        wait_until(|| state_of(&watch.members(), "quiet") == Some(State::Lost));
        let m = &watch.members()[0];
        assert_eq!(m.state, State::Lost, "{m:?}");
        assert!(
            m.reason
                .as_deref()
                .unwrap()
                .contains("no message or heartbeat"),
            "{m:?}"
        );
        assert!(up.elapsed() < Duration::from_secs(8), "{:?}", up.elapsed());
    }

    #[test]
    fn other_protocol_versions_and_other_secrets_are_refused_by_name() {
        let watch = Membership::start(MembershipOptions {
            secret: S.to_vec(),
            ..Default::default()
        })
        .unwrap();
        // A node of another protocol version: refused, both versions named.
        let old = TcpListener::bind("127.0.0.1:0").unwrap();
        let old_addr = old.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            use std::io::{Read, Write};
            for s in old.incoming() {
                let Ok(mut s) = s else { continue };
                let mut hello = [0u8; 53];
                let _ = s.read_exact(&mut hello);
                let mut h = weft_comm::handshake::Hello::new(1, 2);
                h.version = PROTOCOL_VERSION + 1;
                let _ = s.write_all(&h.encode());
            }
        });
        watch.add(&old_addr, Source::Peers).unwrap();
        // Another cluster's node, given by address.
        let c = FakeNode::start(b"another secret, also long enough!", "gamma");
        watch.add(&c.addr, Source::Peers).unwrap();
        wait_until(|| watch.settled());
        let ms = watch.members();
        let old_m = ms.iter().find(|m| m.addr == old_addr).unwrap();
        assert_eq!(old_m.state, State::Refused);
        let why = old_m.reason.as_deref().unwrap();
        assert_eq!(
            why,
            format!(
                "node {old_addr} ({old_addr}) speaks protocol {}, this build speaks {PROTOCOL_VERSION}",
                PROTOCOL_VERSION + 1
            )
        );
        let c_m = ms.iter().find(|m| m.addr == c.addr).unwrap();
        assert_eq!(c_m.state, State::Refused);
        assert!(c_m
            .reason
            .as_deref()
            .unwrap()
            .contains("another cluster secret"));
    }
}
