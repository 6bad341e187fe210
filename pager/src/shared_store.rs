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
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

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

/// A detached tmpfs mount: with `huge`, its files use 2 MiB pages.
#[derive(Debug)]
pub struct Tmpfs {
    mount: OwnedFd,
}

impl Tmpfs {
    /// Creates the mount. Fails with EPERM without CAP_SYS_ADMIN, ENOSYS before Linux 5.2.
    pub fn new(huge: bool) -> io::Result<Self> {
        let pages = if huge { c"always" } else { c"never" };
        let mount = sys::files::mount_tmpfs(&[(c"huge", pages), (c"mode", c"0700")])?;
        Ok(Self { mount })
    }

    /// A new unnamed file of `len` bytes (all holes) in the mount.
    pub fn create_file(&self, len: u64) -> io::Result<OwnedFd> {
        sys::files::create_tmpfile(self.mount.as_fd(), len)
    }
}

/// One file of frames, each `stride` bytes apart, and the service's read-write view of
/// it.
#[derive(Debug)]
struct FrameFile {
    file: OwnedFd,
    view: usize,
    len: usize,
}

impl FrameFile {
    fn new(tmpfs: &Tmpfs, len: u64) -> io::Result<Self> {
        let file = tmpfs.create_file(len)?;
        // At a kernel-chosen address (tmpfs aligns it for huge pages); made writable only
        // once mapped: accessible at once under mlockall(MCL_FUTURE), the slots' view,
        // far larger than the memory it will ever hold, would be filled.
        let view = sys::memory::map_shared_inaccessible(file.as_fd(), len as usize)?;
        // SAFETY: the mapping just created, which nothing uses yet.
        unsafe { sys::memory::mprotect(view, len as usize, libc::PROT_READ | libc::PROT_WRITE) }?;
        let frames = Self {
            file,
            view,
            len: len as usize,
        };
        // A forked child must not share the service's view (and cannot use it).
        // SAFETY: advises only the mapping just created; DONTFORK discards nothing.
        unsafe { sys::memory::madvise(view, len as usize, sys::memory::Advice::LinuxDontFork) }?;
        Ok(frames)
    }
}

impl Drop for FrameFile {
    fn drop(&mut self) {
        // SAFETY: the view is this value's own mapping; the service drops the store only
        // after its last read completed.
        let _ = unsafe { sys::memory::munmap(self.view, self.len) };
    }
}

/// Where a frame is: which file, and which of its strides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FrameAt {
    /// A whole huge page in the huge-page file: for blocks of exactly `frame_len`.
    Huge(u32),
    /// A slot in the small-page file: for shorter blocks, which cost only the pages
    /// they fill (a 688 KiB expert slice in a huge page would hold 2 MiB).
    Pages(u32),
}

/// The frames blocks are read into and mapped from. Blocks of `frame_len` bytes (whole
/// huge pages, at huge-page-aligned places) take frames of the huge-page file; shorter
/// ones (an expert's slice, a region's short last block) take slots of a file of small
/// pages, `frame_len` apart so that any slot holds any block, each holding memory only
/// for the pages its reads filled.
///
/// Memory: the frames hold at most `memory_limit` bytes (the budget and a frame): a
/// read that would need more first frees the memory of frames nobody uses, slots
/// first. The frames in use hold what the budget counts (a slot reused for a
/// shorter block gives back the pages past it), so the limit is reached only by free
/// frames kept warm for the next read.
#[derive(Debug)]
pub struct FrameStore {
    huge: FrameFile,
    pages: FrameFile,
    frame_len: usize,
    huge_count: u32,
    slot_count: u32,
    memory_limit: u64,
    /// Free huge frames; the last freed is taken first (its pages are the most recently
    /// used).
    free_huge: Vec<u32>,
    /// Huge frames never taken yet, from `next_huge` on.
    next_huge: u32,
    /// Per huge frame taken so far: whether its page is in memory (not punched).
    huge_holds_memory: Vec<bool>,
    /// Per huge frame taken so far: whether it is in use (taken and not released).
    huge_in_use: Vec<bool>,
    /// Free slots, last freed first.
    free_slots: Vec<u32>,
    next_slot: u32,
    /// Per slot taken so far: bytes of memory its pages hold (from its start).
    slot_bytes: Vec<u64>,
    /// Per slot taken so far: whether it is in use.
    slot_in_use: Vec<bool>,
    memory_bytes: u64,
    peak_memory_bytes: u64,
}

/// Frame indices at and above this are slots (`FrameAt::Pages`).
const SLOT_BASE: u32 = 1 << 31;

