//! The pager's own heap, counted. Every allocation Rust code in this library makes (the
//! shim, the pager's service thread, its policies, graph and statistics) goes through
//! this allocator; the program's own (its `malloc`, `new`) do not. So what it counts is
//! the memory the pager itself holds beside the budget's frames, reported in the stats
//! (`pager_heap_bytes`, `pager_heap_peak_bytes`) and in the launcher's summary.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

pub struct CountingAllocator;

static IN_USE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(bytes: usize) {
    let now = IN_USE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

fn shrank(bytes: usize) {
    IN_USE.fetch_sub(bytes, Ordering::Relaxed);
}

// SAFETY: every call is passed on to the system allocator unchanged; only counters
// are updated beside it.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc` is passed on as is.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            grew(layout.size());
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            grew(layout.size());
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by this allocator (that is, by `System`) with
        // `layout`, as the caller guarantees.
        unsafe { System.dealloc(ptr, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as for `dealloc`; `new_size` meets `realloc`'s contract.
        let moved = unsafe { System.realloc(ptr, layout, new_size) };
        if !moved.is_null() {
            shrank(layout.size());
            grew(new_size);
        }
        moved
    }
}

/// Bytes the library's Rust code holds on the heap now.
pub fn in_use() -> usize {
    IN_USE.load(Ordering::Relaxed)
}

/// The most it has held at once.
pub fn peak() -> usize {
    PEAK.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_what_is_held_and_the_most_held() {
        let allocator = CountingAllocator;
        let before = in_use();
        let layout = Layout::from_size_align(1 << 20, 8).unwrap();
        // SAFETY: a non-zero layout; the block is freed below with the same layout.
        let ptr = unsafe { allocator.alloc(layout) };
        assert!(!ptr.is_null());
        assert!(in_use() >= before + (1 << 20));
        assert!(peak() >= in_use());
        // SAFETY: grows the block allocated above.
        let ptr = unsafe { allocator.realloc(ptr, layout, 2 << 20) };
        assert!(!ptr.is_null());
        let grown = Layout::from_size_align(2 << 20, 8).unwrap();
        // SAFETY: frees the block with the layout it now has.
        unsafe { allocator.dealloc(ptr, grown) };
        assert!(peak() >= before + (2 << 20));
    }
}
