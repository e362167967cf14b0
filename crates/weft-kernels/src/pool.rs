//! A small spin-then-park thread pool for the data plane.
//!
//! Hand-written because a decode step dispatches ~130 parallel matvecs of 20–500 µs each:
//! rayon and condvar pools pay a 25–30 µs thread wake-up per dispatch on this kind of VM,
//! which would cost several milliseconds a token. Workers here spin on an epoch counter
//! for a couple of milliseconds after each job (so back-to-back dispatches start in
//! well under a microsecond) and only then park.
//!
//! The caller waits for the job's *tasks*, not for every worker: a worker that was
//! descheduled (more threads than cores, or a busy neighbour on its core) and has not
//! claimed a task by the time the others finished is simply left out of that job. Every
//! wait spins briefly, then yields its core, so a thread that is waited for can run.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

/// How long an idle worker spins before parking.
const SPIN_FOR: Duration = Duration::from_millis(3);
/// The same when the pool has more threads than usable cores: spinning then only takes
/// time from the threads doing the work.
const SPIN_FOR_OVERSUBSCRIBED: Duration = Duration::from_micros(100);
/// How long any wait spins before it starts yielding its core between checks.
const PURE_SPIN: Duration = Duration::from_micros(20);

type Job = dyn Fn(usize) + Sync;

struct Shared {
    epoch: AtomicU64,
    /// The current job; written by the caller before it bumps `epoch`, read by a worker
    /// only while it is checked in (`inside`) and the epoch is not closed.
    job: UnsafeCell<Option<*const Job>>,
    n_tasks: AtomicUsize,
    next_task: AtomicUsize,
    done_tasks: AtomicUsize,
    /// Workers between check-in and check-out of the current epoch.
    inside: AtomicUsize,
    /// The last epoch whose tasks are all done: late workers must not touch its job.
    closed: AtomicU64,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    oversubscribed: bool,
    sleeping: Vec<AtomicBool>,
}

// SAFETY: `job` is only accessed under the epoch protocol described on the fields.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

/// A fixed set of worker threads; the calling thread takes part in every job.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<(JoinHandle<()>, Thread)>,
}

/// The cores this process may run on (its affinity mask; cgroup quotas included where
/// the standard library sees them), at least 1.
pub fn usable_cores() -> usize {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: a zeroed cpu_set_t is valid, and sched_getaffinity fills at most its size.
        let n = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
                libc::CPU_COUNT(&set) as usize
            } else {
                0
            }
        };
        let std_view = thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        if n > 0 {
            return n.min(std_view).max(1);
        }
        std_view
    }
    #[cfg(not(target_os = "linux"))]
    {
        thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    }
}

/// Waits until `ready()`, spinning first and then yielding the core between checks.
#[inline]
fn wait_until(ready: impl Fn() -> bool) {
    let start = Instant::now();
    let mut spins = 0u32;
    while !ready() {
        spins = spins.wrapping_add(1);
        if spins < 64 || start.elapsed() < PURE_SPIN {
            std::hint::spin_loop();
        } else {
            thread::yield_now();
        }
    }
}

impl ThreadPool {
    /// A pool that runs jobs on `n_threads` threads in all (the caller plus n-1 workers).
    pub fn new(n_threads: usize) -> Self {
        let n_workers = n_threads.max(1) - 1;
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            n_tasks: AtomicUsize::new(0),
            next_task: AtomicUsize::new(0),
            done_tasks: AtomicUsize::new(0),
            inside: AtomicUsize::new(0),
            closed: AtomicU64::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            oversubscribed: n_threads > usable_cores(),
            sleeping: (0..n_workers).map(|_| AtomicBool::new(false)).collect(),
        });
        let workers = (0..n_workers)
            .map(|i| {
                let s = shared.clone();
                let h = thread::Builder::new()
                    .name(format!("weft-worker-{i}"))
                    .spawn(move || worker_loop(&s, i))
                    .expect("spawning a worker thread");
                let t = h.thread().clone();
                (h, t)
            })
            .collect();
        ThreadPool { shared, workers }
    }

    pub fn n_threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Whether this pool has more threads than the cores the process may use.
    pub fn oversubscribed(&self) -> bool {
        self.shared.oversubscribed
    }

    /// Runs `f(0) .. f(n_tasks - 1)` across the pool and returns when all are done.
    /// Tasks are claimed dynamically, so uneven task costs balance out.
    pub fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if n_tasks == 0 {
            return;
        }
        if self.workers.is_empty() || n_tasks == 1 {
            for t in 0..n_tasks {
                f(t);
            }
            return;
        }
        let s = &*self.shared;
        // SAFETY: erase the borrow's lifetime; we do not return until the epoch is closed
        // and no worker is checked in, so the pointer never outlives `f`.
        let ptr: *const Job =
            unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync + '_), &'static Job>(f) };
        unsafe { *s.job.get() = Some(ptr) };
        s.n_tasks.store(n_tasks, Ordering::Relaxed);
        s.next_task.store(0, Ordering::Relaxed);
        s.done_tasks.store(0, Ordering::Relaxed);
        let epoch = s.epoch.fetch_add(1, Ordering::SeqCst) + 1;
        for (i, (_, t)) in self.workers.iter().enumerate() {
            if s.sleeping[i].load(Ordering::SeqCst) {
                t.unpark();
            }
        }
        let mine = catch_unwind(AssertUnwindSafe(|| run_tasks(s, f)));
        wait_until(|| s.done_tasks.load(Ordering::Acquire) >= n_tasks);
        // Close the epoch, then wait out the workers already checked in (they find no
        // task left and leave at once); any later one sees the epoch closed.
        s.closed.store(epoch, Ordering::SeqCst);
        wait_until(|| s.inside.load(Ordering::SeqCst) == 0);
        unsafe { *s.job.get() = None };
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        if s.panicked.swap(false, Ordering::SeqCst) {
            panic!("a weft worker thread panicked while running a job");
        }
    }

    /// Splits `0..n` into about `4 * threads` contiguous chunks whose starts are multiples
    /// of `align`, and runs `f(range)` for each.
    pub fn for_ranges(&self, n: usize, align: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        let chunk = self.chunk_len(n, align);
        self.run(n.div_ceil(chunk), &|t| {
            let start = t * chunk;
            f(start..(start + chunk).min(n))
        });
    }

    /// The ranges `for_ranges(n, align, ..)` hands out, in order.
    pub fn ranges(&self, n: usize, align: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
        let chunk = self.chunk_len(n, align);
        (0..n.div_ceil(chunk)).map(move |t| t * chunk..((t + 1) * chunk).min(n))
    }

    fn chunk_len(&self, n: usize, align: usize) -> usize {
        let align = align.max(1);
        let pieces = if self.n_threads() == 1 {
            1
        } else {
            self.n_threads() * 4
        };
        (n.div_ceil(pieces).div_ceil(align) * align).max(align)
    }
}

