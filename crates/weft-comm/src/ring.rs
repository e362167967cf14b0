//! Single-producer single-consumer byte rings in shared memory: the shared-memory transport
//! (a mapped file per direction, for ranks on one host) and the in-process one (anonymous
//! memory). A waiting reader spins for the adaptive budget, then naps in short sleeps;
//! a crashed peer is noticed through the TCP connection kept open beside the rings.

use std::io::ErrorKind;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use memmap2::MmapMut;

use crate::error::Fault;
use crate::link::{Deadline, Link, SpinPolicy};

/// Bytes of ring data per direction.
pub const RING_BYTES: usize = 4 << 20;
const HEADER: usize = 256;
const MAGIC: u64 = u64::from_le_bytes(*b"WEFTRING");
/// How often a waiting side checks whether its peer is still there.
const LIVENESS_EVERY: Duration = Duration::from_millis(2);

/// One ring's memory: a header (magic, head, tail, closed on their own cache lines) and data.
struct Ring {
    _map: Arc<MmapMut>,
    base: *mut u8,
    cap: usize,
}

// SAFETY: the ring is shared by exactly one writer and one reader that coordinate through
// the atomic head and tail; the mapping lives as long as any Ring holding it.
unsafe impl Send for Ring {}

impl Ring {
    fn new(map: Arc<MmapMut>) -> Result<Self, String> {
        if map.len() <= HEADER || !(map.len() - HEADER).is_power_of_two() {
            return Err(format!(
                "ring mapping of {} bytes has a bad size",
                map.len()
            ));
        }
        let base = map.as_ptr() as *mut u8;
        let r = Ring {
            cap: map.len() - HEADER,
            _map: map,
            base,
        };
        Ok(r)
    }
    fn u64_at(&self, off: usize) -> &AtomicU64 {
        // SAFETY: off is one of the header's aligned slots inside the mapping.
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }
    fn magic(&self) -> &AtomicU64 {
        self.u64_at(0)
    }
    fn head(&self) -> &AtomicU64 {
        self.u64_at(64)
    }
    fn tail(&self) -> &AtomicU64 {
        self.u64_at(128)
    }
    fn closed(&self) -> &AtomicU32 {
        // SAFETY: as u64_at.
        unsafe { &*(self.base.add(192) as *const AtomicU32) }
    }
    fn data(&self) -> *mut u8 {
        // SAFETY: the data area follows the header inside the mapping.
        unsafe { self.base.add(HEADER) }
    }
    fn init(&self) {
        self.head().store(0, Ordering::Relaxed);
        self.tail().store(0, Ordering::Relaxed);
        self.closed().store(0, Ordering::Relaxed);
        self.magic().store(MAGIC, Ordering::Release);
    }
}

/// A bidirectional link over two rings.
pub struct RingLink {
    tx: Ring,
    rx: Ring,
    /// The peer's TCP connection, kept open only so that its death is noticed.
    watch: Option<TcpStream>,
    spin: SpinPolicy,
    kind: &'static str,
}

impl RingLink {
    fn new(
        tx: Ring,
        rx: Ring,
        watch: Option<TcpStream>,
        spin: Duration,
        kind: &'static str,
    ) -> Self {
        RingLink {
            tx,
            rx,
            watch,
            spin: SpinPolicy::new(spin),
            kind,
        }
    }

    /// Two ends of an in-process link.
    pub fn pair(spin: Duration) -> Result<(RingLink, RingLink), String> {
        let anon = || {
            MmapMut::map_anon(HEADER + RING_BYTES)
                .map(Arc::new)
                .map_err(|e| format!("mapping an in-process ring: {e}"))
        };
        let (a, b) = (anon()?, anon()?);
        let ring = |m: &Arc<MmapMut>| {
            let r = Ring::new(m.clone())?;
            r.init();
            Ok::<_, String>(r)
        };
        let (a1, b1) = (ring(&a)?, ring(&b)?);
        let (a2, b2) = (Ring::new(a)?, Ring::new(b)?);
        Ok((
            RingLink::new(a1, b1, None, spin, "in-process"),
            RingLink::new(b2, a2, None, spin, "in-process"),
        ))
    }

