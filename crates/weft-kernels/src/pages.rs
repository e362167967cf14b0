//! Zeroed memory for the weights a loader copies (repacked or in ggml's rows), for the
//! bandwidth probe and for the matrices kernels are timed on: carved one after another
//! from large anonymous slabs advised as transparent huge pages before their first touch.
//! Decode reads every weight byte once a token, in the order the loader copied them, so
//! it streams one run of memory in 2 MiB pages; on a Zen 4 VM,
//! separate 4 KiB-page buffers streamed 15-20 % slower (a TLB miss a page, in the guest
//! and the host) and a stack of separate buffers another 8-12 % below one run.
//! Hand-written over `mmap` and `madvise` because the slab must be 2 MiB-aligned and
//! advised before its first touch, which neither `Vec` nor memmap2's anonymous maps
//! allow.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};

/// The huge page size asked for (x86-64 and most Arm kernels).
const HUGE_PAGE: usize = 2 << 20;
/// Address space a slab reserves (never resident until touched).
const SLAB_BYTES: usize = 1 << 30;
/// Where each buffer starts: a cache line, so the SIMD loads of one never share a line
/// with another's.
const ALIGN: usize = 64;

/// One anonymous mapping that buffers are carved from; unmapped with its last buffer.
struct Slab {
    /// The mapping as mmap returned it, and its length.
    map: *mut u8,
    map_len: usize,
    /// The 2 MiB-aligned start of the usable bytes, and how many there are.
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is shared only through buffers that own disjoint ranges of it.
unsafe impl Send for Slab {}
// SAFETY: as above; the slab itself is never written through `&Slab`.
unsafe impl Sync for Slab {}

impl Slab {
    fn map(len: usize) -> std::io::Result<Slab> {
        let map_len = len.checked_add(HUGE_PAGE).ok_or_else(too_large)?;
        // SAFETY: a fresh private anonymous mapping, checked for failure below.
        // MAP_NORESERVE: the reservation is address space, not memory.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let map = map.cast::<u8>();
        // SAFETY: the aligned start is less than a huge page into the mapping.
        let base = unsafe { map.add((map as usize).next_multiple_of(HUGE_PAGE) - map as usize) };
        // SAFETY: [base, base + len) lies inside the mapping; advice is only a hint, and
        // a refusal (no THP in this kernel) leaves 4 KiB pages.
        #[cfg(target_os = "linux")]
        unsafe {
            libc::madvise(base.cast(), len, libc::MADV_HUGEPAGE)
        };
        Ok(Slab {
            map,
            map_len,
            base,
            len,
        })
    }
}

impl Drop for Slab {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `map` mapped, once, after its last buffer.
        unsafe { libc::munmap(self.map.cast(), self.map_len) };
    }
}

fn too_large() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::OutOfMemory,
        "a huge-page buffer larger than the address space",
    )
}