/// The small-page file is mapped whole, one `frame_len` per slot: its address space
/// (not its memory) grows with the slots, so they are capped (32 TiB at 2 MiB frames).
const MAX_SLOTS: u64 = 1 << 24;

impl FrameStore {
    /// A store of `count` huge frames of `frame_len` bytes (a multiple of `HUGE_PAGE`)
    /// in a file of `huge` and slots for shorter blocks in a file of `pages`, holding at
    /// most `memory_limit` bytes of memory (at least a frame). Memory is used as frames
    /// are first filled.
    pub fn new(
        huge: &Tmpfs,
        pages: &Tmpfs,
        frame_len: u64,
        count: u32,
        memory_limit: u64,
    ) -> io::Result<Self> {
        let memory_limit = memory_limit.max(frame_len);
        // Every slot in use holds at least a page of a block the budget counts. (A
        // budget grown past the first limit may find the slots taken; the read then
        // waits for an eviction's, as for a huge frame.)
        let slot_count = (memory_limit / sys::memory::page_size()).clamp(1, MAX_SLOTS) as u32;
        Ok(Self {
            huge: FrameFile::new(huge, frame_len * count as u64)?,
            pages: FrameFile::new(pages, frame_len * slot_count as u64)?,
            frame_len: frame_len as usize,
            huge_count: count,
            slot_count,
            memory_limit,
            free_huge: Vec::new(),
            next_huge: 0,
            huge_holds_memory: Vec::new(),
            huge_in_use: Vec::new(),
            free_slots: Vec::new(),
            next_slot: 0,
            slot_bytes: Vec::new(),
            slot_in_use: Vec::new(),
            memory_bytes: 0,
            peak_memory_bytes: 0,
        })
    }

    fn at(&self, frame: u32) -> FrameAt {
        if frame >= SLOT_BASE {
            FrameAt::Pages(frame - SLOT_BASE)
        } else {
            FrameAt::Huge(frame)
        }
    }

    fn file_of(&self, frame: u32) -> (&FrameFile, u32) {
        match self.at(frame) {
            FrameAt::Huge(index) => (&self.huge, index),
            FrameAt::Pages(index) => (&self.pages, index),
        }
    }

