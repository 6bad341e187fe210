//! How much memory this process can have: the machine's (`MemTotal`, `MemAvailable` in
//! /proc/meminfo) and its memory cgroup's limit (v2 `memory.max` of its cgroup and every
//! ancestor, v1 `memory.limit_in_bytes`), and the warning a budget above them earns.
//!
//! The parsing and the decision are plain functions of the files' text; `read` is the
//! thin layer that reads them (any file that cannot be read is a limit not known, never
//! an error: the warning is advice, and the run goes on without it).

use std::path::{Path, PathBuf};

use crate::size::format_size;

/// What the machine and the cgroup give, as far as known.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryLimits {
    /// The machine's RAM (`MemTotal`).
    pub total: Option<u64>,
    /// What the kernel can give now without swapping (`MemAvailable`).
    pub available: Option<u64>,
    /// The tightest memory limit of this process's cgroup and its ancestors.
    pub cgroup: Option<u64>,
    /// The least a cgroup of this process's (it or an ancestor) can still give: its
    /// limit less what it holds now (v2 `memory.current`, v1 `memory.usage_in_bytes`).
    pub cgroup_spare: Option<u64>,
}

/// Which limit a budget is above.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Cgroup,
    Total,
    Available,
}

/// A budget above what this process can have: the pager takes it as given, so the
/// kernel (swap, or the OOM killer) would stop the program before the pager evicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetWarning {
    pub budget: u64,
    pub limit: Limit,
    pub bytes: u64,
}

impl std::fmt::Display for BudgetWarning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.limit {
            Limit::Cgroup => "the memory limit of this process's cgroup",
            Limit::Total => "this machine's RAM",
            Limit::Available => "the memory available now",
        };
        write!(
            f,
            "warning: the budget of {} is more than {what} ({}): the pager would not evict \
             before the kernel swaps or kills the program; give a smaller --budget",
            format_size(self.budget),
            format_size(self.bytes)
        )
    }
}

/// The warning for `budget` under `limits`, if it is above any of them. The tightest
/// limit it exceeds is named, except that a budget above the machine's RAM is said to
/// be that rather than above the (smaller) memory available now: more memory may become
/// available, never more RAM.
pub fn budget_warning(budget: u64, limits: &MemoryLimits) -> Option<BudgetWarning> {
    let above_total = limits.total.is_some_and(|total| budget > total);
    [
        (Limit::Cgroup, limits.cgroup),
        (Limit::Total, limits.total),
        (Limit::Available, limits.available.filter(|_| !above_total)),
    ]
    .into_iter()
    .filter_map(|(limit, bytes)| Some((limit, bytes?)))
    .filter(|&(_, bytes)| budget > bytes)
    .min_by_key(|&(_, bytes)| bytes)
    .map(|(limit, bytes)| BudgetWarning {
        budget,
        limit,
        bytes,
    })
}

/// `MemTotal` and `MemAvailable` from the text of /proc/meminfo (in kB there).
pub fn parse_meminfo(text: &str) -> (Option<u64>, Option<u64>) {
    let field = |name: &str| {
        text.lines().find_map(|line| {
            let rest = line.strip_prefix(name)?.strip_prefix(':')?;
            let kb: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
            kb.checked_mul(1024)
        })
    };
    (field("MemTotal"), field("MemAvailable"))
}

/// Where this process's memory cgroup is, from the text of /proc/self/cgroup: its path
/// in the v2 hierarchy (`0::/path`) and in v1's `memory` hierarchy (`N:memory:/path`,
/// or a line listing `memory` among several controllers).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CgroupPlace {
    pub v2: Option<String>,
    pub v1_memory: Option<String>,
}

pub fn parse_proc_cgroup(text: &str) -> CgroupPlace {
    let mut place = CgroupPlace::default();
    for line in text.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        if id == "0" && controllers.is_empty() {
            place.v2 = Some(path.to_string());
        } else if controllers.split(',').any(|c| c == "memory") {
            place.v1_memory = Some(path.to_string());
        }
    }
    place
}

