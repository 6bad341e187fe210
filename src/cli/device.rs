//! The read speed a file's device gives at a deep queue: the yardstick pager and kernel
//! figures are compared with, measured in the same run.

use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Instant;

use thiserror::Error;

use hyperoffload::ring::{BufferArena, Completion, Landing, ReadRing, RingError};

#[derive(Debug, Error)]
pub enum DeviceError {
    #[error("{path}: cannot open with O_DIRECT: {source}")]
    Open {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Ring(#[from] RingError),
    #[error("cannot map memory for the reads to land in: {0}")]
    Memory(std::io::Error),
    #[error("{path}: a direct read at offset {offset} failed: {error}")]
    Read {
        path: String,
        offset: u64,
        error: std::io::Error,
    },
}

/// Reads the whole file once with O_DIRECT reads of `chunk` bytes, `depth` at a time
/// (into huge-page buffers, as the pager does), and returns the rate in bytes per
/// second. Drop the page cache first for a cold figure; O_DIRECT bypasses it either way
/// but the device may have its own.
pub fn sequential_read_rate(path: &Path, chunk: usize, depth: u32) -> Result<f64, DeviceError> {
    read_rate(path, chunk, depth, chunk * depth as usize)
}

/// As `sequential_read_rate`, with the reads landing in turn across `landing_bytes` of
/// memory (pre-faulted, huge pages where the system gives them; at least `chunk *
/// depth`). A pager lands each block in its own memory, not in a few buffers used over
/// and over, and where reads land changes their rate (docs/design.md, "Measuring
/// against the device"), so the yardstick for the pager's reads lands them as it does.
pub fn read_rate(
    path: &Path,
    chunk: usize,
    depth: u32,
    landing_bytes: usize,
) -> Result<f64, DeviceError> {
    let name = || path.display().to_string();
    let (file, len) = open_direct(path)?;
    let chunk = chunk.next_multiple_of(4096);
    let landings = (landing_bytes / chunk).max(depth as usize);
    let landing = faulted_in_arena(landings, chunk)?;
    let mut turns = LandingTurns::new(landings);
    // Each read's tag is (file offset, landing).
    let mut ring: ReadRing<(u64, usize)> = ReadRing::new(depth, 4096)?;
    let started = Instant::now();
    let (mut next, mut in_flight) = (0u64, 0);
    let mut completions = Vec::new();
    loop {
        while next < len {
            let Some(slot) = ring.checkout() else { break };
            let index = turns.take();
            let n = ((len - next) as usize).min(chunk).next_multiple_of(4096);
            // SAFETY: landing `index` is `chunk` bytes inside `landing` (n <= chunk),
            // taken until this read's completion, so no other read lands there
            // meanwhile. The mapping outlives every read: the loop reaps them all
            // before it ends, and on an early error return the ring (declared later)
            // is closed first; a direct read pins the pages it lands in either way.
            // Nothing here reads the landed bytes.
            unsafe {
                ring.read_into(
                    slot,
                    file.as_raw_fd(),
                    next,
                    Landing {
                        dest: landing.ptr(index as u32),
                        len: n,
                        off_thread: false,
                    },
                    (next, index),
                )?;
            }
            next += n as u64;
            in_flight += 1;
        }
        if in_flight == 0 {
            break;
        }
        ring.submit_and_wait(1)?;
        completions.clear();
        ring.reap(&mut completions);
        for completion in completions.drain(..) {
            if let Completion::Read { slot, result } = completion {
                let (offset, index) = ring.checkin(slot).unwrap_or_default();
                turns.free(index);
                in_flight -= 1;
                result.map_err(|error| DeviceError::Read {
                    path: name(),
                    offset,
                    error,
                })?;
            }
        }
    }
    Ok(len as f64 / started.elapsed().as_secs_f64())
}

/// `path` opened for direct reads, and its length.
fn open_direct(path: &Path) -> Result<(std::fs::File, u64), DeviceError> {
    let open_error = |source| DeviceError::Open {
        path: path.display().to_string(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(open_error)?;
    let len = file.metadata().map_err(open_error)?.len();
    Ok((file, len))
}

/// `count` landings of `len` bytes, huge-page aligned as the ring's own buffers and the
/// pager's frames (a read into 4 KiB pages is split into many device segments), and
/// faulted in before the clock starts, as the pager's frames are in steady state.
fn faulted_in_arena(count: usize, len: usize) -> Result<BufferArena, DeviceError> {
    let arena = BufferArena::new(count, len).map_err(DeviceError::Memory)?;
    for index in 0..count {
        // SAFETY: buffer `index` is `len` bytes of the arena's own fresh mapping, which
        // nothing else references.
        unsafe { std::ptr::write_bytes(arena.ptr(index as u32), 0, len) };
    }
    Ok(arena)
}

/// Which landings are taken, handed out in turn so that reads land across all of them
/// (completions may come out of order, so the next in turn may still be taken).
struct LandingTurns {
    taken: Vec<bool>,
    turn: usize,
}

impl LandingTurns {
    fn new(count: usize) -> Self {
        LandingTurns {
            taken: vec![false; count],
            turn: 0,
        }
    }

    /// The next free landing in turn, now taken. At least one must be free: there are
    /// at least as many landings as reads in flight.
    fn take(&mut self) -> usize {
        let count = self.taken.len();
        while self.taken[self.turn % count] {
            self.turn += 1;
        }
        let index = self.turn % count;
        self.turn += 1;
        self.taken[index] = true;
        index
    }

    fn free(&mut self, index: usize) {
        self.taken[index] = false;
    }
}

/// Drops clean pages from the page cache (root only); false if it could not.
pub fn drop_page_cache() -> bool {
    // SAFETY: sync(2) has no memory effects.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}
