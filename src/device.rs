//! The read speed a file's device gives at a deep queue: the yardstick pager and kernel
//! figures are compared with, measured in the same run.

use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Instant;

use thiserror::Error;

use crate::ring::{Completion, ReadRing, RingError};

#[derive(Debug, Error)]
pub enum DeviceError {
    #[error("{path}: cannot open with O_DIRECT: {source}")]
    Open {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Ring(#[from] RingError),
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
    let mut ring: ReadRing<u64> = ReadRing::new(depth, chunk)?;
    let started = Instant::now();
    let (mut next, mut in_flight) = (0u64, 0);
    let mut completions = Vec::new();
    loop {
        while next < len {
            let Some(slot) = ring.checkout()? else { break };
            let n = ((len - next) as usize).min(chunk).next_multiple_of(4096);
            ring.read(slot, file.as_raw_fd(), next, 0, n, next)?;
            next += n as u64;
            in_flight += 1;
        }
        if in_flight == 0 {
            break;
        }
        ring.submit_and_wait(1)?;
        completions.clear();
        ring.reap(&mut completions);
        for completion in &completions {
            if let Completion::Read { slot, result } = *completion {
                let offset = ring.checkin(slot).unwrap_or(0);
                if result < 0 {
                    return Err(DeviceError::Read {
                        path: name(),
                        offset,
                        error: std::io::Error::from_raw_os_error(-result),
                    });
                }
                in_flight -= 1;
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
