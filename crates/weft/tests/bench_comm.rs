//! `weft bench comm` starts its ranks as processes, reports its keys, and honours an
//! injected link delay (a lower bound the transport enforces, not a speed claim).

use std::process::Command;

use serde_json::Value;

fn bench(extra: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_weft"))
        .args([
            "bench",
            "comm",
            "--ranks",
            "2",
            "--iters",
            "100",
            "--bw-bytes",
            "1048576",
            "--json",
        ])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn reports_latency_and_bandwidth_on_both_transports() {
    for t in ["tcp", "shm"] {
        let v = bench(&["--transport", t, "--bytes", "2560"]);
        assert_eq!(v["transport"], t, "{v}");
        for k in [
            "allreduce_median_us",
            "allreduce_p99_us",
            "pingpong_median_us",
            "send_gb_s",
        ] {
            assert!(v[k].as_f64().unwrap() > 0.0, "{k} in {v}");
        }
        assert!(v["allreduce_p99_us"].as_f64() >= v["allreduce_median_us"].as_f64());
    }
}

#[test]
fn injected_delay_is_a_floor_on_latency() {
    let v = bench(&["--transport", "shm", "--link-delay-us", "300"]);
    assert!(v["allreduce_median_us"].as_f64().unwrap() >= 300.0, "{v}");
    assert!(v["pingpong_median_us"].as_f64().unwrap() >= 600.0, "{v}");
}

#[test]
fn bad_arguments_are_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_weft"))
        .args(["bench", "comm", "--ranks", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--ranks"));
}
