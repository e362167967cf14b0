//! Zeroed anonymous memory whose whole 2 MiB stretches are asked for as transparent huge
//! pages: the weights repacked at load and the bandwidth probe live in it. Decode reads
//! every weight byte once a token, and in 4 KiB pages a Zen 4 VM streamed it 15-20 %
//! slower (each page a TLB miss, in the guest and the host). Hand-written over `mmap` and
//! `madvise` because the buffer must be 2 MiB-aligned and advised before its first touch,
//! which neither `Vec` nor memmap2's anonymous maps allow.

use std::ops::{Deref, DerefMut};

/// The huge page size asked for (x86-64 and most Arm kernels).
const HUGE_PAGE: usize = 2 << 20;

/// `len` zeroed bytes, 2 MiB-aligned, in huge pages where the kernel gives them; under
/// one huge page, an ordinary heap buffer (no whole page to gain, and a model's thousands
/// of small expert matrices would each cost a mapping of their own).
pub struct HugeBuf {
    /// The whole mapping (null for a heap buffer): `len` bytes plus up to a page of
    /// alignment slack, which is never touched and so never resident.
    map: *mut u8,
    map_len: usize,
    /// Where the bytes start inside the mapping (a 2 MiB boundary).
    start: usize,
    len: usize,
    heap: Vec<u8>,
}

// SAFETY: the mapping is owned by this value alone, like a Vec's buffer.
unsafe impl Send for HugeBuf {}
// SAFETY: shared access only reads.
unsafe impl Sync for HugeBuf {}

impl HugeBuf {
    /// Maps `len` zeroed bytes. Only whole huge pages inside the bytes are advised, so a
    /// buffer never grows resident past its length (a small one stays in 4 KiB pages).
    /// Where transparent huge pages are off or refused, the pages are 4 KiB, as `Vec`'s.
    pub fn zeroed(len: usize) -> std::io::Result<HugeBuf> {
        if len < HUGE_PAGE {
            return Ok(HugeBuf {
                map: std::ptr::null_mut(),
                map_len: 0,
                start: 0,
                len,
                heap: vec![0; len],
            });
        }
        let map_len = len.max(1) + HUGE_PAGE;
        // SAFETY: a fresh private anonymous mapping, checked for failure below.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let map = map.cast::<u8>();
        let start = (map as usize).next_multiple_of(HUGE_PAGE) - map as usize;
        #[cfg(target_os = "linux")]
        {
            let whole = len / HUGE_PAGE * HUGE_PAGE;
            if whole > 0 {
                // SAFETY: the range lies inside the mapping; advice is only a hint, and a
                // refusal (no THP in this kernel) leaves 4 KiB pages.
                unsafe { libc::madvise(map.add(start).cast(), whole, libc::MADV_HUGEPAGE) };
            }
        }
        Ok(HugeBuf {
            map,
            map_len,
            start,
            len,
            heap: Vec::new(),
        })
    }
}

impl Deref for HugeBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        if self.map.is_null() {
            return &self.heap;
        }
        // SAFETY: `len` bytes from `start` lie in the live mapping, zeroed at first.
        unsafe { std::slice::from_raw_parts(self.map.add(self.start), self.len) }
    }
}

impl DerefMut for HugeBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        if self.map.is_null() {
            return &mut self.heap;
        }
        // SAFETY: as in deref, and `&mut self` is the only access.
        unsafe { std::slice::from_raw_parts_mut(self.map.add(self.start), self.len) }
    }
}

impl Drop for HugeBuf {
    fn drop(&mut self) {
        if self.map.is_null() {
            return;
        }
        // SAFETY: unmapping exactly what `zeroed` mapped, once.
        unsafe { libc::munmap(self.map.cast(), self.map_len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_huge_buffer_is_zeroed_aligned_and_writable() {
        for len in [0usize, 1, 4096, 3 * HUGE_PAGE + 123] {
            let mut b = HugeBuf::zeroed(len).expect("mmap");
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0), "len {len}: zeroed");
            if len >= HUGE_PAGE {
                assert_eq!(b.as_ptr() as usize % HUGE_PAGE, 0, "len {len}: aligned");
            }
            if len > 0 {
                b[len - 1] = 7;
                b[0] = 9;
                assert_eq!((b[0], b[len - 1]), (9, if len == 1 { 9 } else { 7 }));
            }
        }
    }
}
