//! A minimal fork-join pool for the forward pass's ~300 parallel regions per token.
//!
//! Rayon's idle workers `sched_yield` while they wait for work; on a shared machine that hands
//! the core to any runnable process (a niced compile, say) for a whole time slice at every join,
//! which halved decode speed under background load. Here the helper threads spin with
//! `spin_loop` between regions (parking only after ~a few ms without work), and tasks are
//! claimed from one atomic counter, so a region costs two cache-line round trips.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::*};
use std::sync::{Arc, Condvar, Mutex, OnceLock, TryLockError};

type Task = dyn Fn(usize) + Sync;

#[repr(align(128))]
struct Padded<T>(T);

struct Shared {
    /// Bumped once per region; helpers start work when it changes.
    epoch: Padded<AtomicUsize>,
    /// Next task index to claim.
    next: Padded<AtomicUsize>,
    /// Per helper: the last epoch it has finished with (no references to the job after).
    acks: Vec<Padded<AtomicUsize>>,
    /// The current job: written only while every helper has acked the previous epoch.
    job: UnsafeCell<(*const Task, usize)>,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    cv: Condvar,
    stop: AtomicBool,
    /// A helper's task panicked in the current region (re-raised by the caller).
    panicked: AtomicBool,
}

// SAFETY: `job` is written by the region's caller only while no helper reads it (all acked),
// and published by the Release store of `epoch`.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

pub(crate) struct Pool {
    shared: Arc<Shared>,
    /// One region at a time; a second concurrent caller runs its region serially.
    busy: Mutex<()>,
}

/// Spins before a helper parks (~a few ms: long enough to bridge the serial parts of a token
/// and the sampling between tokens).
const SPINS: usize = 1 << 19;

impl Pool {
    fn new(threads: usize) -> Pool {
        let helpers = threads.saturating_sub(1);
        let shared = Arc::new(Shared {
            epoch: Padded(AtomicUsize::new(0)),
            next: Padded(AtomicUsize::new(0)),
            acks: (0..helpers).map(|_| Padded(AtomicUsize::new(0))).collect(),
            job: UnsafeCell::new((std::ptr::null::<fn(usize)>() as *const Task, 0)),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            cv: Condvar::new(),
            stop: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
        });
        for h in 0..helpers {
            let s = shared.clone();
            std::thread::Builder::new()
                .name(format!("q4moe-cpu-{h}"))
                .spawn(move || helper(&s, h))
                .expect("spawn helper thread");
        }
        Pool {
            shared,
            busy: Mutex::new(()),
        }
    }

    pub(crate) fn threads(&self) -> usize {
        self.shared.acks.len() + 1
    }

    /// Runs `f(0..n)` across the pool (the caller works too); returns when all are done. A
    /// panic in any task is raised here, after every helper has let go of `f`.
    pub(crate) fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        if n <= 1 || self.shared.acks.is_empty() {
            return (0..n).for_each(f);
        }
        let guard = match self.busy.try_lock() {
            Ok(g) => g,
            // A region that panicked left the lock poisoned; the pool itself is consistent.
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return (0..n).for_each(f),
        };
        let s = &*self.shared;
        // SAFETY: lifetime erased; every helper acks this epoch (drops all use of `f`) before
        // this function returns.
        let f_static: *const Task =
            unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static Task>(f) };
        let e = s.epoch.0.load(Relaxed) + 1;
        // SAFETY: all helpers acked epoch e - 1, so none reads `job` now.
        unsafe { *s.job.get() = (f_static, n) };
        s.next.0.store(0, Relaxed);
        s.panicked.store(false, Relaxed);
        s.epoch.0.store(e, SeqCst);
        if s.sleepers.load(SeqCst) > 0 {
            let _g = s.lock.lock().unwrap();
            s.cv.notify_all();
        }
        // Waits for the helpers even when the caller's own task unwinds: they still use `f`.
        let acks = AwaitAcks(s, e);
        work(s, f, n);
        drop(acks);
        drop(guard);
        if s.panicked.load(Acquire) {
            panic!("a task of a parallel region panicked on a CPU worker thread");
        }
    }
}

