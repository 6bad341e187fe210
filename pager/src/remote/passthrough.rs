//! Whether an open of a mounted object is answered with FUSE passthrough (Linux 6.9+:
//! the kernel reads the cache tier's file itself, with no request to the mount and no
//! copy through it) or through the mount's own read path. Pure: the FUSE side
//! (`src/cli/mount/fs.rs`) gathers the facts, asks `open_mode`, and does what it says.
//!
//! The kernel's rule this follows (fs/fuse/iomode.c): the open files of one FUSE inode
//! are either all passthrough, to one backing file, or none is. A passthrough open of
//! an inode open in the kernel's cached mode fails, and so does a cached open of an
//! inode open in passthrough; the program sees EIO from `open`. The mount counts the
//! handles it answered (`Opens`): up when it answers an open, down when the kernel
//! releases the handle. The kernel takes its own count after the answer and drops it
//! before it sends the release, so the mount's counts are never below the kernel's,
//! and an open the counts allow is one the kernel allows.

/// What the cache tier holds of one object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completeness {
    /// Some block is not cached.
    Partial,
    /// Every block is cached; some are not CRC-checked yet in this mount.
    Unchecked,
    /// Every block is cached and has passed its CRC check in this mount.
    Whole,
}

/// The open handles of one object, as the mount answered them and has not yet seen
/// released.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Opens {
    /// Served by the mount's read path (the kernel's cached mode).
    pub fuse: u32,
    /// Read by the kernel from the cache file.
    pub passthrough: u32,
}

/// How to answer an open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// With passthrough to the object's cache file.
    Passthrough,
    /// Check the CRC of the blocks not checked yet, then ask again with
    /// `may_check: false`.
    CheckFirst,
    /// Through the mount's read path, and why.
    Fuse(Why),
}

/// Why an open goes through the mount's read path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// Passthrough is off in this mount (the kernel, the cache directory or the
    /// command line said so).
    Off,
    /// Some block is not cached: the mount must fetch it.
    NotCached,
    /// The blocks are cached but their check did not end in time (or found one bad).
    NotChecked,
    /// A handle through the read path is open: the kernel refuses a passthrough open
    /// beside it.
    OpenThroughFuse,
}

/// How an open of an object is answered, given whether passthrough is on in this mount,
/// what the cache holds of the object, and the object's open handles. `may_check`:
/// whether a check of blocks cached but not checked may be waited for (false once it
/// was).
pub fn open_mode(available: bool, held: Completeness, opens: Opens, may_check: bool) -> OpenMode {
    if opens.passthrough > 0 {
        // The kernel refuses any other open beside it; and the object is held whole
        // since its first passthrough open (`Cache::hold`), so this one reads it too.
        return OpenMode::Passthrough;
    }
    if !available {
        return OpenMode::Fuse(Why::Off);
    }
    if opens.fuse > 0 {
        return OpenMode::Fuse(Why::OpenThroughFuse);
    }
    match held {
        Completeness::Partial => OpenMode::Fuse(Why::NotCached),
        Completeness::Unchecked if may_check => OpenMode::CheckFirst,
        Completeness::Unchecked => OpenMode::Fuse(Why::NotChecked),
        Completeness::Whole => OpenMode::Passthrough,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONE: Opens = Opens {
        fuse: 0,
        passthrough: 0,
    };

    #[test]
    fn a_whole_object_with_nothing_open_passes_through() {
        assert_eq!(
            open_mode(true, Completeness::Whole, NONE, true),
            OpenMode::Passthrough
        );
        assert_eq!(
            open_mode(true, Completeness::Whole, NONE, false),
            OpenMode::Passthrough
        );
    }

    #[test]
    fn an_object_not_wholly_cached_goes_through_the_mount() {
        assert_eq!(
            open_mode(true, Completeness::Partial, NONE, true),
            OpenMode::Fuse(Why::NotCached)
        );
    }

    #[test]
    fn unchecked_blocks_are_checked_once_then_the_mount_serves() {
        assert_eq!(
            open_mode(true, Completeness::Unchecked, NONE, true),
            OpenMode::CheckFirst
        );
        assert_eq!(
            open_mode(true, Completeness::Unchecked, NONE, false),
            OpenMode::Fuse(Why::NotChecked)
        );
    }

    #[test]
    fn the_kernel_rule_one_mode_per_inode_is_kept() {
        let fuse_open = Opens {
            fuse: 1,
            passthrough: 0,
        };
        // Whole, but a handle through the read path is open: not beside it.
        assert_eq!(
            open_mode(true, Completeness::Whole, fuse_open, true),
            OpenMode::Fuse(Why::OpenThroughFuse)
        );
        assert_eq!(
            open_mode(true, Completeness::Unchecked, fuse_open, true),
            OpenMode::Fuse(Why::OpenThroughFuse)
        );
        // A passthrough handle open: every other open must pass through too, whatever
        // else holds (the object is held whole since the first).
        let passthrough_open = Opens {
            fuse: 0,
            passthrough: 2,
        };
        for held in [
            Completeness::Partial,
            Completeness::Unchecked,
            Completeness::Whole,
        ] {
            for available in [true, false] {
                assert_eq!(
                    open_mode(available, held, passthrough_open, true),
                    OpenMode::Passthrough
                );
            }
        }
    }

    #[test]
    fn passthrough_off_sends_every_first_open_through_the_mount() {
        for held in [
            Completeness::Partial,
            Completeness::Unchecked,
            Completeness::Whole,
        ] {
            assert_eq!(open_mode(false, held, NONE, true), OpenMode::Fuse(Why::Off));
        }
    }
}
