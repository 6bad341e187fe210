//! Shared helpers for the integration tests: test files with known contents, the
//! skip rule for machines without userfaultfd/io_uring, residency sampling, and running
//! a test body in a child process (for SIGBUS and shutdown checks).
#![allow(dead_code)]

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use hyperoffload::{Pager, PagerBuilder, PagerError};

/// Builds a pager, or decides the test cannot run here. Without userfaultfd or
/// io_uring the test fails, unless HYPEROFFLOAD_ALLOW_SKIP=1 (then it says why and
/// returns None).
pub fn pager_or_skip(builder: PagerBuilder) -> Option<Pager> {
    match builder.build() {
        Ok(pager) => Some(pager),
        Err(
            error @ (PagerError::UffdNotPermitted(_)
            | PagerError::UffdUnavailable(_)
            | PagerError::UffdNoPoison
            | PagerError::Ring(_)),
        ) => {
            if std::env::var("HYPEROFFLOAD_ALLOW_SKIP").as_deref() == Ok("1") {
                eprintln!("skipped: {error}");
                None
            } else {
                panic!("{error} (set HYPEROFFLOAD_ALLOW_SKIP=1 to skip tests that need it)");
            }
        }
        Err(error) => panic!("pager: {error}"),
    }
}

/// The byte at `offset` of a pattern file: varies with every position and with the
/// block and page number, so a byte from the wrong place is caught.
pub fn pattern_byte(offset: u64) -> u8 {
    let x = offset.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (offset >> 12) ^ (offset >> 20);
    (x >> 56) as u8 ^ offset as u8
}

pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> Self {
        let base = std::env::var_os("CARGO_TARGET_TMPDIR")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let dir = base.join(format!("{name}-{}-{}", std::process::id(), unique()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Writes a file of `len` pattern bytes.
pub fn pattern_file(path: &Path, len: u64) {
    let mut file = File::create(path).unwrap();
    let mut offset = 0u64;
    let mut chunk = vec![0u8; 1 << 20];
    while offset < len {
        let n = ((len - offset) as usize).min(chunk.len());
        for (i, byte) in chunk[..n].iter_mut().enumerate() {
            *byte = pattern_byte(offset + i as u64);
        }
        file.write_all(&chunk[..n]).unwrap();
        offset += n as u64;
    }
    file.sync_all().unwrap();
}

/// A sparse file of `len` bytes with pattern bytes only in the given ranges.
pub fn sparse_file(path: &Path, len: u64, data: &[std::ops::Range<u64>]) {
    let file = File::create(path).unwrap();
    file.set_len(len).unwrap();
    for range in data {
        let bytes: Vec<u8> = range.clone().map(pattern_byte).collect();
        file.write_all_at(&bytes, range.start).unwrap();
    }
    file.sync_all().unwrap();
}

/// Resident bytes of the mappings in `[base, base + len)`, from /proc/self/smaps.
pub fn mapping_rss(base: usize, len: usize) -> u64 {
    process_mappings_rss(std::process::id(), &[(base, len)])
}

/// Pages of `[base, base + len)` that are resident, from mincore.
pub fn resident_pages(base: usize, len: usize) -> Vec<bool> {
    let pages = len.div_ceil(4096);
    let mut vec = vec![0u8; pages];
    // SAFETY: mincore only reads page tables of a range this process maps and writes one
    // byte per page into `vec`, which has room for all of them.
    let rc = unsafe { libc::mincore(base as *mut libc::c_void, len, vec.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
    vec.into_iter().map(|b| b & 1 == 1).collect()
}

/// Whether each page of `[base, base + len)` is mapped in this process's page tables
/// (/proc/self/pagemap, bit 63). Unlike mincore, which for a shared file mapping reports
/// the file's page cache, this sees a page dropped from the mapping as gone.
pub fn pages_present(base: usize, len: usize) -> Vec<bool> {
    use std::os::unix::fs::FileExt;
    let pages = len.div_ceil(4096);
    let mut raw = vec![0u8; pages * 8];
    let pagemap = std::fs::File::open("/proc/self/pagemap").unwrap();
    pagemap
        .read_exact_at(&mut raw, (base / 4096 * 8) as u64)
        .unwrap();
    raw.chunks_exact(8)
        .map(|entry| u64::from_le_bytes(entry.try_into().unwrap()) >> 63 == 1)
        .collect()
}

/// Panics unless `test` names exactly one test of this test binary (as `--exact` takes
/// it): a child run with a filter that matches nothing runs no test and exits 0.
pub fn assert_one_test_named(test: &str) {
    let exe = std::env::current_exe().unwrap();
    let listed = Command::new(&exe)
        .args(["--list", "--exact", test])
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&listed.stdout);
    let tests: Vec<&str> = listed
        .lines()
        .filter_map(|line| line.strip_suffix(": test"))
        .collect();
    assert_eq!(
        tests,
        [test],
        "no single test named {test} in {}",
        exe.display()
    );
}

/// The command that runs the test named `test` of this test binary, alone, in a child
/// process with `HYPEROFFLOAD_CHILD=1` (`test` checked by `assert_one_test_named`).
pub fn child_test_command(test: &str) -> Command {
    assert_one_test_named(test);
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env("HYPEROFFLOAD_CHILD", "1");
    command
}

/// Runs the test named `test` of this test binary in a child process with
/// `HYPEROFFLOAD_CHILD=1`, and returns its exit status. Fails if it runs past `limit`
/// (a hang is a bug, never an outcome to wait out).
pub fn run_child(test: &str, env: &[(&str, String)], limit: Duration) -> std::process::ExitStatus {
    let mut command = child_test_command(test);
    for (key, value) in env {
        command.env(key, value);
    }
    let mut child = command.spawn().unwrap();
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("child test {test} hung for {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// For a test whose body runs in a child process of its own: in the test's own process,
/// runs `test` as a child (see `run_child`), checks that it passed, and returns false;
/// in that child, returns true (run the body).
pub fn in_child_process(test: &str, limit: Duration) -> bool {
    if is_child() {
        return true;
    }
    let status = run_child(test, &[], limit);
    assert!(status.success(), "{test} failed in its child: {status}");
    false
}

pub fn is_child() -> bool {
    std::env::var("HYPEROFFLOAD_CHILD").as_deref() == Ok("1")
}

/// Resident bytes of the mappings of process `pid` that start at one of `bases`.
pub fn process_mappings_rss(pid: u32, ranges: &[(usize, usize)]) -> u64 {
    let Ok(smaps) = std::fs::read_to_string(format!("/proc/{pid}/smaps")) else {
        return 0;
    };
    let mut total = 0;
    let mut counted = false;
    for line in smaps.lines() {
        if line.starts_with(|c: char| c.is_ascii_hexdigit()) && line.contains('-') {
            let start = line.split('-').next().unwrap_or("");
            // A region may be several mappings (zero copy maps each block on its own):
            // every mapping that starts inside one counts.
            counted = usize::from_str_radix(start, 16).is_ok_and(|start| {
                ranges
                    .iter()
                    .any(|&(base, len)| (base..base + len).contains(&start))
            });
            continue;
        }
        if counted {
            if let Some(rest) = line.strip_prefix("Rss:") {
                let kb: u64 = rest
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse()
                    .unwrap_or(0);
                total += kb * 1024;
            }
        }
    }
    total
}

fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return true;
    };
    tasks.flatten().all(|task| {
        std::fs::read_to_string(task.path().join("stat"))
            .map(|stat| {
                // The state follows the parenthesised command name.
                stat.rsplit_once(") ")
                    .is_some_and(|(_, rest)| rest.starts_with('T') || rest.starts_with('t'))
            })
            .unwrap_or(true)
    })
}

/// Runs child test `test` and samples the resident bytes of the regions it announces
/// (hex base addresses, one per line, in the file named by HYPEROFFLOAD_REGIONS_FILE)
/// with the whole child stopped (SIGSTOP), so a sample is an exact snapshot rather than
/// a walk that races the fault service. `env` is added to the child's environment.
/// Returns the largest sample and their count.
pub fn run_child_sampling_rss(
    test: &str,
    limit: Duration,
    env: &[(&str, &std::ffi::OsStr)],
) -> (u64, u64) {
    let dir = TempDir::new("rss-sampling");
    let list = dir.path("regions");
    std::fs::write(&list, "").unwrap();
    let mut command = child_test_command(test);
    command
        .env("HYPEROFFLOAD_REGIONS_FILE", &list)
        .envs(env.iter().copied());
    let mut child = command.spawn().unwrap();
    let pid = child.id();
    let deadline = Instant::now() + limit;
    let (mut max, mut samples) = (0u64, 0u64);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "child test {test} failed: {status}");
            return (max, samples);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("child test {test} hung for {limit:?}");
        }
        // Stopped first, then the list read: the regions it names are the ones mapped
        // now (a region is announced after it is mapped and retired before it goes).
        // SAFETY: signals our own child process.
        unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
        let stop_deadline = Instant::now() + Duration::from_secs(2);
        while !all_threads_stopped(pid) && Instant::now() < stop_deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
        if all_threads_stopped(pid) {
            let regions = live_regions(&std::fs::read_to_string(&list).unwrap());
            if !regions.is_empty() {
                max = max.max(process_mappings_rss(pid, &regions));
                samples += 1;
            }
        }
        // SAFETY: as above.
        unsafe { libc::kill(pid as i32, libc::SIGCONT) };
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The regions a list written by `announce_region` and `retire_region` names as live:
/// (base, length).
fn live_regions(list: &str) -> Vec<(usize, usize)> {
    let mut live = Vec::new();
    for line in list.lines() {
        if let Some(base) = line.trim().strip_prefix('-') {
            let base = usize::from_str_radix(base, 16).ok();
            live.retain(|&(b, _)| Some(b) != base);
        } else if let Some((base, len)) = line.trim().split_once(' ') {
            if let (Ok(base), Ok(len)) = (
                usize::from_str_radix(base, 16),
                usize::from_str_radix(len, 16),
            ) {
                live.push((base, len));
            }
        }
    }
    live
}

/// In a child started by `run_child_sampling_rss`, announces a region to sample (after
/// it is mapped).
pub fn announce_region(base: usize, len: usize) {
    append_to_region_list(&format!("{base:x} {len:x}"));
}

/// In such a child, stops sampling a region (before it is dropped): its addresses may
/// hold other mappings afterwards.
pub fn retire_region(base: usize) {
    append_to_region_list(&format!("-{base:x}"));
}

fn append_to_region_list(line: &str) {
    if let Some(list) = std::env::var_os("HYPEROFFLOAD_REGIONS_FILE") {
        let mut file = std::fs::OpenOptions::new().append(true).open(list).unwrap();
        writeln!(file, "{line}").unwrap();
    }
}
/// The file name of the small real model the tests use.
pub const TEST_MODEL_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The small real model: `$HYPEROFFLOAD_TEST_MODEL`, else the cache that
/// `tools/fetch-model.sh` fills. If it is missing the test fails and says how to get
/// it, unless `HYPEROFFLOAD_ALLOW_SKIP=1`: then it says why it skips and returns `None`.
pub fn test_model() -> Option<PathBuf> {
    let path = match std::env::var_os("HYPEROFFLOAD_TEST_MODEL") {
        Some(path) => PathBuf::from(path),
        None => {
            let cache = std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
                .unwrap_or_else(|| PathBuf::from(".cache"));
            cache.join("hyperoffload/models").join(TEST_MODEL_NAME)
        }
    };
    if path.is_file() {
        return Some(path);
    }
    let why = format!(
        "test model {} not found: run tools/fetch-model.sh (or set HYPEROFFLOAD_TEST_MODEL)",
        path.display()
    );
    if std::env::var("HYPEROFFLOAD_ALLOW_SKIP").as_deref() == Ok("1") {
        eprintln!("skipping: {why}");
        return None;
    }
    panic!("{why}");
}

/// A fresh output directory for a test named `name`, in the system's temporary
/// directory, unique to this process. (`CARGO_TARGET_TMPDIR`, which this looks up first,
/// is set for the build, not when the test runs.)
pub fn out_dir(name: &str) -> PathBuf {
    let base = std::env::var_os("CARGO_TARGET_TMPDIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A pager mapping 2 MiB blocks from frames (zero copy) within `budget`, or None if the
/// test may skip; fails if zero copy was refused, with the reason.
pub fn zero_copy_pager(budget: u64) -> Option<Pager> {
    let pager = pager_or_skip(
        Pager::builder()
            .budget(budget)
            .block_size(2 << 20)
            .zero_copy(true),
    )?;
    assert!(
        pager.stats().zero_copy,
        "{:?}",
        pager.stats().zero_copy_refused
    );
    Some(pager)
}

/// Whether process `pid` has ended (gone, or a zombie nobody reaped yet).
pub fn process_ended(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // The state follows the command name in parentheses.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
    }
}
