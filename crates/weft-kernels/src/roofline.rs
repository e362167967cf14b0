//! The machine's ceilings, measured: memory read bandwidth (one sequential stream per
//! thread, the access pattern of decode) and the peak rate of the integer dot-product
//! instructions the quantized kernels use. Kernels are reported against these.

use std::time::Instant;

use crate::pages::StreamBuf;
use crate::ThreadPool;

/// Bytes per second the pool's threads read from a buffer of `bytes` (make it several
/// times the last-level cache), each thread one sequential stream; best of `reps` passes.
pub fn read_bandwidth(pool: &ThreadPool, bytes: usize, reps: usize) -> f64 {
    ReadProbe::new(bytes).measure(pool, reps)
}

/// The bandwidth probe's buffer, kept so that the probe can run again and again beside
/// what it is the ceiling of (a shared machine's bandwidth drifts between moments). It
/// lies in the pages the loaded weights get ([`StreamBuf`]), so the probe and decode read
/// alike.
pub struct ReadProbe(StreamBuf);

impl ReadProbe {
    /// A probe over `bytes` (at least 32 KiB), filled with non-constant words so that no
    /// pass can be skipped.
    pub fn new(bytes: usize) -> ReadProbe {
        let words = (bytes / 8).max(1 << 12);
        let mut probe = ReadProbe(StreamBuf::zeroed(words * 8));
        for (i, w) in probe.words_mut().iter_mut().enumerate() {
            *w = (i as u64).wrapping_mul(0x9E37_79B9);
        }
        probe
    }

    fn words_mut(&mut self) -> &mut [u64] {
        // SAFETY: any bytes are valid u64s. The huge pages are 64-byte aligned, so nothing
        // is left out there; a heap buffer may lose a few bytes at either end.
        unsafe { self.0.align_to_mut::<u64>().1 }
    }

    fn words(&self) -> &[u64] {
        // SAFETY: as in `words_mut`.
        unsafe { self.0.align_to::<u64>().1 }
    }

    /// Bytes per second the pool's threads read from the buffer, each thread one
    /// sequential stream; best of `reps` passes.
    pub fn measure(&self, pool: &ThreadPool, reps: usize) -> f64 {
        let buf = self.words();
        let mut best = 0f64;
        for _ in 0..reps.max(1) {
            let sink = std::sync::atomic::AtomicU64::new(0);
            let t = Instant::now();
            // Ranges of 512 KiB: coarse enough that each is one long stream.
            pool.for_ranges(buf.len(), 1 << 16, &|r| {
                let s = sum_words(&buf[r]);
                sink.fetch_add(s, std::sync::atomic::Ordering::Relaxed);
            });
            let secs = t.elapsed().as_secs_f64();
            std::hint::black_box(sink.load(std::sync::atomic::Ordering::Relaxed));
            best = best.max(std::mem::size_of_val(buf) as f64 / secs);
        }
        best
    }
}

/// Wrapping sum of `w`, AVX2 where present (the scalar loop is too slow to saturate a
/// memory channel, so it would measure the core, not the memory).
pub fn sum_words(w: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was just detected.
        return unsafe { x86::sum_words(w) };
    }
    w.iter().fold(0u64, |a, &x| a.wrapping_add(x))
}

/// Integer dot-product operations per second (a byte product summed counts two, a
/// multiply and an add) of the pool's threads running the byte-dot instruction the
/// quantized kernels use here (`quant::dot_peak_instruction`: a VNNI `vpdpbusd` where one
/// runs, else the AVX2 pair), from registers only: the compute ceiling for prefill. None
/// where the SIMD kernels do not run.
pub fn peak_int8_ops(pool: &ThreadPool) -> Option<f64> {
    const ITERS: usize = 2_000_000;
    let (_, ops_per_iter) = crate::quant::dot_peak_instruction()?;
    let mut best = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        pool.run(pool.n_threads(), &|_| crate::quant::dot_peak_run(ITERS));
        let secs = t.elapsed().as_secs_f64();
        best = best.max(ops_per_iter * ITERS as f64 * pool.n_threads() as f64 / secs);
    }
    Some(best)
}

/// The instruction [`peak_int8_ops`] runs on this CPU, for reports.
pub fn peak_int8_instruction() -> Option<&'static str> {
    crate::quant::dot_peak_instruction().map(|p| p.0)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX2 present.
    #[target_feature(enable = "avx2")]
    pub unsafe fn sum_words(w: &[u64]) -> u64 {
        let zero = _mm256_setzero_si256();
        let mut acc = [zero; 4];
        let chunks = w.chunks_exact(16);
        let tail = chunks.remainder();
        for c in chunks {
            for (k, a) in acc.iter_mut().enumerate() {
                // SAFETY: c holds 16 words = four 32-byte vectors.
                let v = unsafe { _mm256_loadu_si256(c.as_ptr().add(4 * k).cast()) };
                *a = _mm256_add_epi64(*a, v);
            }
        }
        let s = _mm256_add_epi64(
            _mm256_add_epi64(acc[0], acc[1]),
            _mm256_add_epi64(acc[2], acc[3]),
        );
        let mut lanes = [0u64; 4];
        // SAFETY: 32 bytes into a 32-byte array.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), s) };
        lanes
            .iter()
            .chain(tail)
            .fold(0u64, |a, &x| a.wrapping_add(x))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simd_sum_equals_scalar_sum() {
        let w: Vec<u64> = (0..1037u64).map(|i| i.wrapping_mul(u64::MAX / 7)).collect();
        let want = w.iter().fold(0u64, |a, &x| a.wrapping_add(x));
        assert_eq!(sum_words(&w), want);
        assert_eq!(
            sum_words(&w[..5]),
            w[..5].iter().fold(0, |a: u64, &x| a.wrapping_add(x))
        );
    }

    #[test]
    fn ceilings_are_positive() {
        let pool = ThreadPool::new(1);
        let bw = read_bandwidth(&pool, 4 << 20, 2);
        assert!(bw > 1e8 && bw.is_finite(), "{bw}");
        if let Some(p) = peak_int8_ops(&pool) {
            assert!(p > 1e9 && p.is_finite(), "{p}");
        }
    }
}
