//! The model a run pages: its files (one, or every part of a split GGUF), the disks
//! they live on, and how much of a file the page cache holds.

use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use thiserror::Error;

use super::super::model_files::ModelFiles;
use super::super::trace_event::DeviceNumber;
use hyperoffload::model::split::{split_parts, SplitError};
use hyperoffload::model::ModelFile;

/// Why the model's files could not be found.
#[derive(Debug, Error)]
pub enum ModelTargetError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Boxed: a split error is large, and every compare result would carry its size.
    #[error(transparent)]
    Split(Box<SplitError>),
}

/// The model the program pages (one file, or every part of a split GGUF), and the block
/// devices its files live on.
#[derive(Debug, Clone)]
pub struct ModelTarget {
    pub files: ModelFiles,
    /// The whole disks holding the files, each once, in the order of the parts: block
    /// requests name the disk, not the partition. Parts on different disks are all
    /// traced, and the program's reads from any of them are the model's.
    pub devices: Vec<DeviceNumber>,
}

impl ModelTarget {
    /// The model `path` is (or is a part of), with canonical paths, as the program's
    /// `/proc/PID/maps` names its files. A file that is no model this program reads
    /// (as `model_len` has it) is a model of one file.
    pub fn find(path: &Path) -> Result<ModelTarget, ModelTargetError> {
        let io_error = |path: &Path| {
            let path = path.to_path_buf();
            move |source| ModelTargetError::Io { path, source }
        };
        // Parts are found by the name given: a part reached through a symlink (a
        // Hugging Face cache's snapshot) resolves to a blob named by its hash.
        let resolved = path.canonicalize().map_err(io_error(path))?;
        let parts = match ModelFile::open(path) {
            Ok(model) => split_parts(&model).map_err(|e| ModelTargetError::Split(Box::new(e)))?,
            Err(_) => None,
        };
        let paths = match parts {
            Some(parts) => parts.into_iter().map(|part| part.path).collect(),
            None => vec![resolved],
        };
        let mut files = Vec::with_capacity(paths.len());
        let mut devices = Vec::new();
        for path in paths {
            let path = path.canonicalize().map_err(io_error(&path))?;
            let metadata = std::fs::metadata(&path).map_err(io_error(&path))?;
            let device = disk_of(metadata.dev());
            if !devices.contains(&device) {
                devices.push(device);
            }
            files.push((path, metadata.len()));
        }
        Ok(ModelTarget {
            files: ModelFiles::new(files).expect("a model has at least one file"),
            devices,
        })
    }
}

/// The whole disk holding the filesystem of `st_dev`.
fn disk_of(dev: u64) -> DeviceNumber {
    let mut device = DeviceNumber {
        major: libc::major(dev),
        minor: libc::minor(dev),
    };
    // A partition's sysfs directory has a `partition` file and sits in its disk's.
    let sys = PathBuf::from(format!("/sys/dev/block/{device}"));
    if sys.join("partition").exists() {
        if let Ok(parent) = std::fs::read_to_string(sys.join("../dev")) {
            if let Some((major, minor)) = parent.trim().split_once(':') {
                if let (Ok(major), Ok(minor)) = (major.parse(), minor.parse()) {
                    device = DeviceNumber { major, minor };
                }
            }
        }
    }
    device
}

/// Bytes of `path` in the page cache now (mincore(2) over a fresh mapping). Pages
/// another process keeps mapped survive `drop_caches`: a run that starts with some is
/// not cold.
pub fn cached_bytes(path: &Path) -> io::Result<u64> {
    let file = File::open(path)?;
    let len = file.metadata()?.len() as usize;
    if len == 0 {
        return Ok(0);
    }
    // SAFETY: a private read-only mapping of a file we opened; nothing reads through it,
    // it is only passed to mincore.
    let map = unsafe { memmap2::MmapOptions::new().len(len).map(&file)? };
    let page = 4096usize;
    let mut resident = vec![0u8; len.div_ceil(page)];
    // SAFETY: `map` covers `len` bytes from a page-aligned address; `resident` holds one
    // byte per page of it.
    let rc = unsafe {
        libc::mincore(
            map.as_ptr() as *mut libc::c_void,
            len,
            resident.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(resident.iter().filter(|&&b| b & 1 != 0).count() as u64 * page as u64)
}
