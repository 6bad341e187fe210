//! The name the program gave a file it maps.
//!
//! The shim knows a mapped file by the path the kernel resolves its descriptor to. A
//! split model's parts are found by their names (`model::split`), and a model reached
//! through symlinks has other names there: a Hugging Face cache snapshot links
//! `m-00001-of-00002.gguf` to a blob named by its hash. The program's arguments hold
//! the name it opened (`-m snapshots/<rev>/m-00001-of-00002.gguf`): the argument that
//! resolves to the mapped file is its name.

use std::path::{Path, PathBuf};

/// The argument of `cmdline` (NUL-separated, as `/proc/self/cmdline`) that `resolve`
/// leads to `file`, when it is another name for it; the program's name (the first
/// argument) is not one.
pub fn name_given(
    cmdline: &[u8],
    file: &Path,
    resolve: impl Fn(&Path) -> Option<PathBuf>,
) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    cmdline
        .split(|&byte| byte == 0)
        .skip(1)
        .filter(|arg| !arg.is_empty())
        .map(|arg| Path::new(std::ffi::OsStr::from_bytes(arg)))
        .find(|arg| *arg != file && resolve(arg).as_deref() == Some(file))
        .map(Path::to_path_buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(path: &Path) -> Option<PathBuf> {
        match path.to_str()? {
            "snap/m-00001-of-00002.gguf" => Some(PathBuf::from("/blobs/3f2a")),
            "/blobs/3f2a" => Some(PathBuf::from("/blobs/3f2a")),
            _ => None,
        }
    }

    #[test]
    fn the_argument_that_leads_to_the_file_is_its_name() {
        let cmdline = b"llama-cli\0-m\0snap/m-00001-of-00002.gguf\0-p\0hi\0";
        assert_eq!(
            name_given(cmdline, Path::new("/blobs/3f2a"), resolve),
            Some(PathBuf::from("snap/m-00001-of-00002.gguf"))
        );
        assert_eq!(
            name_given(cmdline, Path::new("/blobs/other"), resolve),
            None
        );
        // Named as it resolves: nothing to add.
        let plain = b"llama-cli\0-m\0/blobs/3f2a\0";
        assert_eq!(name_given(plain, Path::new("/blobs/3f2a"), resolve), None);
    }
}
