//! How many reads of each kind are on the ring, and how many prefetch bytes on the
//! device: the counts `pump` issues within.

/// The reads on the ring, by kind. Demand reads take any free slot; prefetch reads
/// leave a quarter of the slots to demand and keep at most the prefetch policy's
/// device share of bytes in flight. Every read counted by `issued` is uncounted by
/// `finished` exactly once.
#[derive(Debug, Default)]
pub(in crate::service) struct ReadLoad {
    demand: u32,
    prefetch: u32,
    /// Bytes of prefetch reads submitted and not yet completed by the device (a read
    /// completed but not yet installed no longer counts).
    prefetch_bytes_on_device: u64,
}

impl ReadLoad {
    /// A read of `len` bytes was submitted.
    pub(in crate::service) fn issued(&mut self, prefetch: bool, len: u64) {
        if prefetch {
            self.prefetch += 1;
            self.prefetch_bytes_on_device += len;
        } else {
            self.demand += 1;
        }
    }

    /// The rest of a read in flight, `len` bytes, was submitted again.
    pub(in crate::service) fn resubmitted(&mut self, prefetch: bool, len: u64) {
        if prefetch {
            self.prefetch_bytes_on_device += len;
        }
    }

    /// The device answered the last `len` bytes submitted for a read.
    pub(in crate::service) fn device_answered(&mut self, prefetch: bool, len: u64) {
        if prefetch {
            self.prefetch_bytes_on_device = self
                .prefetch_bytes_on_device
                .checked_sub(len)
                .expect("the device answers no more than was submitted");
        }
    }

    /// A read's slot was freed, whatever became of the read.
    pub(in crate::service) fn finished(&mut self, prefetch: bool) {
        let count = match prefetch {
            true => &mut self.prefetch,
            false => &mut self.demand,
        };
        *count = count.checked_sub(1).expect("a read finishes once");
    }

    pub(in crate::service) fn demand_in_flight(&self) -> u32 {
        self.demand
    }

    /// Bytes of prefetch reads the device has not answered yet.
    pub(in crate::service) fn prefetch_bytes_on_device(&self) -> u64 {
        self.prefetch_bytes_on_device
    }

    /// Whether another prefetch read may start on a ring of `queue_depth` slots, with
    /// at most `device_limit` prefetch bytes on the device.
    pub(in crate::service) fn prefetch_may_start(
        &self,
        queue_depth: u32,
        device_limit: u64,
    ) -> bool {
        let slots = (queue_depth - queue_depth / 4).max(1);
        self.prefetch < slots && self.prefetch_bytes_on_device < device_limit
    }
}
