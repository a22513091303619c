//! A counting global allocator for tests and benches (a dev-dependency only, never shipped).
//!
//! Install it in a test or bench binary, then count what a closure allocates on the calling
//! thread (other threads' allocations, such as a test harness's, are not counted):
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOC: slackgate_alloc_count::Counting = slackgate_alloc_count::Counting;
//!
//! let (value, allocations) = slackgate_alloc_count::counted(|| build_something());
//! ```
//!
//! An allocation is a call to `alloc`, `alloc_zeroed` or `realloc` (a growth is one more);
//! frees are not counted. Without the allocator installed, [`counted`] reports 0.
//!
//! To find where they come from, set `SLACKGATE_ALLOC_TRACE=N`: the first `N` counted
//! allocations of each [`counted`] call print their backtrace to standard error (build with
//! debug line tables, e.g. `cargo test --release` with `CARGO_PROFILE_RELEASE_DEBUG=1`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// The system allocator, counting the allocations of a thread inside [`counted`].
pub struct Counting;

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static COUNT: Cell<u64> = const { Cell::new(0) };
    /// Backtraces still to print in this `counted` call (`SLACKGATE_ALLOC_TRACE`).
    static TRACE: Cell<u64> = const { Cell::new(0) };
}

fn note_one() {
    // `try_with`: while a thread is torn down its slots may be gone; nothing is counted then.
    // Const-initialised thread-locals of `Cell`s never allocate, so this cannot recurse.
    let _ = COUNTING.try_with(|on| {
        if on.get() {
            let _ = COUNT.try_with(|n| n.set(n.get().saturating_add(1)));
            if TRACE.try_with(Cell::get).unwrap_or(0) > 0 {
                // Off while the backtrace (which allocates) is taken and printed.
                on.set(false);
                TRACE.with(|t| t.set(t.get() - 1));
                eprintln!(
                    "counted allocation:\n{}",
                    std::backtrace::Backtrace::force_capture()
                );
                on.set(true);
            }
        }
    });
}

// SAFETY: every method forwards its arguments unchanged to the system allocator, so the
// caller's contract is the system allocator's; counting touches only thread-local cells.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note_one();
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, passed on as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator, hence from `System`, with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note_one();
        // SAFETY: as `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note_one();
        // SAFETY: `ptr` came from `System` with `layout`; the caller upholds the rest.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Run `f` and return its value with the heap allocations it made on this thread (0 when
/// [`Counting`] is not the global allocator). Nested calls count into the innermost.
pub fn counted<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let trace = std::env::var("SLACKGATE_ALLOC_TRACE")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    TRACE.with(|t| t.set(trace));
    let was = COUNTING.with(|on| on.replace(true));
    let before = COUNT.with(|n| n.replace(0));
    let out = f();
    let n = COUNT.with(Cell::get);
    COUNTING.with(|on| on.set(was));
    COUNT.with(|c| c.set(before.saturating_add(if was { n } else { 0 })));
    (out, n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[global_allocator]
    static ALLOC: Counting = Counting;

    #[test]
    fn it_counts_what_the_closure_allocates_and_nothing_else() {
        let (v, n) = counted(|| vec![1u8; 100]);
        assert_eq!(n, 1);
        let (_, none) = counted(|| v.len() * 2);
        assert_eq!(none, 0);
        let (s, grown) = counted(|| {
            let mut s = String::with_capacity(1);
            s.push_str("more than one byte");
            s
        });
        assert_eq!(grown, 2, "{s}");
    }

    #[test]
    fn a_nested_count_is_part_of_the_outer_one() {
        let ((_, inner), outer) = counted(|| {
            let a = Box::new(1u64);
            let b = counted(|| Box::new(2u64));
            (a, b.1)
        });
        assert_eq!((inner, outer), (1, 2));
    }
}
