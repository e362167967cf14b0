//! Cluster secrets at the command line: `weft secret` prints strong ones, and a weak secret
//! is refused before a node listens or a coordinator dials.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn weft(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_weft"))
        .args(args)
        .env_remove("WEFT_SECRET")
        .stdin(Stdio::null())
        .output()
        .expect("running weft")
}

#[test]
fn weft_secret_prints_a_fresh_strong_secret() {
    let mut seen = Vec::new();
    for _ in 0..2 {
        let out = weft(&["secret"]);
        assert!(out.status.success(), "{out:?}");
        let s = String::from_utf8(out.stdout).unwrap().trim().to_string();
        weft_comm::secret::check_secret(&s).unwrap();
        assert!(String::from_utf8_lossy(&out.stderr).contains("--secret"));
        seen.push(s);
    }
    assert_ne!(seen[0], seen[1], "two runs printed the same secret");
}

#[test]
fn a_weak_secret_is_refused_before_anything_starts() {
    let start = Instant::now();
    // A node would otherwise listen forever; a quick non-zero exit means it never did.
    let out = weft(&["node", "--listen", "127.0.0.1:0", "--secret", "abcd"]);
    assert!(!out.status.success());
    assert!(start.elapsed() < Duration::from_secs(20));
    assert!(!String::from_utf8_lossy(&out.stdout).contains("listening"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("128 bits") && err.contains("weft secret"),
        "{err}"
    );

    // The coordinator refuses it before reading the model (this path does not exist).
    let out = weft(&[
        "run",
        "--model",
        "/nonexistent/model.gguf",
        "--prompt",
        "hi",
        "--peers",
        "127.0.0.1:9",
        "--secret",
        "password123",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("128 bits"), "{err}");
}
