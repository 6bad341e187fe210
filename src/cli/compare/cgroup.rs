//! A memory cgroup this process creates for one run and removes afterwards: cgroup v2
//! where its memory controller is available, otherwise v1's `memory` hierarchy.

use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use thiserror::Error;

const V1_ROOT: &str = "/sys/fs/cgroup/memory";
const V2_CANDIDATES: &[&str] = &["/sys/fs/cgroup", "/sys/fs/cgroup/unified"];

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum CgroupVersion {
    V1,
    V2,
}

#[derive(Debug, Error)]
pub enum CgroupError {
    #[error("no memory cgroup controller: neither a cgroup2 hierarchy with `memory` in cgroup.controllers nor {V1_ROOT}")]
    NoMemoryController,
    #[error("{path}: {source}")]
    File {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// A memory cgroup directory, removed on drop (its remaining processes are killed).
#[derive(Debug)]
pub struct MemoryCgroup {
    dir: PathBuf,
    version: CgroupVersion,
}

fn file_error(path: &Path) -> impl FnOnce(io::Error) -> CgroupError + '_ {
    move |source| CgroupError::File {
        path: path.to_path_buf(),
        source,
    }
}

/// Where new memory cgroups go, and which interface they have.
pub fn memory_hierarchy() -> Result<(PathBuf, CgroupVersion), CgroupError> {
    for root in V2_CANDIDATES {
        let controllers = Path::new(root).join("cgroup.controllers");
        if let Ok(text) = std::fs::read_to_string(&controllers) {
            let subtree = std::fs::read_to_string(Path::new(root).join("cgroup.subtree_control"))
                .unwrap_or_default();
            if text.split_whitespace().any(|c| c == "memory")
                && subtree.split_whitespace().any(|c| c == "memory")
            {
                return Ok((PathBuf::from(root), CgroupVersion::V2));
            }
        }
    }
    if Path::new(V1_ROOT).join("memory.limit_in_bytes").exists() {
        return Ok((PathBuf::from(V1_ROOT), CgroupVersion::V1));
    }
    Err(CgroupError::NoMemoryController)
}

impl MemoryCgroup {
    /// Creates cgroup `name` with a memory limit (page cache included), or none.
    pub fn create(name: &str, limit_bytes: Option<u64>) -> Result<Self, CgroupError> {
        let (root, version) = memory_hierarchy()?;
        let dir = root.join(name);
        if dir.exists() {
            // A leftover of a killed run: empty, it can go.
            let _ = std::fs::remove_dir(&dir);
        }
        std::fs::create_dir(&dir).map_err(file_error(&dir))?;
        let cgroup = Self { dir, version };
        if let Some(limit) = limit_bytes {
            match version {
                CgroupVersion::V1 => cgroup.write("memory.limit_in_bytes", &limit.to_string())?,
                CgroupVersion::V2 => {
                    cgroup.write("memory.max", &limit.to_string())?;
                    // Swap would let the run exceed its budget in RAM terms unnoticed.
                    let _ = cgroup.write("memory.swap.max", "0");
                }
            }
        }
        Ok(cgroup)
    }

    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn write(&self, file: &str, value: &str) -> Result<(), CgroupError> {
        let path = self.dir.join(file);
        std::fs::write(&path, value).map_err(file_error(&path))
    }

    fn read_u64(&self, file: &str) -> Result<u64, CgroupError> {
        let path = self.dir.join(file);
        let text = std::fs::read_to_string(&path).map_err(file_error(&path))?;
        text.trim().parse().map_err(|_| CgroupError::File {
            path,
            source: io::Error::new(io::ErrorKind::InvalidData, format!("not a number: {text}")),
        })
    }

    /// `cgroup.procs` opened for writing, so a child can enter before it executes.
    pub fn procs_file(&self) -> Result<File, CgroupError> {
        let path = self.dir.join("cgroup.procs");
        OpenOptions::new()
            .write(true)
            .open(&path)
            .map_err(file_error(&path))
    }

    /// The most memory charged since creation.
    pub fn peak_bytes(&self) -> Result<u64, CgroupError> {
        match self.version {
            CgroupVersion::V1 => self.read_u64("memory.max_usage_in_bytes"),
            CgroupVersion::V2 => self.read_u64("memory.peak"),
        }
    }

    /// The processes in the cgroup now.
    pub fn pids(&self) -> Vec<u32> {
        std::fs::read_to_string(self.dir.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|line| line.trim().parse().ok())
            .collect()
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        // A cgroup with processes cannot be removed: kill what the run left behind.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let pids = self.pids();
            if pids.is_empty() || Instant::now() > deadline {
                break;
            }
            for pid in pids {
                // SAFETY: kill(2) has no memory-safety preconditions.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Err(error) = std::fs::remove_dir(&self.dir) {
            eprintln!(
                "warning: could not remove cgroup {}: {error}",
                self.dir.display()
            );
        }
    }
}
