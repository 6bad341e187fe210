//! A pager that serves forks (`PagerBuilder::serve_forks`): a child of `fork` reads the
//! file's bytes everywhere in the region, pages its parent touched and pages it did
//! not, served by the parent's service from the same blocks and within the same
//! budget; a block read for one process is not read again for the other.
//!
//! Each test body runs in a process of its own (`in_child_process`): it forks, and a
//! fork of the multi-threaded test harness is best kept away from the other tests.

#![allow(
    clippy::too_many_lines,
    reason = "an end-to-end scenario reads best top to bottom, as its steps run"
)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use hyperoffload::policy::{EvictionKind, PrefetchKind};
use hyperoffload::{MapOptions, Pager};

const BLOCK: u64 = 64 << 10;
const FILE: u64 = 8 << 20;
const BUDGET: u64 = 2 << 20;

/// Blocks copied in (`UFFDIO_COPY`).
fn forking_pager(budget: u64) -> Option<Pager> {
    forking_pager_of(budget, BLOCK, false)
}

/// With `in_place`, blocks read straight into the regions' files and mapped with
/// `UFFDIO_CONTINUE` (as `hyperoffload run` does), else copied in.
fn forking_pager_of(budget: u64, block: u64, in_place: bool) -> Option<Pager> {
    let pager = pager_or_skip(
        Pager::builder()
            .budget(budget)
            .block_size(block)
            .zero_copy(in_place)
            .serve_forks(true)
            .prefetch(PrefetchKind::None.build())
            .eviction(EvictionKind::Lru.build()),
    )?;
    let stats = pager.stats();
    assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
    assert!(
        pager.serves_forks(),
        "forks not served: {:?}",
        stats.forks_refused
    );
    assert!(stats.serve_forks && !stats.zero_copy);
    assert_eq!(
        stats.zero_copy_refused.is_none(),
        in_place,
        "read in place: {:?}",
        stats.zero_copy_refused
    );
    Some(pager)
}

