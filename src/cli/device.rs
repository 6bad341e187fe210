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
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|source| DeviceError::Open {
            path: name(),
            source,
        })?;
    let len = file
        .metadata()
        .map_err(|source| DeviceError::Open {
            path: name(),
            source,
        })?
        .len();
    let chunk = chunk.next_multiple_of(4096);
    let landings = (landing_bytes / chunk).max(depth as usize);
    // Huge-page aligned, as the ring's own buffers and the pager's frames: a read into
    // 4 KiB pages is split into many device segments.
    let landing = BufferArena::new(landings, chunk).map_err(DeviceError::Memory)?;
    // Faulted in before the clock starts, as the pager's frames are in steady state.
    for index in 0..landings {
        // SAFETY: buffer `index` is `chunk` bytes of the arena's own fresh mapping,
        // which nothing else references.
        unsafe { std::ptr::write_bytes(landing.ptr(index as u32), 0, chunk) };
    }
    // Which landings are taken; each read's tag is (file offset, landing).
    let mut taken = vec![false; landings];
    let mut ring: ReadRing<(u64, usize)> = ReadRing::new(depth, 4096)?;
    let started = Instant::now();
    let (mut next, mut in_flight, mut turn) = (0u64, 0, 0usize);
    let mut completions = Vec::new();
    loop {
        while next < len {
            let Some(slot) = ring.checkout() else { break };
            // The next free landing in turn (completions may come out of order).
            while taken[turn % landings] {
                turn += 1;
            }
            let index = turn % landings;
            turn += 1;
            taken[index] = true;
            let n = ((len - next) as usize).min(chunk).next_multiple_of(4096);
            // SAFETY: landing `index` is `chunk` bytes inside `landing` (n <= chunk),
            // marked taken until this read's completion, so no other read lands there
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
                taken[index] = false;
                in_flight -= 1;
                if let Err(error) = result {
                    return Err(DeviceError::Read {
                        path: name(),
                        offset,
                        error,
                    });
                }
            }
        }
    }
    Ok(len as f64 / started.elapsed().as_secs_f64())
}

/// Drops clean pages from the page cache (root only); false if it could not.
pub fn drop_page_cache() -> bool {
    // SAFETY: sync(2) has no memory effects.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}
