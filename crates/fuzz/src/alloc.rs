//! An allocator that counts live bytes and aborts the process, naming the cause, when one
//! allocation would take them past a cap: runaway memory (a template multiplying a string, a
//! count trusted from a file) shows up as a crash with a reproducer instead of swapping the
//! machine. The `q4moe-fuzz` binary installs it; the supervisor reads the abort as a failure.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};

static LIVE: AtomicUsize = AtomicUsize::new(0);
static CAP: AtomicUsize = AtomicUsize::new(usize::MAX);

/// What the abort prints, so the supervisor can tell this crash from others.
pub const CAP_MESSAGE: &str = "q4moe-fuzz: allocation past the memory cap";

pub struct CappedAlloc;

/// Sets the cap in bytes for the rest of the process.
pub fn set_cap(bytes: usize) {
    CAP.store(bytes, Ordering::Relaxed);
}

fn reserve(size: usize) {
    let live = LIVE.fetch_add(size, Ordering::Relaxed);
    if live.saturating_add(size) > CAP.load(Ordering::Relaxed) {
        // No allocation from here on: the message is static and stderr is unbuffered.
        let _ = std::io::stderr().write_all(CAP_MESSAGE.as_bytes());
        let _ = std::io::stderr().write_all(b"\n");
        std::process::abort();
    }
}

// SAFETY: every call is forwarded to the system allocator unchanged; only counts are kept.
unsafe impl GlobalAlloc for CappedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        reserve(layout.size());
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        reserve(layout.size());
        System.alloc_zeroed(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() {
            reserve(new_size - layout.size());
        } else {
            LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
        }
        System.realloc(ptr, layout, new_size)
    }
}
