//! Which files the shim takes over: a mapping request's file screened by its names,
//! its size and its first bytes, and the name the program gave it.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::map_candidate::{screen_file, FileFacts, MapRequest, PassReason};
use hyperoffload::model::split::model_len;
use hyperoffload::served_files::Refusal;
use hyperoffload::sys;

use super::{lock, MappedFile, PagerSlot, Shim};
use crate::given_name::name_given;
use crate::raw;

impl Shim {
    /// The file `request` maps, if the shim takes it over: its names and its model pass
    /// the configuration (`screen`), and the name the pager opens still leads to it.
    pub(super) fn take_file(&self, request: &MapRequest) -> Option<MappedFile> {
        let stat = raw::fstat(request.fd)?;
        let mut buffer = [0u8; 4096];
        let Some(path) = raw::fd_path(request.fd, &mut buffer) else {
            self.verbose(|| {
                format!(
                    "fd {}: {}, left to the kernel",
                    request.fd,
                    PassReason::UnknownFile.describe()
                )
            });
            return None;
        };
        let (name, model_len) = match self.screen(request, &stat, path) {
            Ok(taken) => taken,
            Err(reason) => {
                self.verbose(|| {
                    format!(
                        "{}: {}, left to the kernel",
                        String::from_utf8_lossy(path),
                        reason.describe()
                    )
                });
                let refusal = match reason {
                    PassReason::TooSmall => Refusal::TooSmall,
                    PassReason::NameNotMatched => Refusal::NameNotMatched,
                    other => Refusal::Request(other.describe().to_string()),
                };
                self.note_refused(request.fd, &stat, Some(path), refusal);
                return None;
            }
        };
        let path = Path::new(OsStr::from_bytes(path)).to_path_buf();
        // The pager opens the file by name: make sure the name still leads to the
        // descriptor's file (not a replacement, not a deleted one).
        if !names_file(&path, &stat) {
            self.verbose(|| {
                format!(
                    "{}: the name no longer leads to the mapped file, left to the kernel",
                    path.display()
                )
            });
            let kernel_name = path.as_os_str().as_bytes();
            self.note_refused(request.fd, &stat, Some(kernel_name), Refusal::NameChanged);
            return None;
        }
        Some(MappedFile {
            size: stat.st_size as u64,
            stat,
            path,
            name,
            model_len,
        })
    }

    /// Screens the file the kernel names `path` with `screen_file`. If the shim takes
    /// it: the name the program gave it and the size of its model; else why not.
    fn screen(
        &self,
        request: &MapRequest,
        stat: &sys::files::Stat,
        path: &[u8],
    ) -> Result<(PathBuf, u64), PassReason> {
        let size = stat.st_size as u64;
        let is_regular = stat.st_mode & libc::S_IFMT == libc::S_IFREG;
        // The model's size (all its files for a split GGUF) sets a percentage budget,
        // and a small file that is part of a large model is served with the rest. It
        // takes reading the file's header: only for a file the patterns match, the
        // first or a small one.
        let starting = matches!(&*lock(&self.pager), PagerSlot::NotYet);
        let wanted = starting || size < self.config.min_size;
        // The name the patterns and a split model's parts go by: the program's, where it
        // reached the file through symlinks (a Hugging Face cache links each file to a
        // blob named by its hash; see `given_name`), else the kernel's.
        let fd_path = Path::new(OsStr::from_bytes(path));
        let kernel_name_matches = self.config.matches(path);
        let name = if is_regular && (wanted || !kernel_name_matches) {
            self.model_name(fd_path)
        } else {
            fd_path.to_path_buf()
        };
        let (matched, name_matches) = if kernel_name_matches {
            (path, true)
        } else {
            let given = name.as_os_str().as_bytes();
            (given, given != path && self.config.matches(given))
        };
        // A file of no model name is looked at (its first bytes) only if it is large
        // enough to be served: few mappings are.
        let model_header = !name_matches
            && is_regular
            && size >= self.config.min_size
            && starts_as_a_model(request.fd);
        let model_len = if is_regular && wanted && (name_matches || model_header) {
            self.model_len(&name, size)
        } else {
            size
        };
        let facts = FileFacts {
            is_regular,
            size,
            model_len,
            path: matched,
            model_header,
        };
        screen_file(request, &facts, &self.config)?;
        Ok((name, model_len))
    }

    /// The program's name for the mapped file `path`, where one of its arguments leads
    /// there through symlinks, else `path`.
    fn model_name(&self, path: &Path) -> PathBuf {
        name_given(self.cmdline(), path, |arg| std::fs::canonicalize(arg).ok())
            .unwrap_or_else(|| path.to_path_buf())
    }

    /// The program's arguments, NUL-separated (empty if they cannot be read).
    pub(super) fn cmdline(&self) -> &[u8] {
        self.cmdline
            .get_or_init(|| std::fs::read("/proc/self/cmdline").unwrap_or_default())
    }

    /// The bytes of the model `path` holds (see `model::split::model_len`); `size` (the
    /// file's) when its split siblings cannot be gathered, with a warning.
    pub(super) fn model_len(&self, path: &Path, size: u64) -> u64 {
        model_len(path).unwrap_or_else(|error| {
            self.say(&format!("{error}; this file is taken for the whole model"));
            size
        })
    }
}

/// Whether `path` leads to the file `stat` describes (the same device and inode).
fn names_file(path: &Path, stat: &sys::files::Stat) -> bool {
    std::fs::metadata(path).is_ok_and(|meta| meta.dev() == stat.st_dev && meta.ino() == stat.st_ino)
}

/// Whether the file open at `fd` starts as a model does (`model::has_model_header`).
pub(super) fn starts_as_a_model(fd: i32) -> bool {
    let mut start = [0u8; hyperoffload::model::MODEL_HEADER_LEN];
    // SAFETY: `fd` is the descriptor the program passed to mmap, open for the duration
    // of this call; it is only read from, at an explicit offset (its position is kept).
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    matches!(sys::files::pread(fd, &mut start, 0), Ok(n) if n == start.len())
        && hyperoffload::model::has_model_header(&start)
}