    /// Creates the two ring files of a shared-memory link (`tx_path` we write, `rx_path` we
    /// read) and maps them. The caller sends the paths to the peer, which opens them with
    /// `open_files` swapped, and then unlinks them.
    pub fn create_files(
        tx_path: &Path,
        rx_path: &Path,
        watch: TcpStream,
        spin: Duration,
    ) -> Result<RingLink, String> {
        let (tx, rx) = (map_ring_file(tx_path, true)?, map_ring_file(rx_path, true)?);
        Ok(RingLink::new(tx, rx, Some(watch), spin, "shm"))
    }

    /// Maps ring files the peer created.
    pub fn open_files(
        tx_path: &Path,
        rx_path: &Path,
        watch: TcpStream,
        spin: Duration,
    ) -> Result<RingLink, String> {
        let (tx, rx) = (
            map_ring_file(tx_path, false)?,
            map_ring_file(rx_path, false)?,
        );
        Ok(RingLink::new(tx, rx, Some(watch), spin, "shm"))
    }

    /// Whether the peer has gone: it closed a ring, or its process (and so its socket) died.
    fn peer_gone(&mut self) -> bool {
        if self.rx.closed().load(Ordering::Acquire) != 0
            || self.tx.closed().load(Ordering::Acquire) != 0
        {
            return true;
        }
        if let Some(w) = &self.watch {
            // MSG_DONTWAIT rather than set_nonblocking: the flag would be shared with the
            // other descriptors of this socket.
            let mut b = [0u8; 1];
            // SAFETY: a one-byte buffer we own, on a socket we hold open.
            let r = unsafe {
                libc::recv(
                    w.as_raw_fd(),
                    b.as_mut_ptr() as *mut libc::c_void,
                    1,
                    libc::MSG_DONTWAIT | libc::MSG_PEEK,
                )
            };
            if r == 0 {
                return true;
            }
            if r < 0 {
                let e = std::io::Error::last_os_error();
                return e.kind() != ErrorKind::WouldBlock && e.kind() != ErrorKind::Interrupted;
            }
        }
        false
    }