/// A limit file's value: `max` (v2) or v1's "no limit" (a page-rounded `i64::MAX`, or
/// anything that large) is no limit.
pub fn parse_limit(text: &str) -> Option<u64> {
    let text = text.trim();
    if text == "max" {
        return None;
    }
    text.parse::<u64>().ok().filter(|&bytes| bytes < 1 << 62)
}

/// The cgroup directory at `path` (as /proc/self/cgroup gives it) under `root` and its
/// ancestors up to `root`, innermost first.
pub fn cgroup_dirs(root: &Path, path: &str) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    let mut relative = Path::new(path.trim_start_matches('/'));
    loop {
        dirs.push(root.join(relative));
        match relative.parent() {
            Some(parent) => relative = parent,
            None => break,
        }
    }
    dirs
}

/// The smallest of the limits found in `file` of each of `dirs` (`read` gives a file's
/// text, or None).
pub fn tightest_limit(
    dirs: &[PathBuf],
    file: &str,
    read: impl Fn(&Path) -> Option<String>,
) -> Option<u64> {
    dirs.iter()
        .filter_map(|dir| parse_limit(&read(&dir.join(file))?))
        .min()
}

/// The least room left in any of `dirs`: the limit in `limit_file` less the usage in
/// `usage_file`, for each directory that has a limit and says its usage.
pub fn least_spare(
    dirs: &[PathBuf],
    limit_file: &str,
    usage_file: &str,
    read: impl Fn(&Path) -> Option<String>,
) -> Option<u64> {
    dirs.iter()
        .filter_map(|dir| {
            let limit = parse_limit(&read(&dir.join(limit_file))?)?;
            let usage: u64 = read(&dir.join(usage_file))?.trim().parse().ok()?;
            Some(limit.saturating_sub(usage))
        })
        .min()
}

/// Least headroom `auto_budget` leaves beside the budget, where there is room for it
/// twice over (see `auto_headroom`).
pub const AUTO_HEADROOM_MIN: u64 = 256 << 20;

/// What the automatic budget leaves of `room` (what the process could have) for the
/// program's own memory: a quarter, at least `AUTO_HEADROOM_MIN` (llama.cpp allocates
/// its context after mapping the model), but never more than half the room. Without
/// that last bound a room below 256 MiB (a small memory cgroup) gave a budget of nothing,
/// which the pager raises to its floor of a few 4 KiB blocks: it then reads the model 4
/// KiB at a time (SmolLM2 at 27 MiB/s), and a mixture of experts under the graph policy
/// stalled for good (issue 43). Half the room keeps the program's side as large as the
/// budget; if the program takes more, the budget follows pressure down.
pub fn auto_headroom(room: u64) -> u64 {
    (room / 4).max(AUTO_HEADROOM_MIN.min(room / 2))
}

/// The budget `--budget auto` starts from: what this process can have now (the memory
/// available, and what its cgroup can still give) less a headroom for the program's own
/// memory (`auto_headroom`). `None` when nothing is known.
///
/// It is not capped at a share of the RAM: on a model larger than the machine every
/// byte the budget leaves unused is read again from the disk each token (a cap at half
/// the RAM left 11 GiB of 23.6 unused while a 37 GiB model decoded at 1.3x the kernel,
/// bench/results.md "Larger than the machine"), and what the rest of the machine needs
/// later is met by following pressure down (`budget::follow`).
pub fn auto_budget(limits: &MemoryLimits) -> Option<u64> {
    let spare = [limits.available, limits.cgroup_spare]
        .into_iter()
        .flatten()
        .min()?;
    Some(spare - auto_headroom(spare))
}

/// The most an automatic budget follows pressure up to on a machine of `ram` bytes
/// when no `--max` is given: the RAM less the headroom `auto_budget` would leave of it.
pub fn auto_ceiling(ram: u64) -> u64 {
    ram - auto_headroom(ram)
}

const V2_ROOTS: &[&str] = &["/sys/fs/cgroup", "/sys/fs/cgroup/unified"];
const V1_MEMORY_ROOT: &str = "/sys/fs/cgroup/memory";