/// FNV-1a over `bytes`, page by page in `order`: allocation-free, fit for a forked
/// child of a multi-threaded process.
fn digest(bytes: &[u8], order: impl Iterator<Item = usize>) -> u64 {
    let page = 4096;
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for index in order {
        for &byte in &bytes[index * page..(index + 1) * page] {
            hash = (hash ^ byte as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    hash
}

/// Forks a child that computes `digest` of the region in `order` and exits with 0
/// when it equals `expected`, 1 otherwise; returns its pid.
fn fork_reader(bytes: &[u8], pages: usize, reverse: bool, expected: u64) -> i32 {
    // SAFETY: the child only reads memory, computes, and leaves with _exit: nothing
    // that needs another thread of the parent (no allocation, no locks).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let got = if reverse {
            digest(bytes, (0..pages).rev())
        } else {
            digest(bytes, 0..pages)
        };
        // SAFETY: ends the child without running the parent's destructors.
        unsafe { libc::_exit(i32::from(got != expected)) };
    }
    pid
}

fn wait_exit(pid: i32) -> i32 {
    let mut status = 0;
    // SAFETY: waits for our own child.
    let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(waited, pid);
    assert!(
        libc::WIFEXITED(status),
        "child {pid} did not exit (status {status:#x}: killed by signal {})",
        libc::WTERMSIG(status)
    );
    libc::WEXITSTATUS(status)
}

/// The file's digest in `order`, from a plain read of the file.
fn file_digest(path: &std::path::Path, reverse: bool) -> u64 {
    let bytes = std::fs::read(path).unwrap();
    let pages = bytes.len() / 4096;
    if reverse {
        digest(&bytes, (0..pages).rev())
    } else {
        digest(&bytes, 0..pages)
    }
}

#[test]
fn a_forked_child_reads_touched_and_untouched_pages_within_the_budget() {
    if !in_child_process(
        "a_forked_child_reads_touched_and_untouched_pages_within_the_budget",
        Duration::from_secs(60),
    ) {
        return;
    }
    let dir = TempDir::new("region-fork");
    let path = dir.path("model.bin");
    pattern_file(&path, FILE);
    let Some(pager) = forking_pager(BUDGET) else {
        return;
    };
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    let bytes = region.as_slice();
    let pages = (FILE / 4096) as usize;
    // The parent reads the last quarter: resident when the child starts.
    for page in (3 * pages / 4)..pages {
        assert_eq!(bytes[page * 4096], pattern_byte(page as u64 * 4096));
    }
    let before = pager.stats();
    assert!(before.resident_bytes <= BUDGET);
    let expected = file_digest(&path, true);
    // Backwards: the blocks the parent left resident first, then the rest.
    let child = fork_reader(bytes, pages, true, expected);
    assert_eq!(
        wait_exit(child),
        0,
        "the child saw other bytes than the file's"
    );
    let stats = pager.stats();
    assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
    assert_eq!(stats.forked_children, 1);
    assert!(
        stats.child_faults > 0,
        "the child's faults reached the service"
    );
    assert!(
        stats.peak_resident_bytes <= BUDGET,
        "peak {} over the budget",
        stats.peak_resident_bytes
    );
    // The child read the three quarters the parent had not, and at most what the
    // budget could not keep of the last one.
    let child_read = stats.bytes_read - before.bytes_read;
    assert!(
        child_read <= FILE - FILE / 4 + BUDGET,
        "the child read {child_read} bytes"
    );
    // The parent still reads the file's bytes after the child's evictions.
    for page in 0..pages {
        assert_eq!(bytes[page * 4096 + 7], pattern_byte(page as u64 * 4096 + 7));
    }
    // The child is gone: its userfaultfd is closed at the next publication.
    let deadline = Instant::now() + Duration::from_secs(5);
    while pager.stats().live_children > 0 {
        assert!(
            Instant::now() < deadline,
            "the exited child is still served"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A pager serving forks from the first fork on (`serve_forks_at_fork`, as
/// `hyperoffload run` does by default) maps blocks from frames while the process is
/// alone; the first fork makes the region file-shaped: the child reads the file's
/// bytes on every page the program still maps (those resident from frames and the
/// rest), served by the parent's service within the budget, and the part the program
/// unmapped, where something else is mapped now, is left alone in both processes.
#[test]
fn a_region_served_from_frames_is_made_inheritable_at_the_first_fork() {
    if !in_child_process(
        "a_region_served_from_frames_is_made_inheritable_at_the_first_fork",
        Duration::from_secs(60),
    ) {
        return;
    }
    const HUGE: u64 = 2 << 20;
    let file = (32 << 20) + 4321;
    let budget = 8 << 20;
    let dir = TempDir::new("region-fork-at-fork");
    let path = dir.path("model.bin");
    pattern_file(&path, file);
    let Some(pager) = pager_or_skip(
        Pager::builder()
            .budget(budget)
            .block_size(HUGE)
            .zero_copy(true)
            .serve_forks_at_fork(true)
            .prefetch(PrefetchKind::None.build())
            .eviction(EvictionKind::Lru.build()),
    ) else {
        return;
    };
    let before = pager.stats();
    assert!(
        before.zero_copy && !before.serve_forks && !pager.serves_forks(),
        "frames until the first fork: {:?} {:?}",
        before.zero_copy_refused,
        before.forks_refused
    );
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    let bytes = region.as_slice();
    let pages = (file / 4096) as usize;
    // A hole that cuts blocks, with a page of something else mapped in it.
    let hole = (10 << 20) + 3 * 4096..(13 << 20) + 4096;
    region.unmap_part(hole.clone()).unwrap();
    let other = region.as_ptr() as usize + hole.start as usize;
    // SAFETY: a fixed anonymous page where the region was just unmapped.
    let mapped = unsafe {
        libc::mmap(
            other as *mut libc::c_void,
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    assert_eq!(mapped as usize, other);
    // SAFETY: the page just mapped, read-write.
    unsafe { *(other as *mut u8) = 0xa5 };
    let in_hole = |page: &usize| hole.contains(&(*page as u64 * 4096));
    // The parent reads the first quarter: in frames when the fork comes.
    for page in (0..pages / 4).filter(|page| !in_hole(page)) {
        assert_eq!(bytes[page * 4096], pattern_byte(page as u64 * 4096));
    }
    let all = std::fs::read(&path).unwrap();
    let expected = digest(&all, (0..pages).filter(|page| !in_hole(page)));
    // SAFETY: the child reads memory, computes and leaves with _exit (no allocation).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let got = digest(bytes, (0..pages).filter(|page| !in_hole(page)));
        // SAFETY: the child's own copy of the page mapped in the hole.
        let other_kept = unsafe { *(other as *const u8) } == 0xa5;
        // SAFETY: ends the child without running the parent's destructors.
        unsafe { libc::_exit(i32::from(got != expected) + 2 * i32::from(!other_kept)) };
    }
    assert_eq!(
        wait_exit(pid),
        0,
        "1: the child saw other bytes than the file's; 2: the page in the hole was moved"
    );
    let after = pager.stats();
    assert!(
        pager.serves_forks() && after.serve_forks,
        "made inheritable"
    );
    assert_eq!(after.forked_children, 1);
    assert!(
        after.child_faults > 0,
        "the child's faults reached the service"
    );
    assert!(
        after.peak_resident_bytes <= budget,
        "peak {} over the budget",
        after.peak_resident_bytes
    );
    // The parent reads the file's bytes after it all, and its page in the hole is its own.
    let again = digest(bytes, (0..pages).filter(|page| !in_hole(page)));
    assert_eq!(
        again, expected,
        "the parent saw other bytes than the file's"
    );
    // SAFETY: the page mapped in the hole above.
    assert_eq!(unsafe { *(other as *const u8) }, 0xa5);
}

/// The program drops (unmaps) the region while a forked child still maps it: the
/// service fills the region's file first, and the child, whose range is registered for
/// minor faults (blocks read in place), reads the file's bytes on every page after,
/// mapped by the service (never SIGBUS, never zeros). With 64 KiB blocks (a small-page
/// file) and 2 MiB ones (a huge-page file).
fn child_reads_after_the_region_is_dropped(test: &str, block: u64) {
    if !in_child_process(test, Duration::from_secs(60)) {
        return;
    }
    let dir = TempDir::new("region-fork-dropped");
    let path = dir.path("model.bin");
    pattern_file(&path, FILE);
    let budget = 2 * block.max(BUDGET);
    let Some(pager) = forking_pager_of(budget, block, true) else {
        return;
    };
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    let bytes = region.as_slice();
    let pages = (FILE / 4096) as usize;
    for page in (pages / 2)..pages {
        assert_eq!(bytes[page * 4096], pattern_byte(page as u64 * 4096));
    }
    let expected = file_digest(&path, false);
    let mut go = [0i32; 2];
    // SAFETY: a pipe into an array of two descriptors.
    assert_eq!(unsafe { libc::pipe(go.as_mut_ptr()) }, 0);
    let (start, len) = (bytes.as_ptr(), bytes.len());
    // SAFETY: the child waits on the pipe, reads memory, computes and leaves with
    // _exit: nothing that needs another thread of the parent.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let mut byte = 0u8;
        // SAFETY: reads one byte from the pipe into a local.
        unsafe { libc::read(go[0], (&mut byte as *mut u8).cast(), 1) };
        // SAFETY: the child's copy of the region, which the parent's unmap left mapped
        // here.
        let mine = unsafe { std::slice::from_raw_parts(start, len) };
        let got = digest(mine, 0..pages);
        // SAFETY: ends the child without running the parent's destructors.
        unsafe { libc::_exit(i32::from(got != expected)) };
    }
    drop(region);
    let stats = pager.stats();
    assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
    assert!(
        stats.child_fill_bytes > 0,
        "the region was filled for the child before it was dropped"
    );
    // SAFETY: writes one byte into the pipe.
    assert_eq!(unsafe { libc::write(go[1], [1u8].as_ptr().cast(), 1) }, 1);
    assert_eq!(
        wait_exit(pid),
        0,
        "the child saw other bytes than the file's after the region was dropped"
    );
}

#[test]
fn a_forked_child_reads_the_files_bytes_after_the_region_is_dropped() {
    child_reads_after_the_region_is_dropped(
        "a_forked_child_reads_the_files_bytes_after_the_region_is_dropped",
        BLOCK,
    );
}

#[test]
fn a_forked_child_reads_the_files_bytes_after_a_region_of_huge_pages_is_dropped() {
    child_reads_after_the_region_is_dropped(
        "a_forked_child_reads_the_files_bytes_after_a_region_of_huge_pages_is_dropped",
        2 << 20,
    );
}

#[test]
fn two_forked_readers_share_one_copy_and_one_budget() {
    if !in_child_process(
        "two_forked_readers_share_one_copy_and_one_budget",
        Duration::from_secs(60),
    ) {
        return;
    }
    let dir = TempDir::new("region-fork-two");
    let path = dir.path("model.bin");
    pattern_file(&path, FILE);
    // Room for the whole file: two readers reading it once each share every block.
    let Some(pager) = forking_pager(FILE + BLOCK) else {
        return;
    };
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    let bytes = region.as_slice();
    let pages = (FILE / 4096) as usize;
    let expected = file_digest(&path, false);
    let first = fork_reader(bytes, pages, false, expected);
    let second = fork_reader(bytes, pages, false, expected);
    assert_eq!(wait_exit(first), 0);
    assert_eq!(wait_exit(second), 0);
    let stats = pager.stats();
    assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
    assert_eq!(stats.forked_children, 2);
    assert!(
        stats.bytes_read <= FILE + FILE / 5,
        "two readers read {} bytes of a {FILE}-byte file",
        stats.bytes_read
    );
    assert!(stats.peak_resident_bytes <= FILE + BLOCK);
}

/// Writes `text` and `n` in decimal to a new file at `path`, without allocating (a
/// forked child of a multi-threaded process).
fn write_verdict(path: &std::ffi::CStr, text: &[u8], mut n: u64) {
    let mut buffer = [0u8; 64];
    buffer[..text.len()].copy_from_slice(text);
    let mut digits = [0u8; 20];
    let mut count = 0;
    loop {
        digits[count] = b'0' + (n % 10) as u8;
        count += 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    for i in 0..count {
        buffer[text.len() + i] = digits[count - 1 - i];
    }
    // SAFETY: plain system calls on a NUL-terminated path and a buffer of ours.
    unsafe {
        let fd = libc::open(
            path.as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
            0o600,
        );
        if fd >= 0 {
            libc::write(fd, buffer.as_ptr().cast(), text.len() + count);
            libc::close(fd);
        }
    }
}

const OUTLIVE_TEST: &str =
    "a_forked_child_that_outlives_its_pager_reads_the_files_bytes_on_every_page";

#[test]
fn a_forked_child_that_outlives_its_pager_reads_the_files_bytes_on_every_page() {
    if !is_child() {
        let dir = TempDir::new("region-fork-outlive");
        let verdict = dir.path("verdict");
        let env = [("FORK_VERDICT", verdict.display().to_string())];
        let status = run_child(OUTLIVE_TEST, &env, Duration::from_secs(60));
        assert!(
            status.success(),
            "{OUTLIVE_TEST} failed in its child: {status}"
        );
        // The reader outlives the process the pager ran in: wait for its verdict.
        let deadline = Instant::now() + Duration::from_secs(30);
        let text = loop {
            if let Ok(text) = std::fs::read_to_string(&verdict) {
                if !text.is_empty() {
                    break text;
                }
            }
            assert!(Instant::now() < deadline, "no verdict from the reader");
            std::thread::sleep(Duration::from_millis(50));
        };
        if text.starts_with("skipped") {
            return; // pager_or_skip said why (only with HYPEROFFLOAD_ALLOW_SKIP=1)
        }
        assert_eq!(text, "pages differing 0", "read after the pager was gone");
        return;
    }
    let verdict = std::ffi::CString::new(std::env::var("FORK_VERDICT").unwrap()).unwrap();
    let dir = TempDir::new("region-fork-outlive-model");
    let path = dir.path("model.bin");
    pattern_file(&path, FILE);
    let Some(pager) = forking_pager(BUDGET) else {
        write_verdict(&verdict, b"skipped ", 0);
        return;
    };
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    let bytes = region.as_slice();
    let pages = (FILE / 4096) as usize;
    for page in (3 * pages / 4)..pages {
        assert_eq!(bytes[page * 4096], pattern_byte(page as u64 * 4096));
    }
    // SAFETY: getpid has no preconditions.
    let parent = unsafe { libc::getpid() };
    // SAFETY: the child waits, reads memory, computes and writes with plain system
    // calls, and leaves with _exit: nothing that needs another thread of the parent.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: getppid has no preconditions.
        while unsafe { libc::getppid() } == parent {
            // SAFETY: usleep has no preconditions.
            unsafe { libc::usleep(10_000) };
        }
        let differing = (0..pages)
            .filter(|&page| {
                (0..4096).any(|i| {
                    let offset = page * 4096 + i;
                    bytes[offset] != pattern_byte(offset as u64)
                })
            })
            .count();
        write_verdict(&verdict, b"pages differing ", differing as u64);
        // SAFETY: ends the child without running the parent's destructors.
        unsafe { libc::_exit(0) };
    }
    // As the shim's exit handler does: the process ends with the region still mapped.
    pager.before_exit();
    let stats = pager.stats();
    assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
    assert_eq!(stats.live_children, 1);
    assert!(
        stats.child_fill_bytes >= FILE - FILE / 4 - BUDGET && stats.child_fill_bytes <= FILE,
        "filled {} bytes",
        stats.child_fill_bytes
    );
    // The files are no longer read: the child's pages are all in its memory.
    let _ = std::fs::remove_dir_all(&dir.0);
    // SAFETY: ends this process at once (no destructor drops the region or the pager).
    unsafe { libc::_exit(0) };
}

#[test]
fn a_child_of_a_pager_that_does_not_serve_forks_is_told_so() {
    let Some(pager) = pager_or_skip(Pager::builder().budget(BUDGET).block_size(BLOCK)) else {
        return;
    };
    assert!(!pager.serves_forks());
    assert!(!pager.stats().serve_forks);
}