    /// The file `frame` is in, to map it from.
    pub fn fd(&self, frame: u32) -> BorrowedFd<'_> {
        self.file_of(frame).0.file.as_fd()
    }

    pub fn frame_len(&self) -> usize {
        self.frame_len
    }

    /// Offset of `frame` in its file (`fd`).
    pub fn offset(&self, frame: u32) -> u64 {
        self.file_of(frame).1 as u64 * self.frame_len as u64
    }

    /// Whether `take` would find a frame for a block of `len` bytes.
    pub fn has_free(&self, len: u64) -> bool {
        if self.is_huge(len) {
            !self.free_huge.is_empty() || self.next_huge < self.huge_count
        } else {
            !self.free_slots.is_empty() || self.next_slot < self.slot_count
        }
    }

    fn is_huge(&self, len: u64) -> bool {
        len == self.frame_len as u64
    }

    /// A free frame for a block of `len` bytes (at most `frame_len`), or None when all
    /// are taken.
    pub fn take(&mut self, len: u64) -> Option<TakenFrame> {
        assert!(len <= self.frame_len as u64, "a block longer than a frame");
        if self.is_huge(len) {
            self.take_huge()
        } else {
            self.take_slot(len)
        }
    }

    fn take_huge(&mut self) -> Option<TakenFrame> {
        let frame = match self.free_huge.pop() {
            Some(frame) => frame,
            None if self.next_huge < self.huge_count => {
                self.next_huge += 1;
                self.huge_holds_memory.push(false);
                self.huge_in_use.push(false);
                self.next_huge - 1
            }
            None => return None,
        };
        self.huge_in_use[frame as usize] = true;
        let warm = self.huge_holds_memory[frame as usize];
        if !warm {
            self.make_memory(self.frame_len as u64);
            self.huge_holds_memory[frame as usize] = true;
            self.add_memory(self.frame_len as u64);
        }
        Some(TakenFrame { index: frame, warm })
    }

    fn take_slot(&mut self, len: u64) -> Option<TakenFrame> {
        let slot = match self.free_slots.pop() {
            Some(slot) => slot,
            None if self.next_slot < self.slot_count => {
                self.next_slot += 1;
                self.slot_bytes.push(0);
                self.slot_in_use.push(false);
                self.next_slot - 1
            }
            None => return None,
        };
        self.slot_in_use[slot as usize] = true;
        let needed = len.next_multiple_of(sys::memory::page_size());
        let held = self.slot_bytes[slot as usize];
        if held > needed {
            // Pages past the block would be memory the budget does not count.
            self.punch_slot(slot, needed);
        } else if held < needed {
            self.make_memory(needed - held);
            self.slot_bytes[slot as usize] = needed;
            self.add_memory(needed - held);
        }
        Some(TakenFrame {
            index: SLOT_BASE + slot,
            warm: held >= needed,
        })
    }

    fn add_memory(&mut self, bytes: u64) {
        self.memory_bytes += bytes;
        self.peak_memory_bytes = self.peak_memory_bytes.max(self.memory_bytes);
    }

    /// Frees the memory of free frames, slots first, until `bytes` more fit the limit
    /// (or no free frame holds any).
    fn make_memory(&mut self, bytes: u64) {
        let over = |store: &Self| store.memory_bytes + bytes > store.memory_limit;
        let mut i = 0;
        while over(self) && i < self.free_slots.len() {
            let slot = self.free_slots[i];
            self.punch_slot(slot, 0);
            i += 1;
        }
        let mut i = 0;
        while over(self) && i < self.free_huge.len() {
            let frame = self.free_huge[i];
            self.punch_huge(frame);
            i += 1;
        }
    }

    /// Frees the memory of `slot`'s pages from `keep` bytes on.
    fn punch_slot(&mut self, slot: u32, keep: u64) {
        let held = self.slot_bytes[slot as usize];
        if held <= keep {
            return;
        }
        let offset = slot as u64 * self.frame_len as u64 + keep;
        // Best effort: failing only leaves the memory in use until the store goes.
        let _ = sys::files::punch_hole(self.pages.file.as_fd(), offset, held - keep);
        self.slot_bytes[slot as usize] = keep;
        self.memory_bytes -= held - keep;
    }

    fn punch_huge(&mut self, frame: u32) {
        if !std::mem::replace(&mut self.huge_holds_memory[frame as usize], false) {
            return;
        }
        let offset = frame as u64 * self.frame_len as u64;
        // Best effort, as in `punch_slot`.
        let _ = sys::files::punch_hole(self.huge.file.as_fd(), offset, self.frame_len as u64);
        self.memory_bytes -= self.frame_len as u64;
    }

    /// Sets the most memory the frames may hold (at least a frame), freeing the memory
    /// of unused frames until they hold no more (as far as frames in use allow: a
    /// budget that shrank evicts first).
    pub fn set_memory_limit(&mut self, limit: u64) {
        self.memory_limit = limit.max(self.frame_len as u64);
        self.make_memory(0);
    }

    /// Bytes of memory the frames hold now, and at most so far: frames in use, and
    /// free frames kept warm for the next read.
    pub fn memory_bytes(&self) -> (u64, u64) {
        (self.memory_bytes, self.peak_memory_bytes)
    }

    /// Gives `frame` back. With `free_memory`, its pages are freed too (a drop hint, a
    /// region gone); otherwise they are kept for the next read, as an eviction does.
    ///
    /// Giving back a frame not in use is a service bug that would hand the frame to two
    /// blocks, one of which then maps the other's bytes: it stops the service, in every
    /// build (one flag looked up per release).
    pub fn release(&mut self, frame: u32, free_memory: bool) {
        match self.at(frame) {
            FrameAt::Huge(index) => {
                let in_use = self.huge_in_use.get_mut(index as usize);
                assert!(
                    in_use.is_some_and(|in_use| std::mem::replace(in_use, false)),
                    "releasing huge frame {index}, not in use"
                );
                if free_memory {
                    self.punch_huge(index);
                }
                self.free_huge.push(index);
            }
            FrameAt::Pages(slot) => {
                let in_use = self.slot_in_use.get_mut(slot as usize);
                assert!(
                    in_use.is_some_and(|in_use| std::mem::replace(in_use, false)),
                    "releasing slot {slot}, not in use"
                );
                if free_memory {
                    self.punch_slot(slot, 0);
                }
                self.free_slots.push(slot);
            }
        }
    }

    /// Where `frame`'s bytes are in the service's view.
    pub fn view(&self, frame: u32) -> *mut u8 {
        let (file, index) = self.file_of(frame);
        let offset = index as usize * self.frame_len;
        assert!(offset < file.len, "frame past the store");
        (file.view + offset) as *mut u8
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
        let _ = unsafe { sys::memory::discard(self.view(frame) as usize, self.frame_len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::memory::HUGE_PAGE;

    /// A store of `count` huge frames. Where the process may not mount tmpfs (EPERM
    /// without CAP_SYS_ADMIN, ENOSYS before Linux 5.2) the test fails, as the
    /// integration tests do, unless HYPEROFFLOAD_ALLOW_SKIP=1: then it says why and gets
    /// None. Any other error is a bug and fails the test.
    fn store(count: u32) -> Option<FrameStore> {
        let tmpfs = |huge: bool| match Tmpfs::new(huge) {
            Ok(tmpfs) => Some(tmpfs),
            Err(error) if matches!(error.raw_os_error(), Some(libc::EPERM | libc::ENOSYS)) => {
                let why = format!("cannot mount tmpfs (huge={huge}): {error}");
                if std::env::var("HYPEROFFLOAD_ALLOW_SKIP").as_deref() == Ok("1") {
                    eprintln!("skipped: {why}");
                    return None;
                }
                panic!("{why} (set HYPEROFFLOAD_ALLOW_SKIP=1 to skip tests that need it)");
            }
            Err(error) => panic!("tmpfs (huge={huge}): {error}"),
        };
        let (huge, pages) = (tmpfs(true)?, tmpfs(false)?);
        Some(FrameStore::new(&huge, &pages, HUGE_PAGE, count, count as u64 * HUGE_PAGE).unwrap())
    }

    #[test]
    fn shorter_blocks_take_slots_that_hold_only_the_pages_they_fill() {
        let Some(mut store) = store(2) else {
            return;
        };
        let slice = 688 << 10;
        let a = store.take(slice).unwrap();
        assert!(a.index >= SLOT_BASE && !a.warm);
        assert_eq!(store.memory_bytes().0, slice);
        // SAFETY: no reads are in flight; the slice is the only user.
        unsafe { store.bytes_mut(a.index, slice as usize) }.fill(3);
        store.release(a.index, false);
        // Reused for a shorter block: the pages past it are given back.
        let again = store.take(4096).unwrap();
        assert_eq!(again.index, a.index);
        assert!(again.warm);
        assert_eq!(store.memory_bytes().0, 4096);
        // SAFETY: as above.
        assert!(unsafe { store.bytes_mut(again.index, 4096) }
            .iter()
            .all(|&x| x == 3));
        store.release(again.index, true);
        assert_eq!(store.memory_bytes().0, 0);
    }

    #[test]
    fn memory_stays_within_the_limit_as_blocks_change_kind() {
        // Two huge frames' worth of memory: fill both huge frames, free them warm, then
        // take slots: their memory comes from the free huge frames'.
        let Some(mut store) = store(2) else {
            return;
        };
        let limit = 2 * HUGE_PAGE;
        let huge: Vec<u32> = (0..2)
            .map(|_| store.take(HUGE_PAGE).unwrap().index)
            .collect();
        for frame in huge {
            store.release(frame, false);
        }
        assert_eq!(store.memory_bytes().0, limit);
        let slots: Vec<u32> = (0..3).map(|_| store.take(1 << 20).unwrap().index).collect();
        assert_eq!(
            store.memory_bytes().0,
            3 << 20,
            "a huge frame's memory freed"
        );
        assert!(store.memory_bytes().1 <= limit);
        for slot in slots {
            store.release(slot, false);
        }
        // And back: a huge frame taken again frees warm slots as needed.
        let frame = store.take(HUGE_PAGE).unwrap();
        assert!(store.memory_bytes().0 <= limit);
        assert!(store.memory_bytes().1 <= limit);
        store.release(frame.index, true);
    }

    #[test]
    fn frames_keep_their_bytes_until_freed_and_are_reused_last_freed_first() {
        let Some(mut store) = store(2) else {
            return;
        };
        let len = HUGE_PAGE as usize;
        let (a, b) = (
            store.take(HUGE_PAGE).unwrap(),
            store.take(HUGE_PAGE).unwrap(),
        );
        assert_eq!(store.take(HUGE_PAGE), None, "two frames only");
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
        let (again_b, again_a) = (
            store.take(HUGE_PAGE).unwrap(),
            store.take(HUGE_PAGE).unwrap(),
        );
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

    #[test]
    fn a_frame_released_when_not_in_use_stops() {
        let Some(mut store) = store(2) else {
            return;
        };
        let frame = store.take(HUGE_PAGE).unwrap().index;
        let slot = store.take(4096).unwrap().index;
        store.release(frame, false);
        let mut stops = |frame: u32| {
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                store.release(frame, false)
            }));
            *outcome.unwrap_err().downcast::<String>().unwrap()
        };
        assert_eq!(stops(frame), "releasing huge frame 0, not in use");
        assert_eq!(stops(slot + 1), "releasing slot 1, not in use");
    }
}
