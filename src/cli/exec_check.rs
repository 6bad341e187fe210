//! Whether LD_PRELOAD can reach a program: it must be a dynamically linked ELF (one
//! with a PT_INTERP program header, i.e. started by the dynamic linker), or a script
//! whose interpreter is one, and neither setuid nor setgid (the dynamic linker ignores
//! LD_PRELOAD paths for secure-execution programs).

use std::ffi::OsStr;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

const PT_INTERP: u32 = 3;

/// Finds `program` the way execvp(3) does: as given if it contains a `/`, else on PATH.
pub fn resolve_program(program: &OsStr) -> anyhow::Result<PathBuf> {
    let path = Path::new(program);
    if program.as_encoded_bytes().contains(&b'/') {
        return Ok(path.to_path_buf());
    }
    let search = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    for dir in std::env::split_paths(&search) {
        let candidate = dir.join(path);
        if let Ok(meta) = std::fs::metadata(&candidate) {
            if meta.is_file() && meta.permissions().mode() & 0o111 != 0 {
                return Ok(candidate);
            }
        }
    }
    bail!("{}: command not found on PATH", path.display())
}

/// Fails with a clear message if the shim cannot be preloaded into `path`.
pub fn check_reachable(path: &Path) -> anyhow::Result<()> {
    check_depth(path, 0)
}

fn check_depth(path: &Path, depth: u32) -> anyhow::Result<()> {
    let meta = std::fs::metadata(path).with_context(|| format!("{}", path.display()))?;
    let mode = meta.permissions().mode();
    if mode & (libc::S_ISUID | libc::S_ISGID) != 0 {
        bail!(
            "{} is setuid or setgid: the dynamic linker would not load the shim into it \
             (and the shim refuses secure-execution programs)",
            path.display()
        );
    }
    let mut head = Vec::new();
    std::fs::File::open(path)
        .with_context(|| format!("cannot read {}", path.display()))?
        .take(4096)
        .read_to_end(&mut head)?;
    if let Some(line) = head.strip_prefix(b"#!") {
        if depth > 2 {
            bail!("{}: too many levels of script interpreters", path.display());
        }
        let line = line.split(|&b| b == b'\n').next().unwrap_or_default();
        let interpreter = line
            .split(|&b| b == b' ' || b == b'\t')
            .find(|word| !word.is_empty())
            .with_context(|| format!("{}: empty #! line", path.display()))?;
        let interpreter = Path::new(OsStr::from_bytes(interpreter));
        return check_depth(interpreter, depth + 1)
            .with_context(|| format!("interpreter of {}", path.display()));
    }
    match has_interp(&head) {
        Some(true) => Ok(()),
        Some(false) => bail!(
            "{} is statically linked: LD_PRELOAD cannot reach it, so the pager cannot serve \
             its mappings",
            path.display()
        ),
        None => bail!(
            "{} is neither a 64-bit little-endian ELF executable nor a #! script",
            path.display()
        ),
    }
}

/// Whether the ELF image starting with `head` has a PT_INTERP header (`None`: not a
/// 64-bit little-endian ELF, or its program headers are not within `head`).
pub fn has_interp(head: &[u8]) -> Option<bool> {
    if head.len() < 64 || &head[..4] != b"\x7fELF" || head[4] != 2 || head[5] != 1 {
        return None;
    }
    let u16_at = |at: usize| Some(u16::from_le_bytes(head.get(at..at + 2)?.try_into().ok()?));
    let u32_at = |at: usize| Some(u32::from_le_bytes(head.get(at..at + 4)?.try_into().ok()?));
    let u64_at = |at: usize| Some(u64::from_le_bytes(head.get(at..at + 8)?.try_into().ok()?));
    let phoff = u64_at(0x20)? as usize;
    let phentsize = u16_at(0x36)? as usize;
    let phnum = u16_at(0x38)? as usize;
    if phentsize < 4 {
        return None;
    }
    for index in 0..phnum {
        if u32_at(phoff + index * phentsize)? == PT_INTERP {
            return Some(true);
        }
    }
    Some(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_programs() {
        let ls = resolve_program(OsStr::new("ls")).unwrap();
        check_reachable(&ls).unwrap();
        let missing = resolve_program(OsStr::new("no-such-program-here")).unwrap_err();
        assert_eq!(
            missing.to_string(),
            "no-such-program-here: command not found on PATH"
        );
        // Debian's ldconfig is statically linked.
        let error = check_reachable(Path::new("/sbin/ldconfig")).unwrap_err();
        assert!(error.to_string().contains("statically linked"), "{error}");
    }

    #[test]
    fn rejects_non_elf() {
        assert_eq!(has_interp(b"hello"), None);
        assert_eq!(has_interp(&[0u8; 64]), None);
    }
}
