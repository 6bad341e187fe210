//! Buffers for prefetch markers held back until the program faults on them.
//!
//! A marker block (see `policy::Install::OnFault`) is read like any other but installed
//! only when the program reaches it, so the prefetch policy hears of its progress. Held
//! in its read slot, each marker kept a whole read buffer and queue slot idle: with a
//! quarter of the queue allowed to hold markers, the device saw about half the reads it
//! could have. A marker's bytes are copied here instead (one block, a few KiB) and its
//! slot goes back to reading.

use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};

/// A fixed number of page-aligned buffers of one block each.
pub(crate) struct Stash {
    memory: *mut u8,
    layout: Layout,
    block: usize,
    free: Vec<u32>,
}

// SAFETY: the memory is owned by the stash and only reached through `&self`/`&mut self`.
unsafe impl Send for Stash {}

impl Stash {
    /// `count` buffers of `block` bytes (a multiple of the page size, a power of two).
    pub(crate) fn new(count: u32, block: usize, page: usize) -> Self {
        let count = count.max(1);
        let layout = Layout::from_size_align(block * count as usize, page)
            .expect("block sizes are checked powers of two, far below isize::MAX");
        // SAFETY: the layout has a non-zero size (count >= 1, block >= one page).
        let memory = unsafe { alloc_zeroed(layout) };
        if memory.is_null() {
            handle_alloc_error(layout);
        }
        Self {
            memory,
            layout,
            block,
            free: (0..count).rev().collect(),
        }
    }

    /// Takes a free buffer and fills it with `bytes` (at most one block).
    pub(crate) fn put(&mut self, bytes: &[u8]) -> Option<u32> {
        assert!(bytes.len() <= self.block, "a marker longer than a block");
        let index = self.free.pop()?;
        self.buffer_mut(index)[..bytes.len()].copy_from_slice(bytes);
        Some(index)
    }

    /// The block-sized buffer `index` (valid while it is taken).
    pub(crate) fn buffer(&self, index: u32) -> &[u8] {
        // SAFETY: `index` < count, so the block lies inside the allocation.
        unsafe {
            std::slice::from_raw_parts(self.memory.add(index as usize * self.block), self.block)
        }
    }

    fn buffer_mut(&mut self, index: u32) -> &mut [u8] {
        // SAFETY: as in `buffer`; `&mut self` makes the borrow unique.
        unsafe {
            std::slice::from_raw_parts_mut(self.memory.add(index as usize * self.block), self.block)
        }
    }

    /// Returns buffer `index` to the free list.
    ///
    /// A buffer that is not the stash's, or already free, is a service bug that would hand
    /// one buffer to two markers (one then installs the other's bytes) or one past the
    /// allocation: it stops the service, in every build. The free list is at most a queue
    /// depth long (`max_staged`), so the look-up is cheap.
    pub(crate) fn release(&mut self, index: u32) {
        let count = self.layout.size() / self.block;
        assert!(
            (index as usize) < count && !self.free.contains(&index),
            "releasing stash buffer {index}, not in use"
        );
        self.free.push(index);
    }
}

impl Drop for Stash {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { dealloc(self.memory, self.layout) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_bytes_until_released() {
        let mut stash = Stash::new(2, 4096, 4096);
        let a = stash.put(&[1u8; 100]).unwrap();
        let b = stash.put(&[2u8; 4096]).unwrap();
        assert!(stash.put(&[3u8; 1]).is_none(), "only two buffers");
        assert_eq!(stash.buffer(a)[..100], [1u8; 100]);
        assert_eq!(stash.buffer(b)[4095], 2);
        assert_eq!(stash.buffer(a).as_ptr() as usize % 4096, 0);
        stash.release(a);
        let c = stash.put(&[4u8; 10]).unwrap();
        assert_eq!(c, a);
        assert_eq!(stash.buffer(c)[..10], [4u8; 10]);
    }

    #[test]
    #[should_panic(expected = "releasing stash buffer 0, not in use")]
    fn a_buffer_released_twice_stops() {
        let mut stash = Stash::new(2, 4096, 4096);
        let a = stash.put(&[1u8; 10]).unwrap();
        stash.release(a);
        stash.release(a);
    }

    #[test]
    #[should_panic(expected = "releasing stash buffer 2, not in use")]
    fn a_buffer_past_the_stash_stops_when_released() {
        let mut stash = Stash::new(2, 4096, 4096);
        stash.release(2);
    }
}
