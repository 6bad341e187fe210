//! mmap of a file the shim takes over: a region of the pager in the request's place,
//! registered as managed memory.

use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use crate::map_candidate::MapRequest;
use hyperoffload::served_files::Refusal;
use hyperoffload::{MapOptions, Pager};

use super::{lock, page, ManagedFile, ManagedRegion, MappedFile, PagerSlot, Shim};

impl Shim {
    /// mmap of a request `screen_request` accepted: a region in its place, or `None`.
    pub fn map(&self, request: &MapRequest) -> Option<usize> {
        let file = self.take_file(request)?;
        let offset = request.offset as u64;
        let data_len = (request.len as u64).min(file.size - offset);
        if let Some(base) = self.try_attach(&file, request, offset, data_len) {
            return Some(base);
        }
        let block_cuts = self.block_cuts(&file);
        let pager = self.pager_for(&file, offset, data_len, &block_cuts);
        self.release_claim_unless_hosting(&file, pager.as_ref());
        let Some(pager) = pager else {
            let error = match &*lock(&self.pager) {
                PagerSlot::Failed(error) => error.clone(),
                _ => "it was not started".to_string(),
            };
            let path = file.path.as_os_str().as_bytes();
            let refusal = Refusal::PagerNotStarted(error);
            self.note_refused(request.fd, &file.stat, Some(path), refusal);
            return None;
        };
        let options = MapOptions {
            offset,
            len: Some(data_len),
            map_len: Some((request.len as u64).next_multiple_of(page() as u64)),
            prot: request.prot,
            block_cuts,
        };
        let _layout = lock(&self.layout);
        let managed = match self.map_region(&pager, &file, options, request) {
            Ok(managed) => managed,
            Err(error) => {
                let path = file.path.as_os_str().as_bytes();
                let refusal = Refusal::MapFailed(error);
                self.note_refused(request.fd, &file.stat, Some(path), refusal);
                return None;
            }
        };
        self.note_served(&file.stat, &file.name, file.model_len);
        if request.flags & libc::MAP_POPULATE != 0 {
            self.bounded_prefetch(&managed, 0..managed.region.map_len() as u64);
        }
        Some(managed.region.as_ptr() as usize)
    }

    /// Where the blocks of a region of `file` are cut besides the block-size grid: at
    /// its routed experts' slices, for a mixture-of-experts model whose tensor table
    /// reads (see `ENV_EXPERT_BLOCKS`).
    fn block_cuts(&self, file: &MappedFile) -> Vec<u64> {
        if !self.config.expert_blocks {
            return Vec::new();
        }
        match hyperoffload::model::ModelFile::open(&file.name) {
            Ok(model) => hyperoffload::graph::experts::model_block_cuts(&model, page() as u64),
            Err(_) => Vec::new(),
        }
    }

    /// Maps `file` through the pager and registers the region as managed memory; its error
    /// (and a warning once) if the pager cannot map it. The caller holds `layout`.
    fn map_region(
        &self,
        pager: &Pager,
        file: &MappedFile,
        options: MapOptions,
        request: &MapRequest,
    ) -> Result<Arc<ManagedRegion>, String> {
        let offset = options.offset;
        let region = match pager.map_file(&file.path, options) {
            Ok(region) => region,
            Err(error) => {
                self.warn_once(&self.warned_map, || {
                    format!("{error}; this mapping is left to the kernel")
                });
                return Err(error.to_string());
            }
        };
        let base = region.as_ptr() as usize;
        let map_len = region.map_len();
        let index = self.file_index(file);
        let managed = Arc::new(ManagedRegion {
            region,
            file: index,
            file_offset: offset,
            prot: request.prot,
            read_ahead: Mutex::default(),
            allowance: Arc::clone(&self.read_ahead),
        });
        lock(&self.registry).insert(base, map_len, managed.clone());
        self.mapped.fetch_add(1, Ordering::AcqRel);
        self.verbose(|| {
            format!(
                "managing {} offset {} length {} at {:#x}",
                file.path.display(),
                offset,
                request.len,
                base
            )
        });
        self.record(|| {
            serde_json::json!({"op": "map", "file": index, "region": managed.region.id().0,
                "path": file.path.to_string_lossy(), "offset": offset, "len": request.len,
                "flags": request.flags})
        });
        Ok(managed)
    }

    /// The index of `file` among the managed files, added if new.
    pub(super) fn file_index(&self, file: &MappedFile) -> usize {
        let (dev, ino) = (file.stat.st_dev, file.stat.st_ino);
        let mut files = lock(&self.files);
        if let Some(index) = files.iter().position(|f| f.dev == dev && f.ino == ino) {
            return index;
        }
        files.push(ManagedFile {
            path: file.path.clone(),
            size: file.size,
            dev,
            ino,
        });
        files.len() - 1
    }
}
