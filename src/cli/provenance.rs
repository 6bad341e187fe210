//! Where a figure came from, for the files that keep figures (bench/*.md): the command
//! that measured it, when it started and ended (UTC), and the commit of the code that
//! ran, with a mark when the code differed from that commit.

use std::path::Path;
use std::process::Command;
use std::time::SystemTime;

/// The directories and files whose changes change what a benchmark measures.
const CODE_PATHS: &[&str] = &["pager", "preload", "src", "Cargo.toml", "Cargo.lock"];

/// A measurement's command, start and code, taken when it starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Provenance {
    pub command: String,
    pub started: SystemTime,
    /// `a2b2d84`, `a2b2d84 with uncommitted changes to the code`, or why it is unknown.
    pub commit: String,
}

impl Provenance {
    /// This process's command line, now, and the commit of the checkout `dir` is in.
    pub fn of_this_run(dir: &Path) -> Provenance {
        Provenance {
            command: std::env::args().collect::<Vec<_>>().join(" "),
            started: SystemTime::now(),
            commit: commit_of(dir),
        }
    }

    /// One line for a figure file, closing the measurement at `ended`.
    pub fn line(&self, ended: SystemTime) -> String {
        format!(
            "Measured by `{}` from {} to {} (UTC), commit {}.",
            self.command,
            humantime::format_rfc3339_seconds(self.started),
            humantime::format_rfc3339_seconds(ended),
            self.commit
        )
    }
}

fn commit_of(dir: &Path) -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(dir)
            .args(args)
            .output()
            .ok()
            .filter(|output| output.status.success())
            .map(|output| String::from_utf8_lossy(&output.stdout).trim().to_string())
    };
    let Some(head) = git(&["rev-parse", "--short", "HEAD"]) else {
        return format!("unknown ({} is not in a git checkout)", dir.display());
    };
    let mut status = vec!["status", "--porcelain", "--untracked-files=no", "--"];
    status.extend_from_slice(CODE_PATHS);
    match git(&status) {
        Some(changes) if changes.is_empty() => head,
        Some(_) => format!("{head} with uncommitted changes to the code"),
        None => format!("{head} (whether the code differs from it is unknown)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_line_names_the_command_both_times_and_the_commit() {
        let provenance = Provenance {
            command: "hyperoffload bench --model m.gguf".into(),
            started: SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_515_200),
            commit: "a2b2d84".into(),
        };
        let ended = provenance.started + Duration::from_secs(1800);
        assert_eq!(
            provenance.line(ended),
            "Measured by `hyperoffload bench --model m.gguf` from 2026-12-06T00:00:00Z to \
             2026-12-06T00:30:00Z (UTC), commit a2b2d84."
        );
    }

    #[test]
    fn outside_a_checkout_the_commit_says_it_is_unknown() {
        let dir = std::env::temp_dir();
        assert!(
            commit_of(&dir).starts_with("unknown ("),
            "{}",
            commit_of(&dir)
        );
    }

    #[test]
    fn inside_this_checkout_the_commit_is_heads() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        let head = Command::new("git")
            .args([
                "-C",
                env!("CARGO_MANIFEST_DIR"),
                "rev-parse",
                "--short",
                "HEAD",
            ])
            .output()
            .unwrap();
        if !head.status.success() {
            // A source tarball, not a checkout: nothing to compare against.
            assert!(commit_of(dir).starts_with("unknown ("));
            return;
        }
        let head = String::from_utf8(head.stdout).unwrap();
        assert!(
            commit_of(dir).starts_with(head.trim()),
            "{}",
            commit_of(dir)
        );
    }
}
