//! `weft cluster status`: the members of a cluster as this machine finds them (mDNS, and
//! the member lists of `--peers`), each reached over the secret's handshake and shown up,
//! lost, unreachable or refused; `--watch` goes on printing every change. Also the node's
//! side of membership (`weft node --name/--join/--no-mdns`): the member list it keeps, its
//! mDNS announcement, and the goodbye it sends on SIGINT or SIGTERM.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use clap::{Args, Subcommand};
use serde::Serialize;
use weft_cluster::discovery::{
    self, Announcement, Member, MemberInfo, Membership, MembershipOptions, Source, State,
};
use weft_comm::handshake::PROTOCOL_VERSION;

#[derive(Subcommand, Debug)]
pub enum ClusterCmd {
    /// List the cluster's members: found by mDNS and through the member lists of --peers,
    /// each reached with the secret and shown up, lost, unreachable or refused.
    Status(StatusArgs),
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// Cluster secret (or WEFT_SECRET).
    #[arg(long)]
    pub secret: Option<String>,
    /// Nodes to ask, comma-separated control addresses; their member lists name the rest.
    #[arg(long, value_delimiter = ',')]
    pub peers: Vec<String>,
    /// Seconds to listen for mDNS announcements (without mDNS: at most this long for the
    /// members to answer).
    #[arg(long, default_value_t = 3.0)]
    pub wait: f64,
    /// Do not browse mDNS: only --peers and the members they name.
    #[arg(long)]
    pub no_mdns: bool,
    /// One JSON object: `cluster_id`, `protocol`, `members` (with --watch, then one line
    /// per change: `{"event": STATE, "member": {...}}`).
    #[arg(long)]
    pub json: bool,
    /// After the list, keep watching and print each change (a member found, up, lost,
    /// refused) as it happens, until interrupted.
    #[arg(long)]
    pub watch: bool,
    /// Also ask every member that is up for its profile (memory, cores, disk, model
    /// files, kernel speeds) and measure the links between all of them (a survey; a node
    /// busy serving a coordinator cannot answer it).
    #[arg(long)]
    pub measure: bool,
}

pub fn run(cmd: ClusterCmd) -> Result<()> {
    match cmd {
        ClusterCmd::Status(a) => status(a),
    }
}

/// One member as `weft cluster status` shows it. Later fields (the node's profile, its
/// links' measurements) go beside the membership ones.
#[derive(Serialize)]
struct MemberOut<'a> {
    #[serde(flatten)]
    member: &'a Member,
    /// The models it caches pieces of (members that are up and answered).
    #[serde(skip_serializing_if = "Option::is_none")]
    shard_cache: Option<&'a Vec<weft_share::CacheEntry>>,
}

#[derive(Serialize)]
struct StatusOut<'a> {
    cluster_id: &'a str,
    protocol: u32,
    members: Vec<MemberOut<'a>>,
}

fn found_str(m: &Member) -> String {
    m.found
        .iter()
        .map(|s| s.as_str())
        .collect::<Vec<_>>()
        .join(",")
}

fn status(a: StatusArgs) -> Result<()> {
    let secret = crate::cluster_secret::secret_from(&a.secret)?;
    if a.no_mdns && a.peers.is_empty() {
        bail!("with --no-mdns, give --peers ADDR[,ADDR...] (any member's control address)");
    }
    if !(a.wait.is_finite() && (0.0..=3600.0).contains(&a.wait)) {
        bail!("--wait {}: give seconds between 0 and 3600", a.wait);
    }
    let (membership, members) = discovery::discover(
        secret.as_bytes(),
        &a.peers,
        !a.no_mdns,
        Duration::from_secs_f64(a.wait),
    )
    .map_err(|e| anyhow!(e))?;
    let id = membership.cluster_id().to_string();
    let up: Vec<String> = members
        .iter()
        .filter(|m| m.state == State::Up)
        .map(|m| m.addr.clone())
        .collect();
    // Each member's shard cache, asked over its share channel (None: it did not answer).
    let caches: BTreeMap<String, Vec<weft_share::CacheEntry>> = up
        .iter()
        .filter_map(|addr| {
            weft_cluster::share::list_caches(addr, secret.as_bytes())
                .ok()
                .map(|c| (addr.clone(), c))
        })
        .collect();
    let survey = if a.measure && !up.is_empty() {
        let opts = weft_cluster::survey::SurveyOptions {
            secret: secret.as_bytes().to_vec(),
            transport: "auto".into(),
            link_delay_us: 0.0,
            timeout: Duration::from_secs(2),
            // 0: each node times its kernels with its own thread count.
            threads_per_node: 0,
            pings: 200,
            bulk: 1 << 20,
            fresh: false,
            activity: None,
        };
        Some(weft_cluster::survey::survey(&up, &opts).map_err(|e| anyhow!("measuring: {e}"))?)
    } else {
        None
    };
    if a.json {
        let out = StatusOut {
            cluster_id: &id,
            protocol: PROTOCOL_VERSION,
            members: members
                .iter()
                .map(|m| MemberOut {
                    member: m,
                    shard_cache: caches.get(&m.addr),
                })
                .collect(),
        };
        let mut v = serde_json::to_value(&out)?;
        if let Some(s) = &survey {
            v["survey"] = serde_json::to_value(s)?;
        }
        outln!("{v}")?;
    } else {
        print_table(&id, &members)?;
        print_caches(&members, &caches)?;
        if let Some(s) = &survey {
            print_survey(s)?;
        }
        if members.is_empty() {
            eprintln!(
                "no members found{}: is a node running with this secret? Where multicast \
                 does not reach, give --peers ADDR",
                if a.no_mdns {
                    String::new()
                } else {
                    format!(" by mDNS in {} s", a.wait)
                }
            );
        }
    }
    if a.watch {
        watch(&membership, members, a.json)?;
    }
    Ok(())
}

