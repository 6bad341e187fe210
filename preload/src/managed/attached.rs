//! Mappings served by another process's pager (`hyperoffload::share`): under
//! `hyperoffload run --inherit` a process about to map a file that another process of
//! the run serves maps that pager's region file instead (a *guest*), sharing its
//! resident blocks and budget. What the shim's hooks do there:
//! - munmap of a whole attached mapping stops its thread and closes its descriptors;
//!   of a part, the kernel unmaps that part (the rest stays served);
//! - mremap is refused with EINVAL, as for managed mappings;
//! - a forked child gets a plain private mapping of the file in its place (the fork
//!   plan), the attached mapping being MADV_DONTFORK;
//! - madvise and the rest pass through to the kernel: MADV_DONTNEED there only drops
//!   this process's page table entries (the pages stay in the shared file), and
//!   mprotect adding PROT_WRITE is not detected (only read-only requests attach).

use std::sync::atomic::Ordering;

use hyperoffload::share::guest::{attach, claim, key_of_stat, release_claim, Attachment, Claim};
use hyperoffload::share::protocol::FileKey;

use super::{lock, page, MappedFile, Shim};
use crate::map_candidate::MapRequest;
use hyperoffload::Pager;

/// One attached mapping.
pub(super) struct Attached {
    pub attachment: Attachment,
    /// Index into the shim's files.
    pub file: usize,
    pub file_offset: u64,
    pub prot: libc::c_int,
}

impl Shim {
    /// With a share directory: maps `file` from the host serving it, if another process
    /// of the run does and the request is read-only. The address, or None (the caller
    /// pages it itself).
    pub(super) fn try_attach(
        &self,
        file: &MappedFile,
        request: &MapRequest,
        offset: u64,
        data_len: u64,
    ) -> Option<usize> {
        let dir = self.config.share_dir.as_ref()?;
        if request.prot & libc::PROT_WRITE != 0 {
            return None;
        }
        let key: FileKey = key_of_stat(&file.stat);
        // The first process of the run to map the file claims it (before its pager
        // starts, so that one starting at the same moment waits for it and attaches).
        let Ok(Claim::Other(host)) = claim(dir, &key) else {
            return None;
        };
        let map_len = request.len.next_multiple_of(page());
        let _layout = lock(&self.layout);
        match attach(dir, host, &key, offset, data_len, map_len, request.prot) {
            Ok(attachment) => {
                let base = attachment.base();
                let host = attachment.host_pid();
                let index = self.file_index(file);
                lock(&self.attached).push(Attached {
                    attachment,
                    file: index,
                    file_offset: offset,
                    prot: request.prot,
                });
                self.attached_count.fetch_add(1, Ordering::AcqRel);
                self.note_served(&file.stat, &file.name, file.model_len);
                self.verbose(|| {
                    format!(
                        "{} offset {offset} length {}: served by the pager of process {host}, \
                         mapped at {base:#x}",
                        file.path.display(),
                        request.len
                    )
                });
                Some(base)
            }
            Err(error) => {
                self.verbose(|| {
                    format!(
                        "{}: not served by another process of the run ({error}); paging it here",
                        file.path.display()
                    )
                });
                None
            }
        }
    }

    /// After this process's pager was asked for `file` (it claimed the file in
    /// `try_attach`): a pager that did not start, or whose regions cannot be shared
    /// (fork events refused: no `CAP_SYS_PTRACE`), hosts nothing, and the claim goes,
    /// so that other processes of the run do not wait for it.
    pub(super) fn release_claim_unless_hosting(&self, file: &MappedFile, pager: Option<&Pager>) {
        let Some(dir) = self.config.share_dir.as_ref() else {
            return;
        };
        if !pager.is_some_and(Pager::serves_forks) {
            release_claim(dir, &key_of_stat(&file.stat));
        }
    }

    /// munmap over attached mappings: stops those wholly inside `[addr, addr + len)`
    /// and leaves them mapped (the caller's munmap, passed to the kernel, unmaps them);
    /// a part of one is simply unmapped by the kernel, the rest stays served.
    pub(super) fn unmap_attached(&self, addr: usize, len: usize) {
        if self.attached_count.load(Ordering::Acquire) == 0 {
            return;
        }
        let end = addr.saturating_add(len);
        let mut attached = lock(&self.attached);
        let mut stopped = Vec::new();
        let mut index = 0;
        while index < attached.len() {
            let base = attached[index].attachment.base();
            if base >= addr && base + attached[index].attachment.map_len() <= end {
                stopped.push(attached.swap_remove(index));
            } else {
                index += 1;
            }
        }
        drop(attached);
        if stopped.is_empty() {
            return;
        }
        self.attached_count
            .fetch_sub(stopped.len(), Ordering::AcqRel);
        for one in stopped {
            one.attachment.stop_leaving_mapped();
        }
    }

    /// Whether `[addr, addr + len)` touches an attached mapping (mremap is refused).
    pub(super) fn touches_attached(&self, addr: usize, len: usize) -> bool {
        if self.attached_count.load(Ordering::Acquire) == 0 {
            return false;
        }
        let end = addr.saturating_add(len.max(1)).next_multiple_of(page());
        lock(&self.attached).iter().any(|one| {
            let base = one.attachment.base();
            base < end && addr < base + one.attachment.map_len()
        })
    }

    /// The attached mappings, for the fork plan: (range, file index, file offset, prot).
    pub(super) fn attached_ranges(&self) -> Vec<(std::ops::Range<usize>, usize, u64, libc::c_int)> {
        lock(&self.attached)
            .iter()
            .map(|one| {
                let base = one.attachment.base();
                (
                    base..base + one.attachment.map_len(),
                    one.file,
                    one.file_offset,
                    one.prot,
                )
            })
            .collect()
    }
}
