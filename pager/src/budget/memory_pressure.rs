//! What this process can spare while it runs, for following pressure
//! (`follow`): the memory available (/proc/meminfo) and the room left in its
//! memory cgroup and each ancestor with a limit: the limit less what the cgroup uses
//! that reclaim cannot take back (usage less the inactive page cache: v1
//! `memory.usage_in_bytes` and `total_inactive_file` of `memory.stat`, v2
//! `memory.current` and `inactive_file`), with v2's `memory.events` counts of reclaim
//! at `high` and `max`, and the PSI totals (/proc/pressure/memory, v2's
//! `memory.pressure`) where there are no triggers.
//!
//! The parsers are plain functions of the files' text, for both cgroup versions;
//! `CgroupFiles` is the thin layer that finds and reads them (a file that cannot be read
//! is a figure not known, never an error).

use std::path::{Path, PathBuf};

use crate::budget::follow::Pressure;
use crate::budget::memory_limits::{cgroup_dirs, parse_limit, parse_meminfo, parse_proc_cgroup};

/// A field of a cgroup's `memory.stat` (`name value` lines).
pub fn stat_field(text: &str, name: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (key, value) = line.split_once(' ')?;
        (key == name).then(|| value.trim().parse().ok())?
    })
}

/// The `total=` microseconds of the `some` line of a PSI file (/proc/pressure/memory,
/// a v2 cgroup's `memory.pressure`): time tasks stalled on memory, ever.
pub fn psi_some_total_us(text: &str) -> Option<u64> {
    let line = text.lines().find(|line| line.starts_with("some "))?;
    line.split_whitespace()
        .find_map(|field| field.strip_prefix("total="))?
        .parse()
        .ok()
}

/// The counts of a v2 `memory.events` that mean pressure: reclaim because usage passed
/// `memory.high`, or reached `memory.max`, and OOM kills.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CgroupEvents {
    pub high: u64,
    pub max: u64,
    pub oom_kill: u64,
}

pub fn parse_events(text: &str) -> CgroupEvents {
    CgroupEvents {
        high: stat_field(text, "high").unwrap_or(0),
        max: stat_field(text, "max").unwrap_or(0),
        oom_kill: stat_field(text, "oom_kill").unwrap_or(0),
    }
}

impl CgroupEvents {
    /// Whether any count rose since `before`.
    pub fn rose_since(&self, before: &CgroupEvents) -> bool {
        self.high > before.high || self.max > before.max || self.oom_kill > before.oom_kill
    }
}

/// A cgroup version's file names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Names {
    pub limit: &'static str,
    pub usage: &'static str,
    /// The `memory.stat` field of inactive page cache (the cgroup's and its
    /// descendants').
    pub inactive_file: &'static str,
}

pub const V1: Names = Names {
    limit: "memory.limit_in_bytes",
    usage: "memory.usage_in_bytes",
    inactive_file: "total_inactive_file",
};

pub const V2: Names = Names {
    limit: "memory.max",
    usage: "memory.current",
    inactive_file: "inactive_file",
};

/// The least room left in any of `dirs` that has a limit: the limit less the usage
/// reclaim cannot take back (`read` gives a file's text, or None). Inactive page cache
/// is reclaimed before anything is killed, so it counts as room.
pub fn cgroup_room(
    dirs: &[PathBuf],
    names: &Names,
    read: impl Fn(&Path) -> Option<String>,
) -> Option<u64> {
    dirs.iter()
        .filter_map(|dir| {
            let limit = parse_limit(&read(&dir.join(names.limit))?)?;
            let usage: u64 = read(&dir.join(names.usage))?.trim().parse().ok()?;
            let inactive = read(&dir.join("memory.stat"))
                .and_then(|stat| stat_field(&stat, names.inactive_file))
                .unwrap_or(0);
            Some(limit.saturating_sub(usage.saturating_sub(inactive)))
        })
        .min()
}

const V2_ROOTS: &[&str] = &["/sys/fs/cgroup", "/sys/fs/cgroup/unified"];
const V1_MEMORY_ROOT: &str = "/sys/fs/cgroup/memory";
/// The machine's PSI file (Linux 4.20+, with CONFIG_PSI).
pub const SYSTEM_PSI: &str = "/proc/pressure/memory";

/// This process's memory cgroup directories: its own and its ancestors', innermost
/// first, in the v2 hierarchy (under each place it may be mounted) and in v1's.
#[derive(Debug, Clone, Default)]
pub struct CgroupFiles {
    pub v2: Vec<Vec<PathBuf>>,
    pub v1: Vec<PathBuf>,
}

