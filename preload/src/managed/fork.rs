//! The parent's side of a fork: what its child maps in place of the managed mappings it
//! does not inherit (see `fork_plan`).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::sync::MutexGuard;

use super::{lock, PagerSlot, Shim};
use crate::fork_plan::{ForkPlan, PlanFile, PlanRange, ServedRanges};

impl Shim {
    /// Just before a fork: holds `layout`, so that no managed mapping is made or removed
    /// until the guard is dropped (after the fork, in the parent and in the child), and
    /// writes down every live managed range. Must not be called by a thread holding
    /// `layout` (one inside the shim).
    pub fn prepare_fork(&'static self) -> (MutexGuard<'static, ()>, ForkPlan) {
        let layout = lock(&self.layout);
        let pager = match &*lock(&self.pager) {
            PagerSlot::Running(pager) => Some(pager.clone()),
            _ => None,
        };
        // A pager serving forks from the first fork on makes its regions inheritable
        // now (its own fork handler may run after this one).
        let served = pager.is_some_and(|pager| pager.make_inheritable());
        let files = lock(&self.files)
            .iter()
            .map(|file| PlanFile {
                // A path from the kernel (readlink) holds no NUL; one that did would
                // name no file, and its ranges fail in the child with the rest.
                path: CString::new(file.path.as_os_str().as_bytes()).unwrap_or_default(),
                dev: file.dev,
                ino: file.ino,
            })
            .collect();
        // Mappings served by another process's pager (`attached`) are MADV_DONTFORK:
        // the child maps the file there.
        let mut ranges: Vec<PlanRange> = self
            .attached_ranges()
            .into_iter()
            .map(|(range, file, offset, prot)| PlanRange {
                range,
                prot,
                offset,
                file,
            })
            .collect();
        if served {
            // The child inherits the regions and the pager serves it: nothing to map
            // for them, only ranges it must not move.
            let served =
                ServedRanges::new(lock(&self.registry).live_parts().map(|(_, part, _)| part));
            let plan = ForkPlan {
                files,
                ranges,
                served,
            };
            return (layout, plan);
        }
        ranges.extend(
            lock(&self.registry)
                .live_parts()
                .map(|(base, part, managed)| PlanRange {
                    offset: managed.file_offset + (part.start - base) as u64,
                    range: part,
                    prot: managed.prot,
                    file: managed.file,
                }),
        );
        let plan = ForkPlan {
            files,
            ranges,
            served: ServedRanges::default(),
        };
        (layout, plan)
    }
}
