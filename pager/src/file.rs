//! The file a region presents: opened once for direct reads (O_DIRECT, bypassing the
//! page cache, which would otherwise double the memory the budget is meant to bound)
//! and once buffered, for filesystems that refuse O_DIRECT.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use thiserror::Error;

/// Why a file cannot back a region.
#[derive(Debug, Error)]
pub enum OpenError {
    #[error("{path}: no such file")]
    NotFound { path: PathBuf },
    #[error("{path}: not a regular file")]
    NotRegular { path: PathBuf },
    #[error("{path}: the file is empty")]
    Empty { path: PathBuf },
    #[error("{path}: cannot open for reading: {source}")]
    Unreadable { path: PathBuf, source: io::Error },
}

/// Identity of the file's contents as last seen: a replaced or rewritten file changes
/// one of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileIdentity {
    pub dev: u64,
    pub ino: u64,
    pub len: u64,
    pub mtime_ns: i128,
}

impl FileIdentity {
    fn of(metadata: &std::fs::Metadata) -> Self {
        Self {
            dev: metadata.dev(),
            ino: metadata.ino(),
            len: metadata.len(),
            mtime_ns: metadata.mtime() as i128 * 1_000_000_000 + metadata.mtime_nsec() as i128,
        }
    }
}

/// An open model file.
#[derive(Debug)]
pub struct BackingFile {
    path: PathBuf,
    buffered: File,
    direct: Option<File>,
    /// Why O_DIRECT is not used, when it is not.
    direct_refused: Option<String>,
    identity: FileIdentity,
}

impl BackingFile {
    pub fn open(path: &Path) -> Result<Self, OpenError> {
        let path_buf = path.to_path_buf();
        let buffered = File::open(path).map_err(|source| match source.kind() {
            io::ErrorKind::NotFound => OpenError::NotFound {
                path: path_buf.clone(),
            },
            _ => OpenError::Unreadable {
                path: path_buf.clone(),
                source,
            },
        })?;
        let metadata = buffered
            .metadata()
            .map_err(|source| OpenError::Unreadable {
                path: path_buf.clone(),
                source,
            })?;
        if !metadata.file_type().is_file() {
            return Err(OpenError::NotRegular { path: path_buf });
        }
        if metadata.len() == 0 {
            return Err(OpenError::Empty { path: path_buf });
        }
        let (direct, direct_refused) = match OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
        {
            Ok(file) => (Some(file), None),
            Err(error) => (
                None,
                Some(format!(
                    "O_DIRECT refused ({error}); reading through the page cache"
                )),
            ),
        };
        Ok(Self {
            path: path_buf,
            buffered,
            direct,
            direct_refused,
            identity: FileIdentity::of(&metadata),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn len(&self) -> u64 {
        self.identity.len
    }

    pub fn is_empty(&self) -> bool {
        self.identity.len == 0
    }

    pub fn identity(&self) -> FileIdentity {
        self.identity
    }

    /// The descriptor reads should use: direct when the filesystem allows it.
    pub fn read_fd(&self) -> RawFd {
        self.direct.as_ref().unwrap_or(&self.buffered).as_raw_fd()
    }

    pub fn buffered_fd(&self) -> RawFd {
        self.buffered.as_raw_fd()
    }

    /// The buffered (page cache) descriptor, borrowed.
    pub fn buffered(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.buffered.as_fd()
    }

    pub fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    pub fn direct_refused(&self) -> Option<&str> {
        self.direct_refused.as_deref()
    }

    /// Stops using O_DIRECT after the kernel refused a direct read (`EINVAL`: some
    /// filesystems accept the flag at open but not the reads).
    pub fn give_up_direct(&mut self, why: String) {
        self.direct = None;
        self.direct_refused = Some(why);
    }

    /// The identity of the open file (fstat of our descriptor, not the path): a file
    /// replaced by rename keeps the old identity here (we still read the old inode), a
    /// file modified or truncated in place does not.
    pub fn open_identity(&self) -> io::Result<FileIdentity> {
        Ok(FileIdentity::of(&self.buffered.metadata()?))
    }

    /// The file's identity now, to detect replacement or modification.
    pub fn current_identity(&self) -> io::Result<FileIdentity> {
        Ok(FileIdentity::of(&std::fs::metadata(&self.path)?))
    }
}
