//! Faults injected into the service by tests of its error paths (`PagerBuilder::inject_*`,
//! built with the `fault-injection` feature only). Without the feature the hooks are
//! empty and the fault path carries no check for them.

use std::io;
#[cfg(feature = "fault-injection")]
use std::ops::Range;

use super::FaultService;

/// What to inject.
#[cfg(feature = "fault-injection")]
#[derive(Debug, Clone, Default)]
pub(crate) struct InjectedFaults {
    /// Reads overlapping this file range fail with this errno (the read is issued; its
    /// result is replaced).
    pub read_error: Option<(Range<u64>, i32)>,
    /// Every read delivers at most half of what it asked for.
    pub short_reads: bool,
    /// Each read completion is handled this late.
    pub read_delay: std::time::Duration,
    /// Panic on fault number n + 1.
    pub panic_after_faults: Option<u64>,
}

impl FaultService {
    /// Panics if the faults served exceed the injected limit.
    #[inline(always)]
    pub(super) fn check_injected_panic(&self) {
        #[cfg(feature = "fault-injection")]
        if let Some(n) = self.config.faults.panic_after_faults {
            if self.stats.faults > n {
                panic!("injected panic after {n} faults");
            }
        }
    }

    /// The completion result of the read in `slot` after injected delays, short reads
    /// and errors.
    #[inline(always)]
    pub(super) fn injected_read_result(
        &mut self,
        slot: u32,
        result: io::Result<usize>,
    ) -> io::Result<usize> {
        #[cfg(not(feature = "fault-injection"))]
        let _ = slot;
        #[cfg(feature = "fault-injection")]
        let result = {
            let faults = &self.config.faults;
            if !faults.read_delay.is_zero() {
                std::thread::sleep(faults.read_delay);
            }
            let tag = self.ring.tag(slot).expect("a read in flight");
            let (len, done, file_offset, valid) = (tag.len, tag.done, tag.file_offset, tag.valid);
            if let Some((range, errno)) = &faults.read_error {
                let read = file_offset..file_offset + valid as u64;
                if read.start < range.end && range.start < read.end {
                    return Err(io::Error::from_raw_os_error(*errno));
                }
            }
            match result {
                Ok(full) if faults.short_reads && full > 1 => {
                    let asked = len - done;
                    let short = full.min(asked / 2).max(1);
                    // What the shortened read did not deliver must not be in the buffer
                    // either.
                    self.landing(slot)[done + short..done + full].fill(0xEE);
                    Ok(short)
                }
                other => other,
            }
        };
        result
    }
}
