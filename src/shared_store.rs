//! Zero-copy backing for regions: a pool of block-sized frames in one file of a private
//! huge-page tmpfs. A read lands in a free frame (O_DIRECT into the service's view of the
//! file); installing the block maps that frame over the block's place in the region
//! (mmap MAP_FIXED of the file, populated: 2 MiB pages are mapped whole) and registers
//! that mapping for missing and minor faults. Evicting the block only drops its page
//! table entries (MADV_DONTNEED): the mapping still names the old frame, whose pages
//! are in the file, so the next access is a minor fault, which the service serves like
//! any fault on a missing block, and the frame takes the next read. Nothing is copied,
//! allocated or cleared per read once the pool is warm, and the program's pages are
//! huge pages.
//!
//! Measured per 2 MiB block (a C model of this scheme, 2 GiB scanned through a 1 GiB
//! budget, 8 readers, memory warm): UFFDIO_COPY 520-690 us + MADV_DONTNEED 110-130 us;
//! mapping a frame 100-120 us + dropping it 6 us; whole-process CPU 0.35 s/GiB against
//! 0.08-0.09.
//!
//! Why tmpfs, and why huge pages. The frames must be memory the kernel can map at any
//! address without copying: pages of a file. They must be 2 MiB pages: an O_DIRECT read
//! is one device segment per physically contiguous piece of its buffer and a virtio disk
//! takes a few hundred per request, so into 4 KiB pages a 1 MiB read is split and the
//! disk gives half its bandwidth (1.5-1.7 GB/s into 4 KiB shmem pages here, 3.2 into
//! 2 MiB ones). The system's own shmem (memfd) has huge pages off by default
//! (`shmem_enabled = never`), which a pager must not change for everyone; a tmpfs mounted
//! with `huge=always` has them whatever that knob says. The mount is made with the new
//! mount API (fsopen/fsmount) and never attached to any directory: nobody sees it, it
//! needs no cleanup, and it goes with its last open file. Creating it needs
//! CAP_SYS_ADMIN; without it the pager copies, and its statistics say why.
//!
//! The one thing copying gave for free: a page the kernel itself holds (a program's
//! `write(2)` from the region, in progress while the block is evicted) kept its bytes;
//! a reused frame's page is overwritten by the next read. Zero copy is opt-in for that
//! reason too.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};

use crate::sys;

/// A frame handed out for a read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TakenFrame {
    pub index: u32,
    /// Whether its pages are in memory already. If not, the read landing in it first
    /// allocates and clears them, which can take far longer than the read (see
    /// `FaultService::start_read`).
    pub warm: bool,
}

/// A detached tmpfs mount whose files use 2 MiB pages.
#[derive(Debug)]
pub struct HugeTmpfs {
    mount: OwnedFd,
}

impl HugeTmpfs {
    /// Creates the mount. Fails with EPERM without CAP_SYS_ADMIN, ENOSYS before Linux 5.2.
    pub fn new() -> io::Result<Self> {
        let mount = sys::mount_tmpfs(&[(c"huge", c"always"), (c"mode", c"0700")])?;
        Ok(Self { mount })
    }

    /// A new unnamed file of `len` bytes (all holes) in the mount.
    pub fn create_file(&self, len: u64) -> io::Result<OwnedFd> {
        sys::create_tmpfile(self.mount.as_fd(), len)
    }
}

/// The frames: a file of `count` frames of `frame_len` bytes, the service's read-write view
/// of it (where reads land), and which frames are free.
#[derive(Debug)]
pub struct FrameStore {
    file: OwnedFd,
    view: usize,
    frame_len: usize,
    count: u32,
    /// Free frames; the last freed is taken first (its pages are the most recently used).
    free: Vec<u32>,
    /// Frames never taken yet, from `next_fresh` on.
    next_fresh: u32,
    /// Per frame taken so far: whether its pages are in memory (not punched).
    holds_memory: Vec<bool>,
    /// Frames holding memory now, and at most so far.
    memory_frames: u32,
    peak_memory_frames: u32,
}

impl FrameStore {
    /// A store of `count` frames of `frame_len` bytes (a multiple of `HUGE_PAGE`) in a file
    /// of `tmpfs`. Memory is used as frames are first filled.
    pub fn new(tmpfs: &HugeTmpfs, frame_len: u64, count: u32) -> io::Result<Self> {
        let len = frame_len * count as u64;
        let file = tmpfs.create_file(len)?;
        // SAFETY: a new shared mapping of a file this value owns, at a kernel-chosen
        // address (tmpfs aligns it for huge pages); it replaces nothing.
        let view = unsafe {
            sys::mmap(
                0,
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                file.as_raw_fd(),
                0,
            )
        }?;
        let store = Self {
            file,
            view,
            frame_len: frame_len as usize,
            count,
            free: Vec::new(),
            next_fresh: 0,
            holds_memory: Vec::new(),
            memory_frames: 0,
            peak_memory_frames: 0,
        };
        // A forked child must not share the service's view (and cannot use it).
        // SAFETY: advises only the mapping just created; DONTFORK discards nothing.
        unsafe { sys::madvise(view, len as usize, sys::Advice::LinuxDontFork) }?;
        Ok(store)
    }

    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    pub fn frame_len(&self) -> usize {
        self.frame_len
    }

    /// File offset of `frame`.
    pub fn offset(&self, frame: u32) -> u64 {
        frame as u64 * self.frame_len as u64
    }