    /// Waits until `ready()` holds, spinning for the budget and then napping.
    fn wait(
        &mut self,
        deadline: &mut Deadline,
        ready: &dyn Fn(&Self) -> bool,
    ) -> Result<(), Fault> {
        let start = Instant::now();
        let mut last_check = start;
        let mut spun_out = false;
        loop {
            if ready(self) {
                self.spin.record(!spun_out);
                return Ok(());
            }
            let now = Instant::now();
            if now.duration_since(last_check) >= LIVENESS_EVERY {
                last_check = now;
                if self.peer_gone() {
                    return Err(Fault::Closed);
                }
                deadline.left()?;
            }
            let waited = now.duration_since(start);
            if waited < self.spin.budget() {
                crate::link::pause(waited);
            } else {
                spun_out = true;
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }
}

impl Drop for RingLink {
    fn drop(&mut self) {
        self.tx.closed().store(1, Ordering::Release);
        self.rx.closed().store(1, Ordering::Release);
    }
}

impl Link for RingLink {
    fn write_all(&mut self, mut bytes: &[u8], deadline: &mut Deadline) -> Result<(), Fault> {
        let cap = self.tx.cap as u64;
        while !bytes.is_empty() {
            self.wait(deadline, &|s| {
                let h = s.tx.head().load(Ordering::Relaxed);
                h - s.tx.tail().load(Ordering::Acquire) < cap
            })?;
            let head = self.tx.head().load(Ordering::Relaxed);
            let room = (cap - (head - self.tx.tail().load(Ordering::Acquire))) as usize;
            let n = room.min(bytes.len());
            copy_in(&self.tx, head, &bytes[..n]);
            self.tx.head().store(head + n as u64, Ordering::Release);
            bytes = &bytes[n..];
        }
        Ok(())
    }

    fn read_exact(&mut self, buf: &mut [u8], deadline: &mut Deadline) -> Result<(), Fault> {
        let mut got = 0;
        while got < buf.len() {
            self.wait(deadline, &|s| {
                s.rx.head().load(Ordering::Acquire) > s.rx.tail().load(Ordering::Relaxed)
            })?;
            let tail = self.rx.tail().load(Ordering::Relaxed);
            let avail = (self.rx.head().load(Ordering::Acquire) - tail) as usize;
            let n = avail.min(buf.len() - got);
            copy_out(&self.rx, tail, &mut buf[got..got + n]);
            self.rx.tail().store(tail + n as u64, Ordering::Release);
            got += n;
        }
        Ok(())
    }

    fn kind(&self) -> &'static str {
        self.kind
    }
}

/// Copies `src` into the ring at stream offset `at`, wrapping at the end.
fn copy_in(r: &Ring, at: u64, src: &[u8]) {
    let off = (at % r.cap as u64) as usize;
    let first = src.len().min(r.cap - off);
    // SAFETY: both pieces lie inside the data area; the writer owns this free region.
    unsafe {
        std::ptr::copy_nonoverlapping(src.as_ptr(), r.data().add(off), first);
        std::ptr::copy_nonoverlapping(src.as_ptr().add(first), r.data(), src.len() - first);
    }
}

/// Copies from the ring at stream offset `at` into `dst`, wrapping at the end.
fn copy_out(r: &Ring, at: u64, dst: &mut [u8]) {
    let off = (at % r.cap as u64) as usize;
    let first = dst.len().min(r.cap - off);
    // SAFETY: both pieces lie inside the data area; the reader owns this filled region.
    unsafe {
        std::ptr::copy_nonoverlapping(r.data().add(off), dst.as_mut_ptr(), first);
        std::ptr::copy_nonoverlapping(r.data(), dst.as_mut_ptr().add(first), dst.len() - first);
    }
}

/// Maps ring file `p`: a new one, sized and initialized (`create`), or one the peer made,
/// checked for the ring's magic.
fn map_ring_file(p: &Path, create: bool) -> Result<Ring, String> {
    let (verb, f) = if create {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(p);
        ("creating", f)
    } else {
        let f = std::fs::OpenOptions::new().read(true).write(true).open(p);
        ("opening", f)
    };
    let f = f.map_err(|e| format!("{verb} {}: {e}", p.display()))?;
    if create {
        f.set_len((HEADER + RING_BYTES) as u64)
            .map_err(|e| format!("sizing {}: {e}", p.display()))?;
    }
    // SAFETY: the file is a weft ring file; only weft ranks map it.
    let m = unsafe { MmapMut::map_mut(&f) }.map_err(|e| format!("mapping {}: {e}", p.display()))?;
    let r = Ring::new(Arc::new(m))?;
    if create {
        r.init();
    } else if r.magic().load(Ordering::Acquire) != MAGIC {
        return Err(format!("{} is not a weft ring", p.display()));
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_cross_in_order_through_wraparound() {
        let (mut a, mut b) = RingLink::pair(Duration::from_micros(50)).unwrap();
        let deadline = Deadline::after(Duration::from_secs(5));
        let msg: Vec<u8> = (0..RING_BYTES * 3 + 17).map(|i| (i % 251) as u8).collect();
        let m2 = msg.clone();
        let mut writer_deadline = deadline.clone();
        let t = std::thread::spawn(move || {
            a.write_all(&m2, &mut writer_deadline).unwrap();
            a
        });
        let mut got = vec![0u8; msg.len()];
        b.read_exact(&mut got, &mut deadline.clone()).unwrap();
        assert!(got == msg);
        drop(t.join().unwrap());
        let mut one = [0u8; 1];
        assert!(matches!(
            b.read_exact(&mut one, &mut deadline.clone()),
            Err(Fault::Closed)
        ));
    }
}