fn print_table(id: &str, members: &[Member]) -> Result<()> {
    let up = members.iter().filter(|m| m.state == State::Up).count();
    outln!(
        "cluster {id} (protocol {PROTOCOL_VERSION}): {} members, {up} up",
        members.len()
    )?;
    if members.is_empty() {
        return Ok(());
    }
    let rows: Vec<[String; 6]> = members
        .iter()
        .map(|m| {
            [
                m.name.clone(),
                m.addr.clone(),
                if m.version == 0 {
                    "?".into()
                } else {
                    m.version.to_string()
                },
                found_str(m),
                m.state.as_str().to_string(),
                m.reason.clone().unwrap_or_default(),
            ]
        })
        .collect();
    let head = ["NAME", "ADDRESS", "PROTO", "FOUND", "STATE", "REASON"];
    let mut w = head.map(str::len);
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |cells: [&str; 6]| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate().take(5) {
            s.push_str(&format!("{c:<width$}  ", width = w[i]));
        }
        s.push_str(cells[5]);
        s.trim_end().to_string()
    };
    outln!("{}", line(head))?;
    for r in &rows {
        outln!("{}", line(r.each_ref().map(String::as_str)))?;
    }
    Ok(())
}

/// Each member's shard cache: the models it holds pieces of, on disk against whole.
fn print_caches(
    members: &[Member],
    caches: &BTreeMap<String, Vec<weft_share::CacheEntry>>,
) -> Result<()> {
    use weft_model::memory::human_bytes;
    for m in members {
        let Some(c) = caches.get(&m.addr).filter(|c| !c.is_empty()) else {
            continue;
        };
        outln!("shard cache of {}:", m.name)?;
        for e in c {
            outln!(
                "  {} ({}): {} of {} held, used {} s ago",
                e.model,
                e.root.get(..16).unwrap_or("?"),
                human_bytes(e.disk_bytes as u128),
                human_bytes(e.model_bytes as u128),
                e.idle_s
            )?;
        }
    }
    Ok(())
}

/// The members' profiles and the link matrix (rank 0: this process).
fn print_survey(s: &weft_cluster::survey::Survey) -> Result<()> {
    outln!("profiles:")?;
    for (addr, n) in s.peers.iter().zip(&s.nodes) {
        let q4k = n
            .rates
            .iter()
            .find(|r| r.ty == "Q4_K")
            .map_or(0.0, |r| r.decode_bytes_per_s / 1e9);
        outln!(
            "  {} ({addr}): {} {} {}, {} cores ({} threads), memory {:.1} of {:.1} GB free{}, \
             disk {} free, {} model files, Q4_K decode {q4k:.1} GB/s",
            n.name,
            n.cpu,
            n.os,
            n.arch,
            n.cores,
            n.threads,
            n.memory_available as f64 / 1e9,
            n.memory_total as f64 / 1e9,
            n.memory_limit
                .map(|l| format!(" (limit {:.1} GB)", l as f64 / 1e9))
                .unwrap_or_default(),
            n.disk_free
                .map(|d| format!("{:.1} GB", d as f64 / 1e9))
                .unwrap_or_else(|| "?".into()),
            n.models.len()
        )?;
    }
    outln!("links (round trip µs / GB/s; row and column 0 are this process):")?;
    for (i, row) in s.links.rtt_us.iter().enumerate() {
        let cells: Vec<String> = row
            .iter()
            .zip(&s.links.bandwidth_gb_s[i])
            .map(|(r, b)| format!("{r:>8.1}/{b:<5.1}"))
            .collect();
        outln!("  {i:>3} {}", cells.join(" ").trim_end())?;
    }
    Ok(())
}