    /// Whether `take` would find a frame.
    pub fn has_free(&self) -> bool {
        !self.free.is_empty() || self.next_fresh < self.count
    }

    /// A free frame, or None when all are taken.
    pub fn take(&mut self) -> Option<TakenFrame> {
        let frame = match self.free.pop() {
            Some(frame) => frame,
            None if self.next_fresh < self.count => {
                self.next_fresh += 1;
                self.holds_memory.push(false);
                self.next_fresh - 1
            }
            None => return None,
        };
        // The read about to land in it fills it.
        let warm = std::mem::replace(&mut self.holds_memory[frame as usize], true);
        if !warm {
            self.memory_frames += 1;
            self.peak_memory_frames = self.peak_memory_frames.max(self.memory_frames);
        }
        Some(TakenFrame { index: frame, warm })
    }

    /// Bytes of memory the frames hold now, and at most so far: frames in use, and
    /// free frames kept warm for the next read.
    pub fn memory_bytes(&self) -> (u64, u64) {
        let frame = self.frame_len as u64;
        (
            self.memory_frames as u64 * frame,
            self.peak_memory_frames as u64 * frame,
        )
    }

    /// Gives `frame` back. With `free_memory`, its pages are freed too (a drop hint, a
    /// region gone); otherwise they are kept for the next read, as an eviction does.
    pub fn release(&mut self, frame: u32, free_memory: bool) {
        debug_assert!(frame < self.next_fresh && !self.free.contains(&frame));
        if free_memory {
            // Best effort: failing only leaves the memory in use until the store goes.
            // The frame is free, so no read lands in it and no region maps it.
            let _ = sys::punch_hole(self.file.as_fd(), self.offset(frame), self.frame_len as u64);
            if std::mem::replace(&mut self.holds_memory[frame as usize], false) {
                self.memory_frames -= 1;
            }
        }
        self.free.push(frame);
    }

    /// Where `frame`'s bytes are in the service's view.
    pub fn view(&self, frame: u32) -> *mut u8 {
        assert!(frame < self.count, "frame past the store");
        (self.view + frame as usize * self.frame_len) as *mut u8
    }

    /// The first `len` bytes of `frame` in the service's view, to fill or check.
    ///
    /// # Safety
    /// No read may be in flight into the frame, and nothing else may use the slice while
    /// it lives.
    pub unsafe fn bytes_mut(&mut self, frame: u32, len: usize) -> &mut [u8] {
        assert!(len <= self.frame_len, "range past the frame");
        // SAFETY: the range lies inside the view, live as long as `self`; the caller
        // guarantees exclusive use.
        unsafe { std::slice::from_raw_parts_mut(self.view(frame), len) }
    }

    /// Unmaps `frame` from the service's view after a read: the pages stay in the file,
    /// and the process's resident set counts them once (the region's), not twice.
    /// Cheap: a huge page is one page-table entry here, and the next read into the frame
    /// maps it back without a copy.
    pub fn forget_view(&self, frame: u32) {
        // SAFETY: MADV_DONTNEED on a shared mapping only unmaps it: the file keeps its
        // bytes, and the service holds no reference into the frame. (Locked too: under
        // mlockall(MCL_FUTURE) the view is.)
        let _ = unsafe { sys::discard(self.view(frame) as usize, self.frame_len) };
    }
}

impl Drop for FrameStore {
    fn drop(&mut self) {
        // SAFETY: the view is this value's own mapping; the service drops the store only
        // after its last read completed.
        let _ = unsafe { sys::munmap(self.view, self.frame_len * self.count as usize) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::HUGE_PAGE;

    #[test]
    fn frames_keep_their_bytes_until_freed_and_are_reused_last_freed_first() {
        let Ok(tmpfs) = HugeTmpfs::new() else {
            // Unit tests may run unprivileged; the integration tests require it.
            return;
        };
        let len = HUGE_PAGE as usize;
        let mut store = FrameStore::new(&tmpfs, HUGE_PAGE, 2).unwrap();
        let (a, b) = (store.take().unwrap(), store.take().unwrap());
        assert_eq!(store.take(), None, "two frames only");
        assert!(!a.warm && !b.warm, "fresh frames hold no memory yet");
        let (a, b) = (a.index, b.index);
        // SAFETY: no reads are in flight; the slices are the only users.
        unsafe { store.bytes_mut(a, len) }.fill(7);
        // SAFETY: as above.
        unsafe { store.bytes_mut(b, len) }.fill(9);
        store.forget_view(a);
        store.release(a, false);
        store.release(b, true);
        assert_eq!(store.memory_bytes(), (len as u64, 2 * len as u64));
        let (again_b, again_a) = (store.take().unwrap(), store.take().unwrap());
        assert_eq!(again_b.index, b, "the last freed frame comes first");
        assert_eq!(again_a.index, a);
        assert!(again_a.warm, "kept its pages");
        assert!(!again_b.warm, "its pages were freed");
        assert_eq!(store.memory_bytes(), (2 * len as u64, 2 * len as u64));
        // SAFETY: as above.
        assert!(unsafe { store.bytes_mut(a, len) }.iter().all(|&x| x == 7));
        // SAFETY: as above.
        assert!(unsafe { store.bytes_mut(b, len) }.iter().all(|&x| x == 0));
    }
}
