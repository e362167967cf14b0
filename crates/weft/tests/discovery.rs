//! Membership across real hosts' worth of isolation: each node runs in its own network
//! namespace with its own address on a private bridge (10.77.0.0/24), as machines on one
//! LAN would. Nodes find each other by mDNS with no address typed, by `--join` where
//! multicast is off, ignore another cluster's nodes, and a killed node is reported lost by
//! name. Needs root (`ip netns`); elsewhere each test prints `skipping:` and passes.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

const SECRET: &str = "discovery-test-secret-7f3a9c1e5b2d8f4a6c0e9b7d5f3a1c8e";
const OTHER_SECRET: &str = "another-cluster-secret-2b4d6f8a0c1e3a5c7e9f1b3d5a7c9e0f";
/// Generous: what the tests wait for at most, never what they expect.
const PATIENCE: Duration = Duration::from_secs(10);

fn weft_bin() -> &'static str {
    env!("CARGO_BIN_EXE_weft")
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// N network namespaces, each with one veth (`eth0`, 10.77.0.(i+2)/24) on a bridge of
/// its own, and the weft processes started in them. Dropping it kills the processes and
/// removes namespaces, veths and bridge, whether the test passed or not.
struct Net {
    ns: Vec<String>,
    veths: Vec<String>,
    bridge: Option<String>,
    children: Vec<(String, Child)>,
    logs: tempfile::TempDir,
}

impl Drop for Net {
    fn drop(&mut self) {
        for (_, c) in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for v in &self.veths {
            let _ = ip(&["link", "del", v]);
        }
        for n in &self.ns {
            let _ = ip(&["netns", "del", n]);
        }
        if let Some(b) = &self.bridge {
            let _ = ip(&["link", "del", b]);
        }
    }
}