/// The system's page size (4 KiB on x86-64, 16 or 64 KiB on some Arm kernels).
fn page_size() -> usize {
    // SAFETY: sysconf only reads a system constant.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

/// The slab buffers are carved from now, and how much of it is used.
struct Bump {
    slab: Option<Arc<Slab>>,
    used: usize,
}

static BUMP: Mutex<Bump> = Mutex::new(Bump {
    slab: None,
    used: 0,
});

/// `len` zeroed bytes carved from the current slab, right after the last buffer carved.
pub struct HugeBuf {
    /// Held, never read: keeps the slab mapped while the buffer lives.
    _slab: Arc<Slab>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer owns its range of the slab alone, like a Vec's buffer.
unsafe impl Send for HugeBuf {}
// SAFETY: shared access only reads.
unsafe impl Sync for HugeBuf {}

impl HugeBuf {
    /// Carves `len` zeroed bytes (a range never carved before, so still zero). Where
    /// transparent huge pages are off or refused, the pages are 4 KiB, as `Vec`'s.
    pub fn zeroed(len: usize) -> std::io::Result<HugeBuf> {
        let need = len
            .max(1)
            .checked_next_multiple_of(ALIGN)
            .filter(|&n| n <= isize::MAX as usize / 2)
            .ok_or_else(too_large)?;
        // A poisoned lock only means a panic elsewhere while carving; the counters are
        // still consistent (updated after the slab is in place).
        let mut bump = BUMP.lock().unwrap_or_else(|e| e.into_inner());
        let fits = bump
            .slab
            .as_ref()
            .is_some_and(|s| bump.used + need <= s.len);
        if !fits {
            let size = need.max(SLAB_BYTES).checked_next_multiple_of(HUGE_PAGE);
            let slab = Slab::map(size.ok_or_else(too_large)?)?;
            bump.slab = Some(Arc::new(slab));
            bump.used = 0;
        }
        let slab = bump.slab.clone().expect("a slab was just put in place");
        // SAFETY: used + need <= slab.len, so the range lies inside the slab.
        let ptr = unsafe { slab.base.add(bump.used) };
        bump.used += need;
        Ok(HugeBuf {
            _slab: slab,
            ptr,
            len,
        })
    }
}

impl Deref for HugeBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` bytes from `ptr` lie in the slab, which `self._slab` keeps mapped.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl DerefMut for HugeBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and no other buffer covers these bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for HugeBuf {
    fn drop(&mut self) {
        // Give the buffer's whole pages back now (its range is never carved again);
        // pages it shares with a neighbour stay, and the slab goes with its last buffer.
        // The real page size: madvise rounds its length up to whole pages, so a smaller
        // guess could reach into the next buffer.
        let page = page_size();
        let start = (self.ptr as usize).next_multiple_of(page);
        let end = (self.ptr as usize + self.len) / page * page;
        if end > start {
            // SAFETY: whole pages inside this buffer's own range of the live slab.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
        }
    }
}

/// Zeroed bytes of the kind decode streams, for timing kernels on: a [`HugeBuf`], or a
/// heap buffer where no mapping can be had (4 KiB pages, as a refused advice gives too).
pub enum StreamBuf {
    Huge(HugeBuf),
    Heap(Vec<u8>),
}

impl StreamBuf {
    pub fn zeroed(len: usize) -> StreamBuf {
        HugeBuf::zeroed(len).map_or_else(|_| StreamBuf::Heap(vec![0; len]), StreamBuf::Huge)
    }
}

impl Deref for StreamBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            StreamBuf::Huge(b) => b,
            StreamBuf::Heap(v) => v,
        }
    }
}

impl DerefMut for StreamBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            StreamBuf::Huge(b) => b,
            StreamBuf::Heap(v) => v,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_disjoint_and_keep_their_bytes() {
        let lens = [0usize, 1, 4096, 3 * HUGE_PAGE + 123, 100];
        let mut bufs: Vec<HugeBuf> = lens
            .iter()
            .map(|&l| HugeBuf::zeroed(l).expect("mmap"))
            .collect();
        for (b, &len) in bufs.iter().zip(&lens) {
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0), "len {len}: zeroed");
            assert_eq!(b.as_ptr() as usize % ALIGN, 0, "len {len}: aligned");
        }
        for (i, b) in bufs.iter_mut().enumerate() {
            b.fill(i as u8 + 1);
        }
        for (i, b) in bufs.iter().enumerate() {
            assert!(
                b.iter().all(|&x| x == i as u8 + 1),
                "buffer {i} kept its bytes"
            );
        }
        for (i, x) in bufs.iter().enumerate() {
            for y in &bufs[i + 1..] {
                let (x0, y0) = (x.as_ptr() as usize, y.as_ptr() as usize);
                assert!(x0 + x.len() <= y0 || y0 + y.len() <= x0, "disjoint");
            }
        }
        // A buffer larger than a slab gets a slab of its own.
        let big = HugeBuf::zeroed(SLAB_BYTES + 1).expect("mmap");
        assert_eq!(big.len(), SLAB_BYTES + 1);
        drop(bufs);
        let again = HugeBuf::zeroed(4096).expect("mmap");
        assert!(again.iter().all(|&x| x == 0), "a later buffer is zero too");
        assert!(
            HugeBuf::zeroed(usize::MAX - 10).is_err(),
            "too large is an error"
        );
    }

    #[test]
    fn a_stream_buffer_is_zeroed_writable_and_of_its_length() {
        for len in [0usize, 5, 3 * HUGE_PAGE + 7] {
            let mut b = StreamBuf::zeroed(len);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0), "len {len}: zeroed");
            b.fill(7);
            assert!(b.iter().all(|&x| x == 7), "len {len}: kept its bytes");
        }
    }
}