/// Spins until every helper has acked epoch `.1` (on drop, so also during unwinding).
struct AwaitAcks<'a>(&'a Shared, usize);

impl Drop for AwaitAcks<'_> {
    fn drop(&mut self) {
        for a in &self.0.acks {
            while a.0.load(Acquire) != self.1 {
                std::hint::spin_loop();
            }
        }
    }
}

fn work(s: &Shared, f: &(dyn Fn(usize) + Sync), n: usize) {
    loop {
        let i = s.next.0.fetch_add(1, Relaxed);
        if i >= n {
            break;
        }
        f(i);
    }
}

fn helper(s: &Shared, h: usize) {
    let mut last = 0;
    loop {
        let mut spins = 0;
        let e = loop {
            let e = s.epoch.0.load(Acquire);
            if e != last {
                break e;
            }
            if s.stop.load(Relaxed) {
                return;
            }
            spins += 1;
            if spins < SPINS {
                std::hint::spin_loop();
                continue;
            }
            let mut g = s.lock.lock().unwrap();
            s.sleepers.fetch_add(1, SeqCst);
            while s.epoch.0.load(SeqCst) == last && !s.stop.load(SeqCst) {
                g = s.cv.wait(g).unwrap();
            }
            s.sleepers.fetch_sub(1, SeqCst);
            spins = 0;
        };
        // SAFETY: published by the Release/SeqCst store of `epoch`; valid until we ack `e`.
        let (f, n) = unsafe { *s.job.get() };
        // A panicking task must still ack, or the caller would wait forever.
        if catch_unwind(AssertUnwindSafe(|| work(s, unsafe { &*f }, n))).is_err() {
            s.panicked.store(true, Release);
        }
        s.acks[h].0.store(e, Release);
        last = e;
    }
}

/// The thread count `set_threads` chose, read once when the pool starts.
static CHOSEN: OnceLock<usize> = OnceLock::new();
static POOL: OnceLock<Pool> = OnceLock::new();

/// `set_threads` could not take effect.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ThreadsError {
    #[error("the thread count must be at least 1")]
    Zero,
    /// The pool starts once per process (its helpers spin between regions), so a second,
    /// different count cannot be honoured; saying so beats silently running with the old one.
    #[error("the CPU pool's thread count is already {running}; cannot switch to {wanted}")]
    AlreadyStarted { running: usize, wanted: usize },
}

/// Sets the CPU pool's thread count (the calling thread included) for the whole process. Call
/// it at the edge (the CLI's `--threads`) before the first forward pass; setting the count the
/// pool already runs with is accepted. Without it the pool takes rayon's count
/// (`RAYON_NUM_THREADS`, else every core), read when the pool starts.
pub fn set_threads(n: usize) -> Result<(), ThreadsError> {
    if n == 0 {
        return Err(ThreadsError::Zero);
    }
    let chosen = *CHOSEN.get_or_init(|| n);
    let running = POOL.get().map_or(chosen, Pool::threads);
    if running != n {
        return Err(ThreadsError::AlreadyStarted { running, wanted: n });
    }
    // Rayon's global pool does the rest of the CPU work (the sampler's sorts, the weights'
    // checks); it takes the same count where it has not started yet, and keeps its own if it has.
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global();
    Ok(())
}

/// The CPU pool's thread count (starting the pool if it has not started).
pub fn threads() -> usize {
    pool().threads()
}

/// The process-wide pool (`set_threads`, else `RAYON_NUM_THREADS` or all cores).
pub(crate) fn pool() -> &'static Pool {
    POOL.get_or_init(|| {
        let n = *CHOSEN.get_or_init(rayon::current_num_threads);
        Pool::new(n)
    })
}

/// A raw pointer that may cross threads (disjoint chunks are written through it).
struct SendPtr<T>(*mut T);
impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}
impl<T> SendPtr<T> {
    /// Through a method, so a closure captures the whole SendPtr (Sync), not its raw field.
    fn get(self) -> *mut T {
        self.0
    }
}

