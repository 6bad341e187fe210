//! io_uring for the fault service: reads into buffers the ring owns, and polls that wake
//! the service when a uffd event or a command arrives. `driver` is the one place that
//! submits io_uring entries; unit tests put a scripted stand-in there (`scripted`).
//!
//! As in tokio-uring, the ring owns every buffer it reads into (a slab keyed by
//! `user_data`, `slots`), and each slot's state says who may touch its buffer: nobody
//! while the read is in flight (the kernel writes it), the service once its completion
//! was reaped. Accessing the buffer of a read in flight, or freeing its slot, panics
//! rather than race with the kernel.

use std::io;
use std::os::fd::RawFd;

mod driver;
#[cfg(test)]
pub(crate) mod scripted;
mod slots;

pub use driver::RingError;
use driver::{Driver, Posted, Request};
use slots::ReadSlots;

/// The read buffers: one anonymous mapping, aligned to and advised for transparent huge
/// pages.
///
/// Huge pages matter for speed, not just TLBs: an O_DIRECT read is split into one
/// device segment per physically contiguous piece of the buffer, and a virtio disk takes
/// at most a few hundred segments per request. Into 4 KiB pages a 4 MiB read becomes
/// several requests; into 2 MiB pages it stays one, as the kernel's own readahead into
/// large folios does.
pub struct BufferArena {
    /// The mapping as created (one huge page longer than needed, for alignment).
    mapping: usize,
    mapped_len: usize,
    /// The first huge-page boundary in the mapping: buffer 0.
    base: usize,
    buffer_len: usize,
}

// SAFETY: the arena is plain memory owned by this value; access goes through
// &self / &mut self of the ring that owns it.
unsafe impl Send for BufferArena {}

const HUGE_PAGE: usize = crate::sys::memory::HUGE_PAGE as usize;

impl BufferArena {
    pub fn new(count: usize, buffer_len: usize) -> io::Result<Self> {
        let len = (count * buffer_len).next_multiple_of(HUGE_PAGE);
        let mapped_len = len + HUGE_PAGE;
        // SAFETY: an anonymous private mapping at an address the kernel chooses touches no
        // existing memory.
        let raw = unsafe {
            crate::sys::memory::mmap(
                0,
                mapped_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                None,
                0,
            )
        }?;
        let base = raw.next_multiple_of(HUGE_PAGE);
        // Best effort: without THP the buffers still work, in smaller pages.
        // SAFETY: advises our own fresh mapping; MADV_HUGEPAGE discards nothing.
        let _ = unsafe {
            crate::sys::memory::madvise(base, len, crate::sys::memory::Advice::LinuxHugepage)
        };
        Ok(Self {
            mapping: raw,
            mapped_len,
            base,
            buffer_len,
        })
    }

    /// Where buffer `slot` starts (`slot` below the count the arena was made with).
    pub fn ptr(&self, slot: u32) -> *mut u8 {
        (self.base + slot as usize * self.buffer_len) as *mut u8
    }

    fn slice(&self, slot: u32) -> &[u8] {
        // SAFETY: buffer `slot` lies inside the live read-write mapping owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr(slot), self.buffer_len) }
    }

    fn slice_mut(&mut self, slot: u32) -> &mut [u8] {
        // SAFETY: as above; &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(slot), self.buffer_len) }
    }
}

impl Drop for BufferArena {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping created in `new`, which nothing references
        // any more (the ring never drops its arena with a read in flight).
        if let Err(error) = unsafe { crate::sys::memory::munmap(self.mapping, self.mapped_len) } {
            panic!("munmap of the read buffers failed: {error}");
        }
    }
}
/// What a completion was for.
#[derive(Debug)]
pub enum Completion {
    /// A read into `slot` finished: the bytes it read (fewer than asked for at the end
    /// of the file or when short), or why it failed.
    Read {
        slot: u32,
        result: io::Result<usize>,
    },
    /// A watched descriptor became readable. `rearm` is set when the kernel ended the
    /// multishot poll and it must be added again.
    Readable { token: u32, rearm: bool },
}

/// In `user_data`: a poll's, carrying its token in the low 32 bits (else a read's, the
/// slot).
const POLL_BIT: u64 = 1 << 63;
/// The whole `user_data` of an `unwatch` request, whose completion `reap` drops: it tells
/// the caller nothing (the poll's own last completion does).
const UNWATCH: u64 = 1 << 62;