/// Reads the limits of this machine and process (the thin layer over the functions
/// above).
pub fn read() -> MemoryLimits {
    let text = |path: &Path| std::fs::read_to_string(path).ok();
    let (total, available) = text(Path::new("/proc/meminfo"))
        .map(|meminfo| parse_meminfo(&meminfo))
        .unwrap_or_default();
    let place = text(Path::new("/proc/self/cgroup"))
        .map(|cgroup| parse_proc_cgroup(&cgroup))
        .unwrap_or_default();
    let v2_dirs: Vec<Vec<PathBuf>> = (place.v2.as_deref())
        .map(|path| {
            (V2_ROOTS.iter())
                .map(|root| cgroup_dirs(Path::new(root), path))
                .collect()
        })
        .unwrap_or_default();
    let v1_dirs = (place.v1_memory.as_deref())
        .map(|path| cgroup_dirs(Path::new(V1_MEMORY_ROOT), path))
        .unwrap_or_default();
    let v2 = (v2_dirs.iter())
        .filter_map(|dirs| tightest_limit(dirs, "memory.max", text))
        .min();
    let v1 = tightest_limit(&v1_dirs, "memory.limit_in_bytes", text);
    let v2_spare = (v2_dirs.iter())
        .filter_map(|dirs| least_spare(dirs, "memory.max", "memory.current", text))
        .min();
    let v1_spare = least_spare(
        &v1_dirs,
        "memory.limit_in_bytes",
        "memory.usage_in_bytes",
        text,
    );
    MemoryLimits {
        total,
        available,
        cgroup: v2.into_iter().chain(v1).min(),
        cgroup_spare: v2_spare.into_iter().chain(v1_spare).min(),
    }
}

