//! What the shim saw of the program's model files (`hyperoffload::served_files`): one
//! record per file (by device and inode, so every name and descriptor of it is one
//! file), written to `<dir>/seen-<pid>.json` whenever a record changes. Written as it
//! changes rather than at exit: a program killed by a signal, or one that ends with
//! `_exit`, leaves the facts all the same; and files change only on opens and mappings
//! of model files, a few per run.
//!
//! A leaf: it knows nothing of the shim. Callers are inside the shim (they hold its
//! re-entry guard), so the file writes below reach the kernel past the shim's hooks.

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

use hyperoffload::served_files::{SeenFile, SeenFiles};
use hyperoffload::sys::processes::getpid;

/// The records, and where they go.
pub struct Seen {
    /// `None`: no one reads them (not run by the launcher), so none are kept.
    dir: Option<PathBuf>,
    files: Mutex<Vec<Entry>>,
    min_size: u64,
    patterns: Vec<String>,
}

struct Entry {
    dev: u64,
    ino: u64,
    file: SeenFile,
}

impl Seen {
    pub fn new(dir: Option<PathBuf>, min_size: u64, patterns: Vec<String>) -> Self {
        Self {
            dir,
            files: Mutex::new(Vec::new()),
            min_size,
            patterns,
        }
    }

    /// Whether records are kept at all.
    pub fn is_on(&self) -> bool {
        self.dir.is_some()
    }

    /// Whether the file `(dev, ino)` has a record.
    pub fn knows(&self, dev: u64, ino: u64) -> bool {
        self.lock()
            .iter()
            .any(|entry| entry.dev == dev && entry.ino == ino)
    }

    /// Changes the record of `(dev, ino)` with `change`, made first with `new` if there
    /// is none; the file is rewritten if the record changed.
    pub fn update(
        &self,
        key: (u64, u64),
        new: impl FnOnce() -> SeenFile,
        change: impl FnOnce(&mut SeenFile),
    ) {
        self.apply(key, Some(new), change);
    }

    /// Changes the record of `(dev, ino)` with `change` if there is one (then true).
    pub fn change_known(&self, key: (u64, u64), change: impl FnOnce(&mut SeenFile)) -> bool {
        self.apply(key, None::<fn() -> SeenFile>, change)
    }

    /// Whether `key` has a record once done (made by `new` if given and needed).
    fn apply(
        &self,
        (dev, ino): (u64, u64),
        new: Option<impl FnOnce() -> SeenFile>,
        change: impl FnOnce(&mut SeenFile),
    ) -> bool {
        let Some(dir) = &self.dir else {
            return false;
        };
        let mut files = self.lock();
        let known = files.iter().position(|e| e.dev == dev && e.ino == ino);
        let at = match (known, new) {
            (Some(at), _) => at,
            (None, Some(new)) => {
                files.push(Entry {
                    dev,
                    ino,
                    file: new(),
                });
                files.len() - 1
            }
            (None, None) => return false,
        };
        let before = files[at].file.clone();
        change(&mut files[at].file);
        if known.is_some() && files[at].file == before {
            return true;
        }
        // Written under the lock: the last write holds the latest records.
        let seen = SeenFiles {
            program: std::fs::read_link("/proc/self/exe")
                .map(|exe| exe.display().to_string())
                .unwrap_or_default(),
            min_size: self.min_size,
            patterns: self.patterns.clone(),
            files: files.iter().map(|entry| entry.file.clone()).collect(),
        };
        // A file that cannot be written costs the launcher its reasons, not the
        // program anything: the launcher then says it has none.
        let _ = write_replacing(dir, &seen.to_json());
        true
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Entry>> {
        self.files
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Writes `json` to `dir/seen-<pid>.json`, replacing the record before.
fn write_replacing(dir: &std::path::Path, json: &str) -> std::io::Result<()> {
    let name = format!("seen-{}.json", getpid());
    crate::replace_file::write_replacing(dir, &name, json.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyperoffload::served_files::{FoundBy, Refusal};

    fn record() -> SeenFile {
        SeenFile {
            path: "/m/m.gguf".into(),
            size: 4 << 20,
            model_len: 4 << 20,
            found_by: FoundBy::Name,
            opened: true,
            served: false,
            refused: None,
        }
    }

    fn written(path: &std::path::Path) -> Option<SeenFiles> {
        SeenFiles::from_json(&std::fs::read_to_string(path).ok()?)
    }

    #[test]
    fn records_are_written_when_they_change_and_only_then() {
        let dir = std::env::temp_dir().join(format!("hyperoffload-seen-test-{}", getpid()));
        std::fs::create_dir_all(&dir).unwrap();
        let seen = Seen::new(Some(dir.clone()), 1 << 20, vec!["*.gguf".into()]);
        let path = dir.join(format!("seen-{}.json", getpid()));
        seen.update((1, 2), record, |_| {});
        let first = written(&path).expect("a new record is written");
        assert_eq!(first.files, vec![record()]);
        assert_eq!(first.min_size, 1 << 20);
        assert!(seen.knows(1, 2) && !seen.knows(1, 3));
        assert!(!seen.change_known((1, 3), |file| file.served = true));
        assert!(!seen.knows(1, 3), "an unknown file is not made by a change");
        // Unchanged: not written again (the file removed stays removed).
        std::fs::remove_file(&path).unwrap();
        seen.update((1, 2), record, |file| file.opened = true);
        assert!(seen.change_known((1, 2), |file| file.opened = true));
        assert!(!path.exists());
        // Changed: written, the same file's record changed in place.
        seen.update((1, 2), record, |file| {
            file.refused = Some(Refusal::Writable)
        });
        let files = written(&path).expect("a changed record is written").files;
        assert_eq!(files.len(), 1);
        assert_eq!(files[0].refused, Some(Refusal::Writable));
        // Another file (another inode) is a record of its own.
        seen.update((1, 3), record, |_| {});
        assert_eq!(written(&path).unwrap().files.len(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn without_a_directory_nothing_is_kept() {
        let seen = Seen::new(None, 1 << 20, Vec::new());
        assert!(!seen.is_on());
        seen.update((1, 2), record, |_| {});
        assert!(!seen.knows(1, 2));
    }
}