/// Memory a read lands in other than its slot's buffer.
#[derive(Debug, Clone, Copy)]
pub struct Landing {
    pub dest: *mut u8,
    pub len: usize,
    /// Whether the kernel issues the read from one of its io_uring worker threads
    /// (IOSQE_ASYNC) instead of inside this thread's next submit: for a read whose first
    /// step is slow work on the CPU, such as faulting in the destination's pages.
    pub off_thread: bool,
}

/// The ring, its read buffers and what each one is doing.
pub struct ReadRing<Tag> {
    /// Who carries out the reads and polls: io_uring (a scripted stand-in in unit
    /// tests).
    driver: Driver,
    buffers: BufferArena,
    /// What each buffer is doing (one slot per buffer).
    slots: ReadSlots<Tag>,
    buffer_len: usize,
}

impl<Tag> ReadRing<Tag> {
    /// A ring with room for `max_reads` reads of up to `buffer_len` bytes in flight.
    pub fn new(max_reads: u32, buffer_len: usize) -> Result<Self, RingError> {
        let entries = (max_reads + 8).next_power_of_two();
        Self::with_driver(Driver::uring(entries)?, max_reads, buffer_len)
    }

    /// A ring whose reads and polls a script carries out (`scripted`), for unit tests
    /// of what uses it.
    #[cfg(test)]
    pub(crate) fn scripted(
        max_reads: u32,
        buffer_len: usize,
        script: scripted::ReadScript,
    ) -> Result<Self, RingError> {
        let driver = Driver::Scripted(scripted::ScriptedDriver::new(script));
        Self::with_driver(driver, max_reads, buffer_len)
    }

    /// A ring carried out by `driver`, with its buffers and slots.
    fn with_driver(driver: Driver, max_reads: u32, buffer_len: usize) -> Result<Self, RingError> {
        let buffers = BufferArena::new(max_reads as usize, buffer_len).map_err(|source| {
            RingError::Buffers {
                bytes: max_reads as usize * buffer_len,
                source,
            }
        })?;
        Ok(Self {
            driver,
            buffers,
            slots: ReadSlots::new(max_reads),
            buffer_len,
        })
    }

    pub fn buffer_len(&self) -> usize {
        self.buffer_len
    }

    /// Reads issued and not yet checked in (in flight, or reaped and still held).
    pub fn reads_in_flight(&self) -> usize {
        self.slots.issued()
    }

    /// Reads issued whose completions have not been reaped yet.
    pub fn reads_pending(&self) -> usize {
        self.slots.in_flight()
    }

    /// Whether `checkout` would find a slot.
    pub fn has_free_slot(&self) -> bool {
        self.slots.has_free()
    }

    /// A free buffer slot, allocating buffers lazily up to the limit.
    pub fn checkout(&mut self) -> Option<u32> {
        self.slots.checkout()
    }

    /// Returns a slot whose read was reaped (or never issued) to the free list, with the
    /// tag its read carried.
    ///
    /// # Panics
    /// If the slot's read is in flight (its buffer still belongs to the kernel) or the
    /// slot is already free.
    pub fn checkin(&mut self, slot: u32) -> Option<Tag> {
        self.slots.checkin(slot)
    }

    /// Takes the tag back from a slot whose read was reaped, keeping the slot (and its
    /// buffer's contents) for the next read issued into it: the rest of a short read, or
    /// a retry.
    ///
    /// # Panics
    /// If the slot's read is not reaped.
    pub fn reclaim(&mut self, slot: u32) -> Tag {
        self.slots.reclaim(slot)
    }

    /// Starts a read of `len` bytes at file `offset` into `slot`'s buffer at
    /// `buffer_offset`. The slot stays checked out, carrying `tag`, until `checkin`. A
    /// slot whose read was reaped may read again (the rest of a short read, a retry).
    pub fn read(
        &mut self,
        slot: u32,
        fd: RawFd,
        offset: u64,
        buffer_offset: usize,
        len: usize,
        tag: Tag,
    ) -> Result<(), RingError> {
        assert!(
            buffer_offset + len <= self.buffer_len,
            "read past its buffer"
        );
        let ptr = self.buffers.ptr(slot).wrapping_add(buffer_offset);
        // SAFETY: the slot's buffer belongs to the ring and is handed out to nothing
        // else until this read's completion is reaped and the slot checked in; the
        // assert above keeps the read inside it.
        unsafe {
            self.read_into(
                slot,
                fd,
                offset,
                Landing {
                    dest: ptr,
                    len,
                    off_thread: false,
                },
                tag,
            )
        }
    }

