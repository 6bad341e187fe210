//! The launcher's private directory: 0700, only this user's, where the shim of every
//! process of the run writes its stats, snapshots and records; removed when the run
//! ends, and left by a launcher that was killed removed by the next one.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

/// A 0700 directory only this user can enter, for the shim to write its stats into;
/// removed when dropped.
pub(super) struct PrivateDir(pub(super) PathBuf);

impl PrivateDir {
    pub(super) fn create() -> anyhow::Result<Self> {
        let base = std::env::temp_dir();
        remove_stale_private_dirs(&base);
        for attempt in 0..100u32 {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0);
            let path = base.join(format!(
                "hyperoffload-run-{}-{:08x}",
                std::process::id(),
                nanos ^ attempt
            ));
            match std::fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => return Ok(Self(path)),
                Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(error) => {
                    return Err(error).with_context(|| format!("cannot create {}", path.display()))
                }
            }
        }
        bail!("cannot create a private directory in {}", base.display())
    }
}

/// Removes the private directories of launchers that died without removing theirs
/// (killed with SIGKILL): this user's, named for a process that no longer exists.
fn remove_stale_private_dirs(base: &Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    // SAFETY: getuid has no memory effects.
    let uid = unsafe { libc::getuid() };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = stale_dir_pid(&name.to_string_lossy()) else {
            continue;
        };
        // Never through a symlink, and only this user's directories.
        let Ok(metadata) = entry.path().symlink_metadata() else {
            continue;
        };
        if !metadata.is_dir() || metadata.uid() != uid {
            continue;
        }
        // SAFETY: signal 0 sends nothing; it only asks whether the process exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// The launcher pid in a private directory's name (`hyperoffload-run-<pid>-<hex>`).
fn stale_dir_pid(name: &str) -> Option<libc::pid_t> {
    let rest = name.strip_prefix("hyperoffload-run-")?;
    let (pid, suffix) = rest.split_once('-')?;
    if suffix.len() != 8 || !suffix.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    pid.parse().ok().filter(|&pid: &libc::pid_t| pid > 0)
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_private_directory_names_carry_a_pid() {
        assert_eq!(stale_dir_pid("hyperoffload-run-1234-0badf00d"), Some(1234));
        assert_eq!(stale_dir_pid("hyperoffload-run-1234-0badf00"), None);
        assert_eq!(stale_dir_pid("hyperoffload-run-1234-0badf00g"), None);
        assert_eq!(stale_dir_pid("hyperoffload-run-x-0badf00d"), None);
        assert_eq!(stale_dir_pid("hyperoffload-run-0-0badf00d"), None);
        assert_eq!(stale_dir_pid("other-run-1234-0badf00d"), None);
    }
}