/// `f(start, piece)` over disjoint pieces covering `out`, in parallel. Pieces are claimed
/// largest first (a quarter of what is left per claim with 2 threads, never under `min`
/// elements): a region's work splits into few long contiguous runs, and the last claims are
/// small, so the threads reach the join together instead of one waiting out a whole task.
pub(crate) fn guided_mut<T: Send>(out: &mut [T], min: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let len = out.len();
    let p = SendPtr(out.as_mut_ptr());
    let next = AtomicUsize::new(0);
    let pool = pool();
    let share = 2 * pool.threads();
    // One task per thread, each claiming pieces until none are left.
    pool.run(pool.threads(), &|_| loop {
        let start = next.load(Relaxed);
        if start >= len {
            break;
        }
        let n = ((len - start) / share).max(min).min(len - start);
        if next
            .compare_exchange_weak(start, start + n, Relaxed, Relaxed)
            .is_ok()
        {
            // SAFETY: each range [start, start + n) is claimed once and lies within `out`,
            // which outlives the region.
            f(start, unsafe {
                std::slice::from_raw_parts_mut(p.get().add(start), n)
            })
        }
    });
}

/// Two slices split in step into fixed chunks: `f(i, a chunk i, b chunk i)` in parallel.
pub(crate) fn chunks_mut2<A: Send, B: Send>(
    a: &mut [A],
    ca: usize,
    b: &mut [B],
    cb: usize,
    f: impl Fn(usize, &mut [A], &mut [B]) + Sync,
) {
    let n = a.len().div_ceil(ca).min(b.len().div_ceil(cb));
    let (la, lb) = (a.len(), b.len());
    let (pa, pb) = (SendPtr(a.as_mut_ptr()), SendPtr(b.as_mut_ptr()));
    pool().run(n, &|i| {
        // SAFETY: chunks are disjoint and within each slice, which outlive the region.
        let x =
            unsafe { std::slice::from_raw_parts_mut(pa.get().add(i * ca), ca.min(la - i * ca)) };
        let y =
            unsafe { std::slice::from_raw_parts_mut(pb.get().add(i * cb), cb.min(lb - i * cb)) };
        f(i, x, y)
    });
}

#[cfg(test)]
mod tests {
    use super::{set_threads, ThreadsError};

    /// The count is set once: the running count is accepted again, another is refused, 0 never.
    #[test]
    fn set_threads_accepts_the_running_count_and_refuses_another() {
        let running = super::pool().threads();
        assert_eq!(set_threads(0), Err(ThreadsError::Zero));
        assert_eq!(set_threads(running), Ok(()));
        let err = set_threads(running + 1).unwrap_err();
        assert_eq!(
            err,
            ThreadsError::AlreadyStarted {
                running,
                wanted: running + 1
            }
        );
        assert!(err.to_string().contains(&format!("already {running}")));
    }

    /// A panicking task is raised in the caller (not a hang), and the pool keeps working.
    #[test]
    fn a_panicking_task_is_raised_and_the_pool_recovers() {
        let pool = super::pool();
        for _ in 0..3 {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                pool.run(64, &|i| {
                    if i % 2 == 1 {
                        panic!("task {i} fails on purpose");
                    }
                })
            }));
            assert!(r.is_err(), "the panic was lost");
            let done = std::sync::atomic::AtomicUsize::new(0);
            pool.run(64, &|_| {
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            });
            assert_eq!(done.into_inner(), 64);
        }
    }

    #[test]
    fn guided_mut_covers_every_element_once() {
        for (len, min) in [
            (0, 16),
            (1, 16),
            (15, 16),
            (17, 16),
            (6144, 16),
            (151_936, 16),
            (100, 1),
        ] {
            let mut v = vec![0u32; len];
            super::guided_mut(&mut v, min, |start, piece| {
                assert!(!piece.is_empty());
                assert!(
                    piece.len() >= min.min(len - start),
                    "a piece below the minimum"
                );
                for (i, x) in piece.iter_mut().enumerate() {
                    *x += (start + i) as u32 + 1;
                }
            });
            assert!(
                v.iter().enumerate().all(|(i, &x)| x == i as u32 + 1),
                "len {len}: an element visited other than once"
            );
        }
    }
}