    /// Starts a read at file `offset` into memory the caller owns (a frame of the
    /// zero-copy store), instead of `slot`'s buffer. The slot stays checked out, carrying
    /// `tag`, until `checkin`.
    ///
    /// # Panics
    /// If the slot is free or its read in flight.
    ///
    /// # Safety
    /// `landing.dest..landing.dest + landing.len` must stay mapped, writable and unused
    /// by anything else until the read's completion is reaped.
    pub unsafe fn read_into(
        &mut self,
        slot: u32,
        fd: RawFd,
        offset: u64,
        landing: Landing,
        tag: Tag,
    ) -> Result<(), RingError> {
        let request = Request::Read {
            fd,
            dest: landing.dest,
            len: landing.len as u32,
            offset,
            off_thread: landing.off_thread,
            user_data: slot as u64,
        };
        self.slots.issue(slot, tag);
        // SAFETY: the landing stays valid until the completion is reaped (this
        // function's contract).
        unsafe { self.driver.push(request) }
    }

    /// Watches `fd` for readability with a multishot poll; completions carry `token`.
    pub fn watch(&mut self, fd: RawFd, token: u32) -> Result<(), RingError> {
        let request = Request::Poll {
            fd,
            user_data: POLL_BIT | token as u64,
        };
        // SAFETY: a poll references no memory.
        unsafe { self.driver.push(request) }
    }

    /// Ends the multishot poll `watch` started with `token`. Its last completion comes
    /// as `Readable` like any other: the caller ignores tokens it no longer watches.
    /// This request's own completion is not reaped as anything.
    pub fn unwatch(&mut self, token: u32) -> Result<(), RingError> {
        let request = Request::PollRemove {
            target: POLL_BIT | token as u64,
            user_data: UNWATCH,
        };
        // SAFETY: a poll's removal references no memory.
        unsafe { self.driver.push(request) }
    }

    /// The tag of the read `slot` carries (in flight or reaped).
    pub fn tag(&self, slot: u32) -> Option<&Tag> {
        self.slots.tag(slot)
    }

    pub fn tag_mut(&mut self, slot: u32) -> Option<&mut Tag> {
        self.slots.tag_mut(slot)
    }

    /// `slot`'s buffer, once its read was reaped.
    ///
    /// # Panics
    /// If the slot is free or its read in flight.
    pub fn buffer(&self, slot: u32) -> &[u8] {
        self.slots.check_owned(slot);
        self.buffers.slice(slot)
    }

    /// `slot`'s buffer, once its read was reaped.
    ///
    /// # Panics
    /// If the slot is free or its read in flight.
    pub fn buffer_mut(&mut self, slot: u32) -> &mut [u8] {
        self.slots.check_owned(slot);
        self.buffers.slice_mut(slot)
    }

    /// Submits queued entries without waiting for any completion.
    pub fn submit(&mut self) -> Result<(), RingError> {
        self.submit_and_wait(0)
    }

    /// Submits queued entries and waits until at least `want` completions are ready.
    pub fn submit_and_wait(&mut self, want: usize) -> Result<(), RingError> {
        self.driver.submit_and_wait(want)
    }

    /// Submits queued entries, then polls the completion queue for up to `spin` before
    /// sleeping in the kernel until one arrives. A thread waiting on a demand read is
    /// woken sooner when the completion is reaped by a running service thread than by
    /// one that must first be woken itself (an inter-processor interrupt and a context
    /// switch, tens of microseconds on a virtual machine).
    pub fn submit_and_spin(&mut self, spin: std::time::Duration) -> Result<(), RingError> {
        self.driver.submit_and_spin(spin)
    }

    /// Moves every ready completion into `out` (but `unwatch`'s own).
    pub fn reap(&mut self, out: &mut Vec<Completion>) {
        let slots = &mut self.slots;
        self.driver.reap(|posted: Posted| {
            if posted.user_data == UNWATCH {
                return;
            }
            if posted.user_data & POLL_BIT != 0 {
                out.push(Completion::Readable {
                    token: (posted.user_data & !POLL_BIT) as u32,
                    rearm: !posted.more,
                });
            } else {
                let slot = posted.user_data as u32;
                slots.reaped(slot);
                out.push(Completion::Read {
                    slot,
                    result: read_result(posted.result),
                });
            }
        });
    }
}

/// A read's result as the kernel posts it (bytes read, or a negated errno), made the
/// `io::Result` the ring hands on: the one place a raw result is read.
fn read_result(raw: i32) -> io::Result<usize> {
    match usize::try_from(raw) {
        Ok(bytes) => Ok(bytes),
        Err(_) => Err(io::Error::from_raw_os_error(raw.wrapping_neg())),
    }
}

#[cfg(test)]
mod tests;