/// Prints every change of a member's state from `before` on, until interrupted.
fn watch(m: &Membership, before: Vec<Member>, json: bool) -> Result<()> {
    let mut seen: BTreeMap<String, State> = before.into_iter().map(|x| (x.addr, x.state)).collect();
    loop {
        std::thread::sleep(Duration::from_millis(200));
        for x in m.members() {
            if seen.get(&x.addr) == Some(&x.state) {
                continue;
            }
            seen.insert(x.addr.clone(), x.state);
            if json {
                #[derive(Serialize)]
                struct Event<'a> {
                    event: &'a str,
                    member: MemberOut<'a>,
                }
                let e = Event {
                    event: x.state.as_str(),
                    member: MemberOut {
                        member: &x,
                        shard_cache: None,
                    },
                };
                outln!("{}", serde_json::to_string(&e)?)?;
            } else {
                match &x.reason {
                    Some(r) => outln!("{} {} {}: {r}", x.state.as_str(), x.name, x.addr)?,
                    None => outln!(
                        "{} {} {} (found by {})",
                        x.state.as_str(),
                        x.name,
                        x.addr,
                        found_str(&x)
                    )?,
                }
            }
        }
    }
}

/// `weft node`'s membership: the member list it keeps and answers from, its mDNS
/// announcement and browsing (unless `no_mdns`, or it listens on loopback only), and the
/// members named by `--join`. With mDNS, SIGINT and SIGTERM withdraw the announcement
/// (a goodbye, so browsers see the node leave at once) before the process exits.
pub fn node_membership(
    secret: &str,
    listen: SocketAddr,
    name: Option<&str>,
    join: &[String],
    no_mdns: bool,
) -> Result<Arc<Membership>> {
    let name = discovery::clean_name(
        &name
            .map(str::to_string)
            .unwrap_or_else(discovery::host_name),
    );
    if name.is_empty() {
        bail!("--name: give a name with at least one printable character");
    }
    let id = discovery::instance_id();
    let loopback = listen.ip().is_loopback();
    if loopback && !no_mdns {
        tracing::info!("listening on loopback only: not announced over mDNS");
    }
    let mdns = !no_mdns && !loopback;
    // Before any thread starts, so every thread inherits the mask: the two signals then
    // reach only the thread that says goodbye.
    let signals = if mdns { block_exit_signals() } else { None };
    let m = Arc::new(
        Membership::start(MembershipOptions {
            secret: secret.as_bytes().to_vec(),
            me: Some(MemberInfo {
                name: name.clone(),
                addr: listen.to_string(),
                version: PROTOCOL_VERSION,
                id: id.clone(),
            }),
            mdns,
        })
        .map_err(|e| anyhow!(e))?,
    );
    if mdns {
        match m.announce(&Announcement {
            name: name.clone(),
            addr: listen,
            id,
        }) {
            Ok(announcer) => match signals {
                Some(set) => goodbye_on_signal(set, announcer)?,
                // No signal thread: the announcement lasts as long as the process.
                None => std::mem::forget(announcer),
            },
            Err(e) => tracing::warn!("not announced over mDNS: {e}"),
        }
    }
    for j in join {
        m.add(j, Source::Join)
            .map_err(|e| anyhow!("--join {j}: {e}"))?;
    }
    tracing::info!(
        "node {name}, cluster {}{}",
        m.cluster_id(),
        if join.is_empty() {
            String::new()
        } else {
            format!(", joining {}", join.join(", "))
        }
    );
    Ok(m)
}

/// Blocks SIGINT and SIGTERM in this thread (and so in every thread started after).
fn block_exit_signals() -> Option<libc::sigset_t> {
    // SAFETY: the set is initialised by sigemptyset before use; pthread_sigmask only
    // changes this thread's mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        if libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
            return None;
        }
        Some(set)
    }
}

/// A thread that waits for SIGINT or SIGTERM, sends the mDNS goodbye and exits.
fn goodbye_on_signal(set: libc::sigset_t, announcer: discovery::Announcer) -> Result<()> {
    std::thread::Builder::new()
        .name("weft-signals".into())
        .spawn(move || {
            let mut sig: libc::c_int = 0;
            // SAFETY: `set` holds the signals blocked above; sigwait writes `sig`.
            let rc = unsafe { libc::sigwait(&set, &mut sig) };
            tracing::info!(
                "signal {sig} (rc {rc}): withdrawing {} and stopping",
                announcer.fullname()
            );
            announcer.stop();
            std::process::exit(0);
        })
        .map(|_| ())
        .map_err(|e| anyhow!("starting the signal thread: {e}"))
}