fn text(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

impl CgroupFiles {
    /// Finds them from /proc/self/cgroup.
    pub fn find() -> Self {
        let place = text(Path::new("/proc/self/cgroup"))
            .map(|cgroup| parse_proc_cgroup(&cgroup))
            .unwrap_or_default();
        let v2 = (place.v2.as_deref())
            .map(|path| {
                (V2_ROOTS.iter())
                    .map(|root| cgroup_dirs(Path::new(root), path))
                    .filter(|dirs| dirs[0].join("memory.current").exists())
                    .collect()
            })
            .unwrap_or_default();
        let v1 = (place.v1_memory.as_deref())
            .map(|path| cgroup_dirs(Path::new(V1_MEMORY_ROOT), path))
            .filter(|dirs| dirs[0].join(V1.usage).exists())
            .unwrap_or_default();
        Self { v2, v1 }
    }

    /// The innermost v2 cgroup directory, if this process is in a v2 memory cgroup.
    pub fn v2_dir(&self) -> Option<&Path> {
        self.v2.first().map(|dirs| dirs[0].as_path())
    }

    /// The innermost v1 memory cgroup directory, if any.
    pub fn v1_dir(&self) -> Option<&Path> {
        self.v1.first().map(PathBuf::as_path)
    }

    /// What the machine and the cgroups can still give now: the least of
    /// `MemAvailable` and each cgroup's room.
    pub fn spare(&self) -> Option<u64> {
        let available = text(Path::new("/proc/meminfo")).and_then(|m| parse_meminfo(&m).1);
        let v2 = (self.v2.iter()).filter_map(|dirs| cgroup_room(dirs, &V2, text));
        let v1 = cgroup_room(&self.v1, &V1, text);
        available.into_iter().chain(v2).chain(v1).min()
    }

    /// The innermost v2 cgroup's `memory.events`, if there is one.
    pub fn events(&self) -> Option<CgroupEvents> {
        Some(parse_events(&text(&self.v2_dir()?.join("memory.events"))?))
    }

    /// The PSI file for this process: its v2 cgroup's, else the machine's (which, under
    /// cgroup v1, sees stalls of every cgroup: see `psi_is_own`).
    pub fn psi_path(&self) -> PathBuf {
        match self.v2_dir() {
            Some(dir) if dir.join("memory.pressure").exists() => dir.join("memory.pressure"),
            _ => PathBuf::from(SYSTEM_PSI),
        }
    }
}

/// What stalls in the PSI file at `path` say about this process: its own cgroup's
/// stalls are pressure on it (`High`); the machine's may be any cgroup's reaching its
/// own limit (measured: another cgroup's reclaim shrank a follower that took them as
/// its own from 1.1 GiB to 31 MiB in 3 s with nothing short in its cgroup), so they only
/// hold growth back (`Low`). A shortage of the machine's own shows in `MemAvailable`.
pub fn psi_pressure(path: &Path) -> Pressure {
    if path == Path::new(SYSTEM_PSI) {
        Pressure::Low
    } else {
        Pressure::High
    }
}

/// The PSI `some` total of `path` now, if it can be read.
pub fn psi_total_us(path: &Path) -> Option<u64> {
    psi_some_total_us(&text(path)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const MIB: u64 = 1 << 20;

    fn files(list: &[(&str, &str)]) -> HashMap<PathBuf, String> {
        (list.iter())
            .map(|(path, text)| (PathBuf::from(path), text.to_string()))
            .collect()
    }

    #[test]
    fn v1_room_counts_inactive_cache_as_room() {
        let files = files(&[
            ("/cg/memory/a/memory.limit_in_bytes", "1073741824\n"),
            ("/cg/memory/a/memory.usage_in_bytes", "943718400\n"),
            (
                "/cg/memory/a/memory.stat",
                "cache 104857600\ninactive_file 10\ntotal_inactive_file 52428800\n",
            ),
            // The root: no limit.
            ("/cg/memory/memory.limit_in_bytes", "9223372036854771712\n"),
            ("/cg/memory/memory.usage_in_bytes", "5000000000\n"),
        ]);
        let read = |path: &Path| files.get(path).cloned();
        let dirs = cgroup_dirs(Path::new("/cg/memory"), "/a");
        // 1024 MiB less (900 - 50) MiB.
        assert_eq!(cgroup_room(&dirs, &V1, read), Some(174 * MIB));
    }

    #[test]
    fn v2_room_is_the_tightest_ancestor_s() {
        let files = files(&[
            ("/cg/a/b/memory.max", "max\n"),
            ("/cg/a/b/memory.current", "100\n"),
            ("/cg/a/memory.max", "2097152\n"),
            ("/cg/a/memory.current", "1572864\n"),
            (
                "/cg/a/memory.stat",
                "anon 1000\nfile 600000\ninactive_file 524288\n",
            ),
        ]);
        let read = |path: &Path| files.get(path).cloned();
        let dirs = cgroup_dirs(Path::new("/cg"), "/a/b");
        assert_eq!(cgroup_room(&dirs, &V2, read), Some(MIB));
        // No limit anywhere: no room known.
        assert_eq!(cgroup_room(&dirs[..1], &V2, read), None);
    }

    #[test]
    fn a_stat_field_is_found_by_its_whole_name() {
        let stat = "inactive_file 5\ntotal_inactive_file 7\n";
        assert_eq!(stat_field(stat, "inactive_file"), Some(5));
        assert_eq!(stat_field(stat, "total_inactive_file"), Some(7));
        assert_eq!(stat_field(stat, "active_file"), None);
    }

    #[test]
    fn only_a_cgroup_s_own_stalls_are_pressure_on_it() {
        assert_eq!(psi_pressure(Path::new(SYSTEM_PSI)), Pressure::Low);
        let own = Path::new("/sys/fs/cgroup/user.slice/memory.pressure");
        assert_eq!(psi_pressure(own), Pressure::High);
    }

    #[test]
    fn psi_gives_the_some_total() {
        let text = "some avg10=0.12 avg60=0.00 avg300=0.00 total=123456\n\
                    full avg10=0.00 avg60=0.00 avg300=0.00 total=99\n";
        assert_eq!(psi_some_total_us(text), Some(123456));
        assert_eq!(psi_some_total_us("full total=1\n"), None);
    }

    #[test]
    fn v2_events_rise_on_high_max_or_oom() {
        let before = parse_events("low 0\nhigh 3\nmax 0\noom 0\noom_kill 0\n");
        assert_eq!(
            before,
            CgroupEvents {
                high: 3,
                max: 0,
                oom_kill: 0
            }
        );
        assert!(!before.rose_since(&before));
        let after = parse_events("low 9\nhigh 3\nmax 1\noom 1\noom_kill 0\n");
        assert!(after.rose_since(&before));
        // `low` events are not pressure.
        let low = parse_events("low 10\nhigh 3\nmax 0\n");
        assert!(!low.rose_since(&before));
    }
}
