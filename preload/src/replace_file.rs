//! A private file replaced whole: written beside its name and renamed over it, so a
//! reader (the launcher, while the program runs or after it died) finds a whole file,
//! this one or the one before.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Writes `bytes` to `dir/name` (mode 0600, never through a symbolic link) through
/// `dir/.name.tmp`.
pub fn write_replacing(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    let path = dir.join(name);
    let temporary = dir.join(format!(".{name}.tmp"));
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&temporary)?
        .write_all(bytes)?;
    std::fs::rename(&temporary, &path)
}
