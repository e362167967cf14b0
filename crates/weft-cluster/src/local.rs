//! The local cluster that `--nodes N` starts: N `weft node` child processes on this
//! machine, each reporting its control address on stdout, stopped when dropped (and by the
//! kernel if this process dies first); and the core pinning a `--pin-core` node applies.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// Why the local nodes could not be started, or a node not pinned.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    #[error("starting node {node}")]
    Spawn {
        node: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("node {node} has no stdout")]
    NoStdout { node: usize },
    #[error("reading node {node}'s address")]
    ReadAddress {
        node: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("node {node} printed {line:?} instead of its address")]
    BadAddress { node: usize, line: String },
    #[error("pinning to core {core}: {error}")]
    Pin { core: usize, error: std::io::Error },
}

/// How to start the local nodes.
#[derive(Clone, Debug, Default)]
pub struct LocalOptions {
    /// Compute threads per node (`--threads`).
    pub threads: usize,
    /// Pin node i to core i (modulo the cores) with `--pin-core`.
    pub pin: bool,
    /// Each node's `--memory-limit`, bytes.
    pub memory_limit: Option<u64>,
    /// Node i's `--slowdown`, for the nodes this covers.
    pub slowdown: Vec<f64>,
    /// The model file the nodes may open (their `--model`): a node opens no path a
    /// coordinator names outside its model directories.
    pub model: Option<std::path::PathBuf>,
}

/// Local node processes, killed when dropped.
pub struct LocalNodes {
    children: Vec<Child>,
}

impl Drop for LocalNodes {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts `n` nodes by running `exe node --listen 127.0.0.1:0 ...` (`exe` is the weft
/// binary, which only the caller knows) with the cluster `secret` in WEFT_SECRET, and
/// returns them with the control addresses they printed, in order.
pub fn start_local_nodes(
    exe: &Path,
    n: usize,
    secret: &str,
    opts: &LocalOptions,
) -> Result<(LocalNodes, Vec<String>), LocalError> {
    let cores = std::thread::available_parallelism()
        .map(|c| c.get())
        .unwrap_or(1);
    let mut nodes = LocalNodes {
        children: Vec::new(),
    };
    let mut addrs = Vec::new();
    for i in 0..n {
        let mut cmd = Command::new(exe);
        cmd.args([
            "node",
            "--listen",
            "127.0.0.1:0",
            "--threads",
            &opts.threads.to_string(),
        ])
        .env("WEFT_SECRET", secret)
        // Local nodes share the user's terminal: only their warnings, unless asked.
        .env(
            "WEFT_LOG",
            std::env::var("WEFT_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        if opts.pin {
            cmd.args(["--pin-core", &(i % cores).to_string()]);
        }
        if let Some(m) = opts.memory_limit {
            cmd.args(["--memory-limit", &m.to_string()]);
        }
        if let Some(m) = &opts.model {
            cmd.arg("--model").arg(m);
        }
        if let Some(f) = opts.slowdown.get(i) {
            cmd.args(["--slowdown", &f.to_string()]);
        }
        // Local nodes belong to this process: if it dies without cleaning up (SIGKILL),
        // the kernel stops them too.
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: prctl is async-signal-safe and touches only the child being made.
            unsafe {
                cmd.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                    Ok(())
                });
            }
        }
        let mut child = cmd
            .spawn()
            .map_err(|source| LocalError::Spawn { node: i, source })?;
        let out = child
            .stdout
            .take()
            .ok_or(LocalError::NoStdout { node: i })?;
        nodes.children.push(child);
        let mut line = String::new();
        BufReader::new(out)
            .read_line(&mut line)
            .map_err(|source| LocalError::ReadAddress { node: i, source })?;
        let addr =
            line.trim()
                .strip_prefix("listening on ")
                .ok_or_else(|| LocalError::BadAddress {
                    node: i,
                    line: line.clone(),
                })?;
        addrs.push(addr.to_string());
    }
    Ok((nodes, addrs))
}

/// Pins this process to `core` (a node's `--pin-core`).
pub fn pin_to_core(core: usize) -> Result<(), LocalError> {
    // SAFETY: a zeroed cpu_set_t is valid; sched_setaffinity reads it for this process.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(LocalError::Pin {
                core,
                error: std::io::Error::last_os_error(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A stand-in for the weft binary: a shell script that records its arguments and pid,
    /// prints `first_line`, then waits to be killed.
    fn fake_weft(dir: &Path, name: &str, first_line: &str) -> std::path::PathBuf {
        let path = dir.join(name);
        let log = dir.join(format!("{name}.log"));
        std::fs::write(
            &path,
            format!(
                "#!/bin/sh\necho \"$$ $WEFT_SECRET $*\" >> '{}'\necho '{first_line}'\nexec sleep 60\n",
                log.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    /// `start_local_nodes`, retried while another test thread's fork still holds the
    /// freshly written script open (ETXTBSY).
    fn start(
        exe: &Path,
        n: usize,
        opts: &LocalOptions,
    ) -> Result<(LocalNodes, Vec<String>), LocalError> {
        for _ in 0..100 {
            match start_local_nodes(exe, n, "s3cret", opts) {
                Err(LocalError::Spawn { source, .. }) if source.raw_os_error() == Some(26) => {
                    std::thread::sleep(std::time::Duration::from_millis(10))
                }
                r => return r,
            }
        }
        start_local_nodes(exe, n, "s3cret", opts)
    }

    #[test]
    fn starts_nodes_with_their_flags_reads_addresses_and_kills_them() {
        let dir = tempfile::tempdir().unwrap();
        let exe = fake_weft(dir.path(), "weft", "listening on 127.0.0.1:4242");
        let opts = LocalOptions {
            threads: 3,
            pin: true,
            memory_limit: Some(1000),
            slowdown: vec![2.0],
            model: None,
        };
        let (nodes, addrs) = start(&exe, 2, &opts).unwrap();
        assert_eq!(addrs, ["127.0.0.1:4242", "127.0.0.1:4242"]);
        let log = std::fs::read_to_string(dir.path().join("weft.log")).unwrap();
        let lines: Vec<&str> = log.lines().collect();
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        let rest = |l: &str| l.split_once(' ').unwrap().1.to_string();
        assert_eq!(
            rest(lines[0]),
            "s3cret node --listen 127.0.0.1:0 --threads 3 --pin-core 0 --memory-limit 1000 --slowdown 2"
        );
        assert_eq!(
            rest(lines[1]),
            format!(
                "s3cret node --listen 127.0.0.1:0 --threads 3 --pin-core {} --memory-limit 1000",
                1 % cores
            )
        );
        let pids: Vec<String> = lines
            .iter()
            .map(|l| l.split_once(' ').unwrap().0.to_string())
            .collect();
        drop(nodes);
        for pid in pids {
            assert!(
                !Path::new(&format!("/proc/{pid}")).exists(),
                "node {pid} still runs after LocalNodes was dropped"
            );
        }
    }

    #[test]
    fn names_the_node_that_fails() {
        let dir = tempfile::tempdir().unwrap();
        let exe = fake_weft(dir.path(), "chatty", "hello");
        let opts = LocalOptions {
            threads: 1,
            ..LocalOptions::default()
        };
        let e = start(&exe, 1, &opts).err().unwrap();
        assert_eq!(
            e.to_string(),
            "node 0 printed \"hello\\n\" instead of its address"
        );
        let e = start(&dir.path().join("missing"), 1, &opts).err().unwrap();
        assert_eq!(e.to_string(), "starting node 0");
        assert!(matches!(e, LocalError::Spawn { node: 0, .. }));
    }
}
