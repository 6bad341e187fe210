//! The shim's side of "served or told why": which files it records (`identify`) and
//! what it records of them, on an open (`note_open`), a mapping it left to the kernel
//! (`note_refused`, `note_refused_request`) and one it served (`note_served`). The
//! records themselves are `crate::seen`'s.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::map_candidate::PassReason;
use hyperoffload::served_files::{FoundBy, Refusal, SeenFile, REPORT_FLOOR};
use hyperoffload::sys;
use libc::c_int;

use super::take_file::starts_as_a_model;
use super::Shim;
use crate::given_name::name_given;
use crate::raw;

/// A file as the shim identified it for its record.
pub(super) struct Identified {
    key: (u64, u64),
    name: PathBuf,
    size: u64,
    found_by: FoundBy,
}

impl Shim {
    /// The program opened `fd` (open, openat, fopen): records it if it is a model file.
    /// Only a regular file of at least `REPORT_FLOOR` bytes costs more than an fstat.
    pub fn note_open(&self, fd: c_int) {
        if !self.seen.is_on() {
            return;
        }
        let Some(stat) = raw::fstat(fd) else {
            return;
        };
        // A file opened again (llama.cpp opens its model twice) is known by its inode.
        let key = (stat.st_dev, stat.st_ino);
        if self.seen.change_known(key, |record| record.opened = true) {
            return;
        }
        let mut buffer = [0u8; 4096];
        let Some(file) = self.identify(fd, &stat, &mut buffer, None) else {
            return;
        };
        self.verbose(|| {
            let by = match file.found_by {
                FoundBy::Name => "its name",
                FoundBy::Header => "its header",
                FoundBy::Size => "its size",
            };
            format!(
                "{}: opened, a model by {by}; served if the program maps it",
                file.name.display()
            )
        });
        self.seen.update(
            file.key,
            || new_record(&file, true),
            |record| record.opened = true,
        );
    }

    /// A mapping request of `fd` that `screen_request` refused (`reason`) with
    /// protection `prot`: recorded against its file if that is a model file.
    pub fn note_refused_request(&self, fd: c_int, prot: c_int, reason: PassReason) {
        if !self.seen.is_on() || matches!(reason, PassReason::Anonymous | PassReason::ZeroLength) {
            return;
        }
        let Some(stat) = raw::fstat(fd) else {
            return;
        };
        let refusal = if prot & libc::PROT_WRITE != 0 {
            Refusal::Writable
        } else {
            Refusal::Request(reason.describe().to_string())
        };
        self.note_refused(fd, &stat, None, refusal);
    }

    /// A mapping of `fd` left to the kernel for `refusal`: recorded if its file is a
    /// model file, or already recorded, or (refused for its name) as large as a model.
    /// `path` is the kernel's name, where the caller has it.
    pub(super) fn note_refused(
        &self,
        fd: c_int,
        stat: &sys::files::Stat,
        path: Option<&[u8]>,
        refusal: Refusal,
    ) {
        if !self.seen.is_on() {
            return;
        }
        let mut buffer = [0u8; 4096];
        let by_size = matches!(refusal, Refusal::NameNotMatched);
        let Some(file) = self.identify(fd, stat, &mut buffer, path).or_else(|| {
            let known = self.seen.knows(stat.st_dev, stat.st_ino);
            let large = by_size && stat.st_size as u64 >= self.config.min_size;
            (known || large).then(|| self.unidentified(fd, stat))?
        }) else {
            return;
        };
        let model_len = if matches!(refusal, Refusal::TooSmall) {
            self.model_len(&file.name, file.size)
        } else {
            file.size
        };
        self.seen.update(
            file.key,
            || new_record(&file, false),
            |record| {
                record.model_len = model_len;
                record.refused = Some(refusal);
            },
        );
    }

    /// A mapping of the file `stat` describes (named `name`) that the pager serves.
    pub(super) fn note_served(&self, stat: &sys::files::Stat, name: &Path, model_len: u64) {
        let file = Identified {
            key: (stat.st_dev, stat.st_ino),
            name: name.to_path_buf(),
            size: stat.st_size as u64,
            found_by: if self.config.matches(name.as_os_str().as_bytes()) {
                FoundBy::Name
            } else {
                FoundBy::Header
            },
        };
        self.seen.update(
            file.key,
            || new_record(&file, false),
            |record| {
                record.model_len = model_len;
                record.served = true;
            },
        );
    }

    /// `fd`'s file if it is a model file by name (the kernel's, or the program's name
    /// for it: see `given_name`) or, at least the minimum size, by its header.
    fn identify(
        &self,
        fd: c_int,
        stat: &sys::files::Stat,
        buffer: &mut [u8; 4096],
        path: Option<&[u8]>,
    ) -> Option<Identified> {
        let size = stat.st_size as u64;
        if stat.st_mode & libc::S_IFMT != libc::S_IFREG || size < REPORT_FLOOR {
            return None;
        }
        let path = match path {
            Some(path) => path,
            None => raw::fd_path(fd, buffer)?,
        };
        let kernel_name = Path::new(OsStr::from_bytes(path));
        let (name, found_by) = if self.config.matches(path) {
            (kernel_name.to_path_buf(), FoundBy::Name)
        } else if let Some(given) = self.matching_name_given(kernel_name) {
            (given, FoundBy::Name)
        } else if size >= self.config.min_size && starts_as_a_model(fd) {
            (kernel_name.to_path_buf(), FoundBy::Header)
        } else {
            return None;
        };
        Some(Identified {
            key: (stat.st_dev, stat.st_ino),
            name,
            size,
            found_by,
        })
    }

    /// The program's name for the file the kernel names `path` (see `given_name`), if it
    /// matches the patterns. Only the arguments that match are resolved: a program
    /// opening many large files of other names pays a scan of its arguments for each,
    /// not a path resolution per argument.
    fn matching_name_given(&self, path: &Path) -> Option<PathBuf> {
        name_given(self.cmdline(), path, |arg| {
            self.config
                .matches(arg.as_os_str().as_bytes())
                .then(|| std::fs::canonicalize(arg).ok())
                .flatten()
        })
    }

    /// `fd`'s file by its kernel name, for a record of no model name or header.
    fn unidentified(&self, fd: c_int, stat: &sys::files::Stat) -> Option<Identified> {
        let mut buffer = [0u8; 4096];
        let path = raw::fd_path(fd, &mut buffer)?;
        Some(Identified {
            key: (stat.st_dev, stat.st_ino),
            name: Path::new(OsStr::from_bytes(path)).to_path_buf(),
            size: stat.st_size as u64,
            found_by: FoundBy::Size,
        })
    }
}

fn new_record(file: &Identified, opened: bool) -> SeenFile {
    SeenFile {
        path: file.name.display().to_string(),
        size: file.size,
        model_len: file.size,
        found_by: file.found_by,
        opened,
        served: false,
        refused: None,
    }
}
