//! What the program (or anything else in the process) does to a region's memory through
//! the kernel, behind the pager's back: locking it, dropping its pages, asking for every
//! future mapping to be locked. The region must keep serving the file's bytes within the
//! budget, never hang, never stop the program.
//!
//! Each runs in a child process: locking is per process, and a failure here is an abort
//! or a thread faulting forever, which a child turns into a failed test.

mod common;

use std::time::Duration;

use common::*;
use hyperoffload::{MapOptions, Pager};

const LEN: u64 = 24 << 20;
const BUDGET: u64 = 8 << 20;

fn in_child(test: &str) -> bool {
    if is_child() {
        return true;
    }
    for zero_copy in ["0", "1"] {
        let status = run_child(
            test,
            &[("REGION_ZERO_COPY", zero_copy.to_string())],
            Duration::from_secs(60),
        );
        assert!(
            status.success(),
            "{test} failed in its child (zero copy {zero_copy}): {status}"
        );
    }
    false
}

fn pager() -> Option<Pager> {
    let zero_copy = std::env::var("REGION_ZERO_COPY").as_deref() == Ok("1");
    pager_or_skip(
        Pager::builder()
            .budget(BUDGET)
            .block_size(2 << 20)
            .zero_copy(zero_copy),
    )
}

/// Asserts that `bytes`, read at file offset `start`, are the file's.
fn assert_file_bytes(bytes: &[u8], start: u64) {
    for (at, &byte) in bytes.iter().enumerate().step_by(509) {
        let offset = start + at as u64;
        assert_eq!(byte, pattern_byte(offset), "offset {offset}");
    }
}

/// The kernel's mlock of a region faults it all in and marks it locked, which plain
/// MADV_DONTNEED refuses: the first eviction failed and the service stopped the program.
#[test]
fn a_region_locked_through_the_kernel_stays_within_the_budget() {
    if !in_child("a_region_locked_through_the_kernel_stays_within_the_budget") {
        return;
    }
    let dir = TempDir::new("kernel-mlock");
    let path = dir.path("model.bin");
    pattern_file(&path, LEN);
    let Some(pager) = pager() else { return };
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    // An unaligned start, as a program may pass: the kernel rounds it down.
    // SAFETY: locks (and so faults in) the live region's pages; contents are unchanged.
    let rc = unsafe { libc::mlock(region.as_ptr().add(100).cast(), region.len() - 100) };
    assert_eq!(rc, 0, "mlock: {}", std::io::Error::last_os_error());
    for _ in 0..2 {
        assert_file_bytes(region.as_slice(), 0);
    }
    let stats = pager.stats();
    assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
    assert!(stats.evictions > 0, "the scans evicted nothing: {stats:?}");
    assert!(
        stats.peak_resident_bytes <= BUDGET,
        "peak resident {} over the budget {BUDGET}",
        stats.peak_resident_bytes
    );
}

/// Pages dropped through the kernel while the pager counts them resident: a fault on
/// them was answered with a wake-up only (as for a fault racing an install), and the
/// thread faulted again forever.
#[test]
fn pages_dropped_behind_the_pagers_back_are_read_again() {
    if !in_child("pages_dropped_behind_the_pagers_back_are_read_again") {
        return;
    }
    let dir = TempDir::new("dropped-behind");
    let path = dir.path("model.bin");
    pattern_file(&path, LEN);
    let Some(pager) = pager() else { return };
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    let block = 3u64 << 20;
    let base = region.as_ptr() as usize;
    assert_file_bytes(
        &region.as_slice()[block as usize..(block + (1 << 20)) as usize],
        block,
    );
    // SAFETY: drops pages of the live region; their bytes are the file's and the pager
    // is expected to read them again.
    let rc = unsafe {
        libc::madvise(
            (base + block as usize) as *mut libc::c_void,
            64 << 10,
            libc::MADV_DONTNEED,
        )
    };
    assert_eq!(rc, 0, "madvise: {}", std::io::Error::last_os_error());
    assert!(
        pages_present(base + block as usize, 64 << 10)
            .iter()
            .all(|&present| !present),
        "the pages were not dropped"
    );
    assert_file_bytes(
        &region.as_slice()[block as usize..(block + (2 << 20)) as usize],
        block,
    );
    assert_file_bytes(region.as_slice(), 0);
}

/// Under mlockall(MCL_FUTURE) the kernel fills every new mapping as it creates it: the
/// region's reservation got zero pages before it was registered, and the program read
/// zeros where the file has its bytes, with no fault ever reaching the pager.
#[test]
fn a_region_mapped_under_mlockall_future_serves_the_files_bytes() {
    if !in_child("a_region_mapped_under_mlockall_future_serves_the_files_bytes") {
        return;
    }
    let dir = TempDir::new("mlockall-future");
    let path = dir.path("model.bin");
    pattern_file(&path, LEN);
    let Some(pager) = pager() else { return };
    // SAFETY: locks this child's memory; it exits after the test.
    let rc = unsafe { libc::mlockall(libc::MCL_CURRENT | libc::MCL_FUTURE) };
    assert_eq!(rc, 0, "mlockall: {}", std::io::Error::last_os_error());
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    for _ in 0..2 {
        assert_file_bytes(region.as_slice(), 0);
    }
    let stats = pager.stats();
    assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
    assert!(stats.faults > 0, "no fault reached the pager: {stats:?}");
    assert!(
        stats.peak_resident_bytes <= BUDGET,
        "peak resident {} over the budget {BUDGET}",
        stats.peak_resident_bytes
    );
}