/// `--budget auto` for this process now (the thin layer over `auto_budget`): half the
/// RAM when nothing is known.
pub fn auto_budget_now() -> u64 {
    auto_budget(&read()).unwrap_or_else(|| crate::sys::memory::physical_ram() / 2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const GIB: u64 = 1 << 30;

    #[test]
    fn auto_budget_is_what_the_process_can_have_less_a_headroom() {
        let machine = |available, cgroup_spare| MemoryLimits {
            total: Some(24 * GIB),
            available,
            cgroup: None,
            cgroup_spare,
        };
        // A 2 GiB cgroup holding 100 MiB: three quarters of the 1.9 GiB left.
        let in_cgroup = auto_budget(&machine(Some(23 * GIB), Some(2 * GIB - (100 << 20))));
        let spare = 2 * GIB - (100 << 20);
        assert_eq!(in_cgroup, Some(spare - spare / 4));
        // No cgroup limit: three quarters of what is available, not capped at a share
        // of the RAM.
        assert_eq!(
            auto_budget(&machine(Some(23 * GIB), None)),
            Some(23 * GIB - 23 * GIB / 4)
        );
        assert_eq!(auto_ceiling(24 * GIB), 18 * GIB);
        assert_eq!(auto_ceiling(256 << 20), 128 << 20);
        // Little to spare: the headroom stays at least 256 MiB...
        assert_eq!(
            auto_budget(&machine(Some(768 << 20), None)),
            Some(512 << 20)
        );
        assert_eq!(
            auto_budget(&machine(Some(512 << 20), None)),
            Some(256 << 20)
        );
        // ...but takes at most half: a small cgroup's budget is never nothing.
        assert_eq!(
            auto_budget(&machine(Some(23 * GIB), Some(200 << 20))),
            Some(100 << 20)
        );
        assert_eq!(auto_budget(&machine(Some(100 << 20), None)), Some(50 << 20));
        assert_eq!(auto_budget(&machine(Some(0), None)), Some(0));
        assert_eq!(auto_budget(&machine(None, None)), None);
    }

    #[test]
    fn the_least_spare_is_of_the_tightest_cgroup_by_room_left() {
        let files: HashMap<PathBuf, &str> = [
            ("/cg/a/b/memory.max", "max"),
            ("/cg/a/b/memory.current", "100"),
            ("/cg/a/memory.max", "1000"),
            ("/cg/a/memory.current", "900"),
            ("/cg/memory.max", "500"),
            ("/cg/memory.current", "0"),
        ]
        .into_iter()
        .map(|(path, text)| (PathBuf::from(path), text))
        .collect();
        let read = |path: &Path| files.get(path).map(|text| text.to_string());
        let dirs = cgroup_dirs(Path::new("/cg"), "/a/b");
        assert_eq!(
            least_spare(&dirs, "memory.max", "memory.current", read),
            Some(100)
        );
    }

    #[test]
    fn meminfo_gives_total_and_available_in_bytes() {
        let text = "MemTotal:       24683584 kB\nMemFree:   100 kB\nMemAvailable:   23898888 kB\n";
        assert_eq!(
            parse_meminfo(text),
            (Some(24683584 * 1024), Some(23898888 * 1024))
        );
        assert_eq!(parse_meminfo("MemFree: 1 kB\n"), (None, None));
    }

    #[test]
    fn the_cgroup_file_names_the_v2_path_and_v1_memory_path() {
        let v1 = "9:name=systemd:/\n4:memory:/process_api/7a31\n3:cpuset:/\n0::/\n";
        assert_eq!(
            parse_proc_cgroup(v1),
            CgroupPlace {
                v2: Some("/".into()),
                v1_memory: Some("/process_api/7a31".into())
            }
        );
        let joined = "5:cpu,memory:/a\n";
        assert_eq!(parse_proc_cgroup(joined).v1_memory.as_deref(), Some("/a"));
        assert_eq!(
            parse_proc_cgroup("0::/user.slice/session-1.scope\n")
                .v2
                .as_deref(),
            Some("/user.slice/session-1.scope")
        );
    }

    #[test]
    fn no_limit_is_told_from_a_limit() {
        assert_eq!(parse_limit("max\n"), None);
        assert_eq!(parse_limit("9223372036854771712\n"), None);
        assert_eq!(parse_limit("268435456\n"), Some(256 << 20));
        assert_eq!(parse_limit("garbage"), None);
    }

    #[test]
    fn the_tightest_limit_of_a_cgroup_and_its_ancestors_counts() {
        let dirs = cgroup_dirs(Path::new("/cg"), "/a/b");
        assert_eq!(
            dirs,
            [
                PathBuf::from("/cg/a/b"),
                PathBuf::from("/cg/a"),
                PathBuf::from("/cg")
            ]
        );
        let files: HashMap<PathBuf, &str> = [
            (PathBuf::from("/cg/a/b/memory.max"), "max"),
            (PathBuf::from("/cg/a/memory.max"), "1073741824"),
        ]
        .into_iter()
        .collect();
        let read = |path: &Path| files.get(path).map(|text| text.to_string());
        assert_eq!(tightest_limit(&dirs, "memory.max", read), Some(GIB));
        assert_eq!(tightest_limit(&dirs, "memory.other", read), None);
        assert_eq!(cgroup_dirs(Path::new("/cg"), "/"), [PathBuf::from("/cg")]);
    }

    #[test]
    fn a_budget_above_a_limit_is_warned_of_naming_the_tightest() {
        let limits = MemoryLimits {
            total: Some(16 * GIB),
            available: Some(10 * GIB),
            cgroup: Some(4 * GIB),
            cgroup_spare: None,
        };
        assert_eq!(budget_warning(3 * GIB, &limits), None);
        let warning = budget_warning(5 * GIB, &limits).unwrap();
        assert_eq!((warning.limit, warning.bytes), (Limit::Cgroup, 4 * GIB));
        assert!(warning.to_string().contains("cgroup"), "{warning}");
        let free = MemoryLimits {
            cgroup: None,
            ..limits
        };
        assert_eq!(
            budget_warning(11 * GIB, &free).unwrap().limit,
            Limit::Available
        );
        let warning = budget_warning(1 << 40, &free).unwrap();
        assert_eq!((warning.limit, warning.bytes), (Limit::Total, 16 * GIB));
        assert!(warning.to_string().contains("1.00 TiB"), "{warning}");
        // Nothing known: nothing to warn of.
        assert_eq!(budget_warning(1 << 40, &MemoryLimits::default()), None);
    }
}
