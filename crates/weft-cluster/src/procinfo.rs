//! This process's memory as Linux reports it in /proc/self/status (nodes report it to the
//! coordinator; the CLI's bench and server report it too).

/// A `kB` field of /proc/self/status (e.g. "VmRSS", "VmHWM") in bytes; None where there
/// is no /proc or no such field.
pub fn status_bytes(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let rest = s
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?;
    let kb: u64 = rest.split_whitespace().next()?.parse().ok()?;
    Some(kb * 1024)
}

/// Resident memory now.
pub fn rss_bytes() -> Option<u64> {
    status_bytes("VmRSS")
}

/// Peak resident memory so far.
pub fn peak_rss_bytes() -> Option<u64> {
    status_bytes("VmHWM")
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_this_process() {
        if std::path::Path::new("/proc/self/status").exists() {
            let (rss, peak) = (
                super::rss_bytes().unwrap(),
                super::peak_rss_bytes().unwrap(),
            );
            assert!(rss > 0 && peak >= rss, "rss {rss} peak {peak}");
        }
        assert_eq!(super::status_bytes("NoSuchField"), None);
    }
}