/// Claims and runs tasks until none is left; a task that panics still counts as done
/// (so the caller never waits for it) and is reported through `panicked`.
fn run_tasks(s: &Shared, f: &(dyn Fn(usize) + Sync + '_)) {
    let n = s.n_tasks.load(Ordering::Relaxed);
    loop {
        let t = s.next_task.fetch_add(1, Ordering::Relaxed);
        if t >= n {
            break;
        }
        if catch_unwind(AssertUnwindSafe(|| f(t))).is_err() {
            s.panicked.store(true, Ordering::SeqCst);
        }
        s.done_tasks.fetch_add(1, Ordering::Release);
    }
}

fn worker_loop(s: &Shared, index: usize) {
    let spin_for = if s.oversubscribed {
        SPIN_FOR_OVERSUBSCRIBED
    } else {
        SPIN_FOR
    };
    let mut seen = 0u64;
    loop {
        let mut spin_start = Instant::now();
        loop {
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            let waited = spin_start.elapsed();
            if waited < spin_for {
                if s.oversubscribed && waited > PURE_SPIN {
                    thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            s.sleeping[index].store(true, Ordering::SeqCst);
            if s.epoch.load(Ordering::SeqCst) == seen && !s.shutdown.load(Ordering::SeqCst) {
                thread::park_timeout(Duration::from_millis(50));
            }
            s.sleeping[index].store(false, Ordering::SeqCst);
            spin_start = Instant::now();
        }
        // Check in, then make sure the epoch we saw is still the live one: a worker that
        // was descheduled may wake after its job was closed (or replaced).
        s.inside.fetch_add(1, Ordering::SeqCst);
        if s.epoch.load(Ordering::SeqCst) == seen && s.closed.load(Ordering::SeqCst) != seen {
            // SAFETY: the caller stored the job before bumping the epoch we observed and
            // clears it only after closing the epoch and seeing no worker inside.
            if let Some(job) = unsafe { *s.job.get() } {
                run_tasks(s, unsafe { &*job });
            }
        }
        s.inside.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        for (h, t) in self.workers.drain(..) {
            t.unpark();
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn every_task_runs_once() {
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads);
            for n in [0, 1, 5, 100] {
                let hits: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
                pool.run(n, &|t| {
                    hits[t].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn ranges_cover_exactly() {
        let pool = ThreadPool::new(2);
        let sum = AtomicU64::new(0);
        let count = AtomicU64::new(0);
        pool.for_ranges(1001, 4, &|r| {
            assert!(r.start % 4 == 0);
            sum.fetch_add(r.clone().map(|x| x as u64).sum::<u64>(), Ordering::Relaxed);
            count.fetch_add(r.len() as u64, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 1001);
        assert_eq!(sum.load(Ordering::Relaxed), 1000 * 1001 / 2);
    }

    #[test]
    fn survives_idle_parking() {
        let pool = ThreadPool::new(2);
        let c = AtomicU64::new(0);
        pool.run(4, &|_| {
            c.fetch_add(1, Ordering::Relaxed);
        });
        std::thread::sleep(Duration::from_millis(20));
        pool.run(4, &|_| {
            c.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(c.load(Ordering::Relaxed), 8);
    }

    #[test]
    fn more_threads_than_cores_still_runs_every_task() {
        let threads = usable_cores() * 3 + 1;
        let pool = ThreadPool::new(threads);
        assert!(pool.oversubscribed());
        for round in 0..200 {
            let n = 1 + round % 37;
            let hits: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
            pool.run(n, &|t| {
                hits[t].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "round {round}"
            );
        }
    }

    #[test]
    fn usable_cores_is_at_least_one() {
        assert!(usable_cores() >= 1);
    }

    #[test]
    fn a_panicking_task_propagates() {
        let pool = ThreadPool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(8, &|t| {
                if t == 7 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        let c = AtomicU64::new(0);
        pool.run(3, &|_| {
            c.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(c.load(Ordering::Relaxed), 3);
    }
}
