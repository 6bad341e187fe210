//! io_uring for the fault service: reads into buffers the ring owns, and polls that wake
//! the service when a uffd event or a command arrives. The one place that submits
//! io_uring entries.
//!
//! As in tokio-uring, the ring owns every buffer it reads into (a slab keyed by
//! `user_data`, `slots`), and each slot's state says who may touch its buffer: nobody
//! while the read is in flight (the kernel writes it), the service once its completion
//! was reaped. Accessing the buffer of a read in flight, or freeing its slot, panics
//! rather than race with the kernel.

use std::io;
use std::os::fd::RawFd;

use io_uring::{cqueue, opcode, squeue, types, IoUring, Probe};
use thiserror::Error;

mod slots;

use slots::ReadSlots;

/// Why the service cannot use io_uring.
#[derive(Debug, Error)]
pub enum RingError {
    #[error(
        "io_uring is not permitted ({source}); check sysctl kernel.io_uring_disabled \
         (0 allows it for everyone, 1 for members of kernel.io_uring_group, 2 for no one)"
    )]
    NotPermitted { source: io::Error },
    #[error("io_uring is not available in this kernel ({source})")]
    Unsupported { source: io::Error },
    #[error("cannot create an io_uring with {entries} entries: {source} (RLIMIT_MEMLOCK too low on an old kernel?)")]
    Setup { entries: u32, source: io::Error },
    #[error("this kernel's io_uring lacks {0}")]
    MissingOpcode(&'static str),
    #[error("cannot allocate {bytes} bytes of read buffers: {source}")]
    Buffers { bytes: usize, source: io::Error },
    #[error("io_uring submit failed: {0}")]
    Submit(io::Error),
}

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
    ring: IoUring,
    buffers: BufferArena,
    /// What each buffer is doing (one slot per buffer).
    slots: ReadSlots<Tag>,
    buffer_len: usize,
}

impl<Tag> ReadRing<Tag> {
    /// A ring with room for `max_reads` reads of up to `buffer_len` bytes in flight.
    pub fn new(max_reads: u32, buffer_len: usize) -> Result<Self, RingError> {
        let entries = (max_reads + 8).next_power_of_two();
        // Cooperative task running: a completion (or a poll readiness) is not signalled
        // to the service thread with an inter-processor interrupt while it runs; it is
        // processed at its next system call, which the service makes constantly, or
        // when the taskrun flag tells a polling loop to enter. A sleeping service is
        // still woken.
        // Kernels before 5.19 refuse the flags (EINVAL): run without them there.
        let build = |cooperative: bool| {
            let mut builder = IoUring::builder();
            builder.setup_cqsize(entries * 2);
            if cooperative {
                builder.setup_coop_taskrun().setup_taskrun_flag();
            }
            builder.build(entries)
        };
        let ring = build(true)
            .or_else(|error| match error.raw_os_error() {
                Some(libc::EINVAL) => build(false),
                _ => Err(error),
            })
            .map_err(|source| match source.raw_os_error() {
                Some(libc::EPERM) => RingError::NotPermitted { source },
                Some(libc::ENOSYS) => RingError::Unsupported { source },
                _ => RingError::Setup { entries, source },
            })?;
        let mut probe = Probe::new();
        ring.submitter()
            .register_probe(&mut probe)
            .map_err(|source| RingError::Unsupported { source })?;
        for (code, name) in [
            (opcode::Read::CODE, "IORING_OP_READ"),
            (opcode::PollAdd::CODE, "IORING_OP_POLL_ADD"),
        ] {
            if !probe.is_supported(code) {
                return Err(RingError::MissingOpcode(name));
            }
        }
        let buffers = BufferArena::new(max_reads as usize, buffer_len).map_err(|source| {
            RingError::Buffers {
                bytes: max_reads as usize * buffer_len,
                source,
            }
        })?;
        Ok(Self {
            ring,
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
        let mut entry = opcode::Read::new(types::Fd(fd), landing.dest, landing.len as u32)
            .offset(offset)
            .build()
            .user_data(slot as u64);
        if landing.off_thread {
            entry = entry.flags(squeue::Flags::ASYNC);
        }
        self.slots.issue(slot, tag);
        self.push(&entry)
    }

    /// Watches `fd` for readability with a multishot poll; completions carry `token`.
    pub fn watch(&mut self, fd: RawFd, token: u32) -> Result<(), RingError> {
        let entry = opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32)
            .multi(true)
            .build()
            .user_data(POLL_BIT | token as u64);
        self.push(&entry)
    }

    /// Ends the multishot poll `watch` started with `token`. Its last completion comes
    /// as `Readable` like any other: the caller ignores tokens it no longer watches.
    /// This request's own completion is not reaped as anything.
    pub fn unwatch(&mut self, token: u32) -> Result<(), RingError> {
        let entry = opcode::PollRemove::new(POLL_BIT | token as u64)
            .build()
            .user_data(UNWATCH);
        self.push(&entry)
    }

    fn push(&mut self, entry: &squeue::Entry) -> Result<(), RingError> {
        loop {
            // SAFETY: a read entry points into a buffer of `self.buffers`, which is
            // neither freed nor handed out again until its completion is reaped and the
            // slot checked in, or into memory `read_into`'s caller keeps for it; poll
            // entries reference no memory.
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                return Ok(());
            }
            // Submission queue full: hand what is queued to the kernel and retry.
            self.ring.submit().map_err(RingError::Submit)?;
        }
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
        loop {
            match self.ring.submit_and_wait(want) {
                Ok(_) => return Ok(()),
                Err(error) if error.raw_os_error() == Some(libc::EINTR) => continue,
                // The completion queue is full: the caller must reap before submitting.
                Err(error) if error.raw_os_error() == Some(libc::EBUSY) => return Ok(()),
                Err(error) => return Err(RingError::Submit(error)),
            }
        }
    }

