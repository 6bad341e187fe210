//! What a forked child needs in place of the managed mappings it did not inherit.
//!
//! Managed regions are MADV_DONTFORK (a child has no fault service: an inherited,
//! unregistered region would read zeros, a registered one would hang), so in a child
//! their address ranges are simply unmapped. The parent, just before the fork, writes
//! down every live managed range with its file, offset and protection (`ForkPlan`); the
//! child maps each again as a plain private mapping of the file at the same address, so
//! it reads the file's bytes through the kernel's page cache. The plan is built with
//! allocations in the parent; `apply` in the child only makes system calls (open, fstat,
//! mmap, close, write) and allocates nothing.

use std::ffi::CString;
use std::ops::Range;
use std::os::fd::{AsFd, OwnedFd};

use hyperoffload::sys;
use libc::c_int;

/// A file the plan maps: opened again by name in the child, and mapped only if the
/// name still leads to the same file.
pub struct PlanFile {
    pub path: CString,
    pub dev: u64,
    pub ino: u64,
}

/// One live managed range: the file's bytes from `offset` belong at `range`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanRange {
    pub range: Range<usize>,
    pub prot: c_int,
    pub offset: u64,
    /// Index into `ForkPlan::files`.
    pub file: usize,
}

#[derive(Default)]
pub struct ForkPlan {
    pub files: Vec<PlanFile>,
    pub ranges: Vec<PlanRange>,
    /// With a pager that serves forks: the managed ranges the child inherits, served
    /// from its parent's pager, where it must not `mremap` (see `ServedRanges`).
    pub served: ServedRanges,
}

/// The address ranges a forked child inherits served (`--serve-forks`): a region's
/// memfd, mapped shared and registered with the child's userfaultfd. A move of such a
/// range (`mremap`) would drop its registration without `UFFD_FEATURE_EVENT_REMAP`,
/// and the child's next access to a hole of the memfd would put a page of zeros into
/// the file, where every process, the program too, then reads zeros. So the child's
/// `mremap` touching one is refused with EINVAL, as the program's own is; a range the
/// child unmaps is forgotten (something else may be mapped there later).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ServedRanges(Vec<Range<usize>>);

impl ServedRanges {
    /// None (a `const` for statics).
    pub const fn empty() -> Self {
        Self(Vec::new())
    }

    pub fn new(ranges: impl IntoIterator<Item = Range<usize>>) -> Self {
        Self(ranges.into_iter().filter(|r| r.start < r.end).collect())
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether any served page lies in `range`.
    pub fn touches(&self, range: &Range<usize>) -> bool {
        self.0
            .iter()
            .any(|served| served.start < range.end && range.start < served.end)
    }

    /// `range` was unmapped: the parts of served ranges in it are no longer served.
    pub fn forget(&mut self, range: &Range<usize>) {
        if !self.touches(range) {
            return;
        }
        let mut kept = Vec::with_capacity(self.0.len() + 1);
        for served in self.0.drain(..) {
            if served.start < range.start {
                kept.push(served.start..served.end.min(range.start));
            }
            if range.end < served.end {
                kept.push(served.start.max(range.end)..served.end);
            }
        }
        self.0 = kept;
    }
}

/// What `apply` did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    pub ranges: usize,
    pub bytes: u64,
    /// Ranges left unmapped: the file could not be opened again, or its name now leads
    /// to another file, or the kernel refused the mapping.
    pub failed: usize,
}

impl ForkPlan {
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// The bytes the plan maps.
    pub fn bytes(&self) -> u64 {
        self.ranges
            .iter()
            .map(|part| (part.range.end - part.range.start) as u64)
            .sum()
    }

    /// In the child, just after the fork (one thread, nothing else running): maps every
    /// range again from its file. Each file is opened once.
    pub fn apply(&self) -> Applied {
        let mut applied = Applied::default();
        for (index, file) in self.files.iter().enumerate() {
            let opened = open_same(file);
            for part in self.ranges.iter().filter(|part| part.file == index) {
                let mapped = opened
                    .as_ref()
                    .is_some_and(|fd| map_fixed(fd, part).is_ok());
                if mapped {
                    applied.ranges += 1;
                    applied.bytes += (part.range.end - part.range.start) as u64;
                } else {
                    applied.failed += 1;
                }
            }
        }
        applied
    }
}

/// The file by its name, if the name still leads to the file that was managed.
fn open_same(file: &PlanFile) -> Option<OwnedFd> {
    let fd = sys::files::open_read(&file.path).ok()?;
    let stat = sys::files::fstat(fd.as_fd()).ok()?;
    (stat.st_dev == file.dev && stat.st_ino == file.ino).then_some(fd)
}

fn map_fixed(fd: &OwnedFd, part: &PlanRange) -> std::io::Result<usize> {
    // SAFETY: the range is the child's copy of a live managed mapping, which the fork
    // left unmapped (MADV_DONTFORK): MAP_FIXED replaces nothing the child has there. A
    // private, read-only mapping of the file at a page-aligned offset, as the program
    // asked for it.
    unsafe {
        sys::memory::mmap(
            part.range.start,
            part.range.end - part.range.start,
            part.prot,
            libc::MAP_PRIVATE | libc::MAP_FIXED,
            Some(fd.as_fd()),
            part.offset as i64,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_served_range_is_touched_by_any_overlap_and_forgotten_where_unmapped() {
        let mut served = ServedRanges::new([0x10000..0x20000, 0x40000..0x41000, 0x50..0x50]);
        assert!(served.touches(&(0x1f000..0x30000)));
        assert!(served.touches(&(0x0..0x10001)));
        assert!(!served.touches(&(0x20000..0x40000)), "ends are exclusive");
        assert!(!served.touches(&(0x50..0x51)), "empty ranges are dropped");
        served.forget(&(0x12000..0x14000));
        assert_eq!(
            served,
            ServedRanges::new([0x10000..0x12000, 0x14000..0x20000, 0x40000..0x41000])
        );
        assert!(!served.touches(&(0x12000..0x14000)));
        served.forget(&(0x0..0x100000));
        assert!(served.is_empty());
    }

    #[test]
    fn a_plan_counts_its_bytes() {
        let plan = ForkPlan {
            files: Vec::new(),
            ranges: vec![
                PlanRange {
                    range: 0x10000..0x14000,
                    prot: libc::PROT_READ,
                    offset: 0,
                    file: 0,
                },
                PlanRange {
                    range: 0x20000..0x21000,
                    prot: libc::PROT_READ,
                    offset: 0x8000,
                    file: 0,
                },
            ],
            served: ServedRanges::default(),
        };
        assert_eq!(plan.bytes(), 0x5000);
        assert!(!plan.is_empty());
        assert!(ForkPlan::default().is_empty());
    }

    #[test]
    fn a_range_whose_file_is_gone_is_counted_as_failed() {
        let plan = ForkPlan {
            files: vec![PlanFile {
                path: CString::new("/nonexistent/hyperoffload/m.gguf").unwrap(),
                dev: 0,
                ino: 0,
            }],
            ranges: vec![PlanRange {
                range: 0x10000..0x11000,
                prot: libc::PROT_READ,
                offset: 0,
                file: 0,
            }],
            served: ServedRanges::default(),
        };
        assert_eq!(
            plan.apply(),
            Applied {
                ranges: 0,
                bytes: 0,
                failed: 1
            }
        );
    }
}
