//! The pager's own heap, counted. Every allocation Rust code in this library makes (the
//! shim, the pager's service thread, its policies, graph and statistics) goes through
//! this allocator; the program's own (its `malloc`, `new`) do not. So what it counts is
//! the memory the pager itself holds beside the budget's frames, reported in the stats
//! (`pager_heap_bytes`, `pager_heap_peak_bytes`) and in the launcher's summary.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// What an allocator holds now and the most it has held at once, in bytes.
struct Counts {
    in_use: AtomicUsize,
    peak: AtomicUsize,
}

impl Counts {
    const fn new() -> Self {
        Self {
            in_use: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
        }
    }

    fn grew(&self, bytes: usize) {
        let now = self.in_use.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn shrank(&self, bytes: usize) {
        self.in_use.fetch_sub(bytes, Ordering::Relaxed);
    }
}

/// The counts of the global allocator: this library's heap.
static HEAP: Counts = Counts::new();

/// The system allocator, counting what goes through it in `counts` (for the global
/// allocator, `HEAP`).
pub struct CountingAllocator {
    counts: &'static Counts,
}

impl CountingAllocator {
    /// The allocator that counts this library's heap.
    pub const fn heap() -> Self {
        Self { counts: &HEAP }
    }
}

// SAFETY: every call is passed on to the system allocator unchanged; only counters
// are updated beside it.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc` is passed on as is.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            self.counts.grew(layout.size());
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            self.counts.grew(layout.size());
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by this allocator (that is, by `System`) with
        // `layout`, as the caller guarantees.
        unsafe { System.dealloc(ptr, layout) };
        self.counts.shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as for `dealloc`; `new_size` meets `realloc`'s contract.
        let moved = unsafe { System.realloc(ptr, layout, new_size) };
        if !moved.is_null() {
            self.counts.shrank(layout.size());
            self.counts.grew(new_size);
        }
        moved
    }
}

/// Bytes the library's Rust code holds on the heap now.
pub fn in_use() -> usize {
    HEAP.in_use.load(Ordering::Relaxed)
}

/// The most it has held at once.
pub fn peak() -> usize {
    HEAP.peak.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An allocator with counts of its own, which the test's other allocations (through
    /// the global allocator, in this and the other test threads) do not change: the
    /// figures are exact.
    #[test]
    fn counts_what_is_held_and_the_most_held() {
        static COUNTS: Counts = Counts::new();
        let allocator = CountingAllocator { counts: &COUNTS };
        let counts = || {
            (
                COUNTS.in_use.load(Ordering::Relaxed),
                COUNTS.peak.load(Ordering::Relaxed),
            )
        };
        let layout = |size| Layout::from_size_align(size, 8).unwrap();
        const MIB: usize = 1 << 20;
        // SAFETY: a non-zero layout; the block is freed below with the layout it has.
        let a = unsafe { allocator.alloc(layout(MIB)) };
        assert!(!a.is_null());
        assert_eq!(counts(), (MIB, MIB));
        // SAFETY: as above.
        let b = unsafe { allocator.alloc_zeroed(layout(3 * MIB)) };
        assert!(!b.is_null());
        assert_eq!(counts(), (4 * MIB, 4 * MIB));
        // SAFETY: frees `b` with its layout.
        unsafe { allocator.dealloc(b, layout(3 * MIB)) };
        assert_eq!(counts(), (MIB, 4 * MIB), "the peak stays");
        // SAFETY: grows `a`, allocated above with this layout.
        let a = unsafe { allocator.realloc(a, layout(MIB), 2 * MIB) };
        assert!(!a.is_null());
        assert_eq!(counts(), (2 * MIB, 4 * MIB), "counted as its new size");
        // SAFETY: grows `a` again, which now has 2 MiB.
        let a = unsafe { allocator.realloc(a, layout(2 * MIB), 5 * MIB) };
        assert!(!a.is_null());
        assert_eq!(counts(), (5 * MIB, 5 * MIB), "a new peak");
        // SAFETY: frees `a` with the layout it now has.
        unsafe { allocator.dealloc(a, layout(5 * MIB)) };
        assert_eq!(counts(), (0, 5 * MIB));
    }
}