impl Net {
    /// `letter` tells this test's names from the others' (tests run in parallel), the
    /// process id from another run's. None (after a `skipping:` line) without `ip netns`.
    fn new(letter: char, n: usize, multicast: bool) -> Option<Net> {
        let tag = format!("wd{}{letter}", std::process::id() % 100_000);
        let mut net = Net {
            ns: Vec::new(),
            veths: Vec::new(),
            bridge: None,
            children: Vec::new(),
            logs: tempfile::tempdir().unwrap(),
        };
        let first = format!("{tag}-0");
        if let Err(e) = ip(&["netns", "add", &first]) {
            eprintln!("skipping: network namespaces are not available here ({e})");
            return None;
        }
        net.ns.push(first);
        let bridge = format!("{tag}br");
        ip(&["link", "add", &bridge, "type", "bridge"]).unwrap();
        net.bridge = Some(bridge.clone());
        // Multicast snooping off: with no IGMP querier on this bridge, a snooping bridge
        // may stop forwarding a group once it has seen joins but no queries; mDNS's
        // 224.0.0.251 is link-local and flooded anyway, this just removes the doubt.
        ip(&[
            "link",
            "set",
            &bridge,
            "type",
            "bridge",
            "mcast_snooping",
            "0",
        ])
        .unwrap();
        ip(&["link", "set", &bridge, "up"]).unwrap();
        for i in 0..n {
            let ns = format!("{tag}-{i}");
            if i > 0 {
                ip(&["netns", "add", &ns]).unwrap();
                net.ns.push(ns.clone());
            }
            let veth = format!("{tag}{i}");
            ip(&[
                "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ])
            .unwrap();
            net.veths.push(veth.clone());
            ip(&["link", "set", &veth, "master", &bridge]).unwrap();
            let addr = format!("{}/24", net.ip(i));
            for args in [
                vec!["link", "set", &veth, "up"],
                vec!["-n", &ns, "link", "set", "lo", "up"],
                vec!["-n", &ns, "addr", "add", &addr, "dev", "eth0"],
                vec!["-n", &ns, "link", "set", "eth0", "up"],
            ] {
                ip(&args).unwrap();
            }
            if !multicast {
                // No multicast on either end: mDNS cannot work here, only --join can.
                ip(&["link", "set", &veth, "multicast", "off"]).unwrap();
                ip(&["-n", &ns, "link", "set", "eth0", "multicast", "off"]).unwrap();
            }
            // No route is needed for mDNS: the responder sends on each interface it
            // joined the group on (IP_MULTICAST_IF), never by the routing table.
        }
        Some(net)
    }

    fn ip(&self, i: usize) -> String {
        format!("10.77.0.{}", i + 2)
    }

    fn addr(&self, i: usize) -> String {
        format!("{}:7411", self.ip(i))
    }

    /// `weft ARGS` inside namespace `i`.
    fn command(&self, i: usize, args: &[&str]) -> Command {
        let ns = File::open(format!("/var/run/netns/{}", self.ns[i])).unwrap();
        let mut cmd = Command::new(weft_bin());
        cmd.args(args)
            .env_remove("WEFT_SECRET")
            .stdin(Stdio::null());
        use std::os::unix::process::CommandExt;
        let fd = ns.as_raw_fd();
        // SAFETY: setns is a plain system call (async-signal-safe) on a descriptor that
        // stays open as long as the command: the closure owns `ns`.
        unsafe {
            cmd.pre_exec(move || {
                let _keep = &ns;
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd
    }

    fn log(&self, what: &str) -> File {
        File::create(self.logs.path().join(format!("{what}.log"))).unwrap()
    }

    /// Everything the processes logged, for a failure message.
    fn logs(&self) -> String {
        let mut s = String::new();
        let mut paths: Vec<PathBuf> = std::fs::read_dir(self.logs.path())
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .collect();
        paths.sort();
        for p in paths {
            s += &format!(
                "--- {}\n{}\n",
                p.display(),
                std::fs::read_to_string(&p).unwrap_or_default()
            );
        }
        s
    }

    /// Starts `weft node` named `name` in namespace `i` on its address, port 7411; waits
    /// for it to listen.
    fn node(&mut self, i: usize, name: &str, secret: &str, extra: &[&str]) {
        let addr = self.addr(i);
        let mut args = vec![
            "node", "--listen", &addr, "--secret", secret, "--name", name,
        ];
        args.extend_from_slice(extra);
        let mut child = self
            .command(i, &args)
            .env("WEFT_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(self.log(&format!("node-{name}")))
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        self.children.push((name.to_string(), child));
        let mut line = String::new();
        BufReader::new(out).read_line(&mut line).unwrap();
        assert!(
            line.starts_with("listening on"),
            "node {name} printed {line:?}\n{}",
            self.logs()
        );
    }

    fn child(&mut self, name: &str) -> &mut Child {
        &mut self.children.iter_mut().find(|(n, _)| n == name).unwrap().1
    }

    /// `weft cluster status --json ARGS` in namespace `i`, its JSON.
    fn status(&self, i: usize, secret: &str, extra: &[&str]) -> Value {
        let mut args = vec!["cluster", "status", "--json", "--secret", secret];
        args.extend_from_slice(extra);
        let out: Output = self.command(i, &args).output().unwrap();
        assert!(
            out.status.success(),
            "status failed: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.logs()
        );
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("bad JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
    }

    /// `weft cluster status --watch --json ARGS` in namespace `i`: its lines as they come.
    fn watch(&mut self, i: usize, extra: &[&str]) -> Watch {
        let mut args = vec!["cluster", "status", "--watch", "--json", "--secret", SECRET];
        args.extend_from_slice(extra);
        let mut child = self
            .command(i, &args)
            .stdout(Stdio::piped())
            .stderr(self.log("watch"))
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        self.children.push(("watch".into(), child));
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                let v: Value = serde_json::from_str(&line)
                    .unwrap_or_else(|e| panic!("bad JSON line ({e}): {line}"));
                if tx.send(v).is_err() {
                    break;
                }
            }
        });
        Watch {
            rx,
            states: Default::default(),
        }
    }
}

/// (name, state) of every member a status listed.
fn listed(v: &Value) -> Vec<(String, String)> {
    v["members"]
        .as_array()
        .unwrap_or_else(|| panic!("no members in {v}"))
        .iter()
        .map(|m| {
            (
                m["name"].as_str().unwrap().to_string(),
                m["state"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn member<'a>(v: &'a Value, name: &str) -> &'a Value {
    v["members"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == name)
        .unwrap_or_else(|| panic!("{name} not listed: {v}"))
}

fn found_by(m: &Value, how: &str) -> bool {
    m["found"].as_array().unwrap().iter().any(|f| f == how)
}

/// A `weft cluster status --watch --json`'s lines, and each member's latest state.
struct Watch {
    rx: mpsc::Receiver<Value>,
    states: std::collections::BTreeMap<String, Value>,
}

impl Watch {
    /// Waits (at most `PATIENCE`) until member `name` is `state`; its member object.
    fn until(&mut self, name: &str, state: &str) -> Option<Value> {
        let end = Instant::now() + PATIENCE;
        loop {
            if let Some(m) = self.states.get(name).filter(|m| m["state"] == state) {
                return Some(m.clone());
            }
            let left = end.checked_duration_since(Instant::now())?;
            let v = self.rx.recv_timeout(left).ok()?;
            // The first line lists every member; each later one is one member's change.
            let members = match v["members"].as_array() {
                Some(all) => all.clone(),
                None => vec![v["member"].clone()],
            };
            for m in members {
                if let Some(n) = m["name"].as_str() {
                    self.states.insert(n.to_string(), m);
                }
            }
        }
    }
}

#[test]
fn nodes_find_each_other_by_mdns_with_no_address_typed() {
    let Some(mut net) = Net::new('a', 3, true) else {
        return;
    };
    net.node(0, "n1", SECRET, &[]);
    net.node(1, "n2", SECRET, &[]);
    let t = Instant::now();
    let v = net.status(2, SECRET, &["--wait", "4"]);
    eprintln!("status by mDNS took {:.1} s", t.elapsed().as_secs_f64());
    assert_eq!(
        listed(&v),
        [("n1".into(), "up".into()), ("n2".into(), "up".into())],
        "{v}\n{}",
        net.logs()
    );
    for (i, name) in [(0, "n1"), (1, "n2")] {
        let m = member(&v, name);
        assert_eq!(m["addr"], net.addr(i));
        assert_eq!(m["version"], weft_comm::handshake::PROTOCOL_VERSION);
        assert!(found_by(m, "mdns"), "{m}");
    }
    assert_eq!(v["protocol"], weft_comm::handshake::PROTOCOL_VERSION);
    assert_eq!(v["cluster_id"].as_str().unwrap().len(), 16);
    assert!(!v.to_string().contains(SECRET));

    // A node stopped cleanly (SIGTERM) says goodbye and is reported lost; it exits 0.
    let mut w = net.watch(2, &["--wait", "4"]);
    assert!(w.until("n2", "up").is_some(), "{}", net.logs());
    let pid = net.child("n2").id() as i32;
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let t = Instant::now();
    let ev = w.until("n2", "lost");
    assert!(ev.is_some(), "n2 not reported lost\n{}", net.logs());
    eprintln!(
        "n2 (SIGTERM) reported lost after {:.2} s",
        t.elapsed().as_secs_f64()
    );
    let status = net.child("n2").wait().unwrap();
    assert!(status.success(), "n2 exited {status}\n{}", net.logs());
    let n2_log = std::fs::read_to_string(net.logs.path().join("node-n2.log")).unwrap();
    assert!(n2_log.contains("withdrawing"), "{n2_log}");
}

#[test]
fn without_multicast_nodes_join_by_address_and_share_member_lists() {
    let Some(mut net) = Net::new('b', 4, false) else {
        return;
    };
    // A chain: n2 knows only n1, n3 only n2; the member lists fill in the rest.
    net.node(0, "n1", SECRET, &["--no-mdns"]);
    let (a1, a2) = (net.addr(0), net.addr(1));
    net.node(1, "n2", SECRET, &["--no-mdns", "--join", &a1]);
    net.node(2, "n3", SECRET, &["--no-mdns", "--join", &a2]);
    let want: Vec<(String, String)> = ["n1", "n2", "n3"]
        .iter()
        .map(|n| (n.to_string(), "up".to_string()))
        .collect();
    // Gossip takes a probe round or two per hop: ask until it has spread.
    let end = Instant::now() + PATIENCE;
    let mut v;
    loop {
        v = net.status(3, SECRET, &["--no-mdns", "--peers", &a1, "--wait", "3"]);
        if listed(&v) == want || Instant::now() > end {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(listed(&v), want, "{v}\n{}", net.logs());
    assert!(found_by(member(&v, "n1"), "peers"));
    for name in ["n2", "n3"] {
        let m = member(&v, name);
        assert!(found_by(m, "join"), "{m}");
        assert!(!found_by(m, "mdns"), "{m}");
    }
    assert_eq!(member(&v, "n3")["addr"], net.addr(2));
    // From the other end of the chain, the same members.
    let v = net.status(3, SECRET, &["--no-mdns", "--peers", &net.addr(2)]);
    assert_eq!(listed(&v), want, "{v}");
}

#[test]
fn another_clusters_node_is_not_listed() {
    let Some(mut net) = Net::new('c', 3, true) else {
        return;
    };
    net.node(0, "n1", SECRET, &[]);
    net.node(1, "stranger", OTHER_SECRET, &[]);
    let v = net.status(2, SECRET, &["--wait", "4"]);
    assert_eq!(
        listed(&v),
        [("n1".into(), "up".into())],
        "{v}\n{}",
        net.logs()
    );
    // The stranger's own cluster sees it, and not n1.
    let v = net.status(2, OTHER_SECRET, &["--wait", "4"]);
    assert_eq!(listed(&v), [("stranger".into(), "up".into())], "{v}");
    // Named by address, it is refused, and says why.
    let a = net.addr(1);
    let v = net.status(2, SECRET, &["--no-mdns", "--peers", &a]);
    let m = &v["members"][0];
    assert_eq!(m["state"], "refused", "{v}");
    assert!(
        m["reason"]
            .as_str()
            .unwrap()
            .contains("another cluster secret"),
        "{v}"
    );
}

#[test]
fn a_killed_node_is_reported_lost_by_name() {
    let Some(mut net) = Net::new('d', 3, true) else {
        return;
    };
    net.node(0, "n1", SECRET, &[]);
    let a1 = net.addr(0);
    net.node(1, "n2", SECRET, &["--join", &a1]);
    // Watch from a third namespace, through n1's member list and mDNS alike.
    let mut w = net.watch(2, &["--peers", &a1, "--wait", "2"]);
    assert!(w.until("n1", "up").is_some(), "{}", net.logs());
    assert!(w.until("n2", "up").is_some(), "{}", net.logs());
    net.child("n2").kill().unwrap(); // SIGKILL: no goodbye, no clean close by weft
    let t = Instant::now();
    let ev = w.until("n2", "lost");
    let took = t.elapsed();
    let ev = ev.unwrap_or_else(|| panic!("n2 not reported lost in {PATIENCE:?}\n{}", net.logs()));
    eprintln!(
        "n2 (SIGKILL) reported lost after {:.2} s",
        took.as_secs_f64()
    );
    assert_eq!(ev["addr"], net.addr(1));
    assert!(ev["reason"].is_string(), "{ev}");
    // n1 is still up: a later status through it lists it, and not n2 as up.
    let v = net.status(2, SECRET, &["--no-mdns", "--peers", &a1]);
    assert!(!listed(&v).contains(&("n2".into(), "up".into())), "{v}");
    assert_eq!(member(&v, "n1")["state"], "up");
}