    /// Submits queued entries, then polls the completion queue for up to `spin` before
    /// sleeping in the kernel until one arrives. A thread waiting on a demand read is
    /// woken sooner when the completion is reaped by a running service thread than by
    /// one that must first be woken itself (an inter-processor interrupt and a context
    /// switch, tens of microseconds on a virtual machine).
    pub fn submit_and_spin(&mut self, spin: std::time::Duration) -> Result<(), RingError> {
        loop {
            match self.ring.submit() {
                Ok(_) => break,
                Err(error) if error.raw_os_error() == Some(libc::EINTR) => continue,
                Err(error) if error.raw_os_error() == Some(libc::EBUSY) => return Ok(()),
                Err(error) => return Err(RingError::Submit(error)),
            }
        }
        let deadline = std::time::Instant::now() + spin;
        loop {
            if self.ring.submission().taskrun() {
                // Completions wait as task work (cooperative task running): enter the
                // kernel to have them posted.
                self.submit_and_wait(0)?;
            }
            let ready = {
                let mut completions = self.ring.completion();
                completions.sync();
                !completions.is_empty()
            };
            if ready {
                return Ok(());
            }
            if std::time::Instant::now() >= deadline {
                return self.submit_and_wait(1);
            }
            std::hint::spin_loop();
        }
    }

    /// Moves every ready completion into `out` (but `unwatch`'s own).
    pub fn reap(&mut self, out: &mut Vec<Completion>) {
        for entry in self.ring.completion() {
            let user_data = entry.user_data();
            if user_data == UNWATCH {
                continue;
            }
            if user_data & POLL_BIT != 0 {
                out.push(Completion::Readable {
                    token: (user_data & !POLL_BIT) as u32,
                    rearm: !cqueue::more(entry.flags()),
                });
            } else {
                let slot = user_data as u32;
                self.slots.reaped(slot);
                out.push(Completion::Read {
                    slot,
                    result: read_result(entry.result()),
                });
            }
        }
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
