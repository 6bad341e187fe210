//! Issue 7, stress: 16 threads mixing sequential, random and cyclic reads over a file 8x
//! the budget for a bounded time (90 s in CI; HYPEROFFLOAD_STRESS_SECONDS to run longer).
//! Every byte is checked, resident bytes sampled from the stopped child never exceed the
//! budget, and a watchdog fails the run if any single 64 KiB read stalls. Run twice:
//! copying 4 KiB blocks in, and mapping 2 MiB blocks from frames (zero copy), where
//! installs and evictions replace mappings under the faulting threads.

#![allow(
    clippy::too_many_lines,
    reason = "an end-to-end scenario reads best top to bottom, as its steps run"
)]

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use hyperoffload::{MapOptions, Pager};

const BUDGET: u64 = 16 << 20;
const FILE_LEN: u64 = 8 * BUDGET;
/// With zero copy: 16 blocks of 2 MiB, one per thread, the file 4x the budget.
const ZERO_COPY_BUDGET: u64 = 32 << 20;
const THREADS: usize = 16;
const CHUNK: u64 = 64 << 10;
/// Longest any one chunk read may take before the run is declared hung.
const STALL: Duration = Duration::from_secs(10);

fn seconds() -> u64 {
    std::env::var("HYPEROFFLOAD_STRESS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(90)
}

#[derive(Clone, Copy, Debug)]
enum Mode {
    /// Forward from a thread-specific start, wrapping.
    Sequential,
    /// Random 64 KiB-sized ranges at random (unaligned) offsets.
    Random,
    /// The whole file from the start, over and over.
    Cyclic,
}

fn check_chunk(bytes: &[u8], start: u64, thread: usize) {
    let end = (start + CHUNK).min(FILE_LEN);
    for offset in start..end {
        let byte = bytes[offset as usize];
        if byte != pattern_byte(offset) {
            eprintln!(
                "thread {thread}: wrong byte at {offset:#x}: {byte:#x}, expected {:#x}",
                pattern_byte(offset)
            );
            std::process::abort();
        }
    }
}

fn zero_copy() -> bool {
    std::env::var("STRESS_ZERO_COPY").is_ok_and(|v| v == "1")
}

fn budget() -> u64 {
    if zero_copy() {
        ZERO_COPY_BUDGET
    } else {
        BUDGET
    }
}

fn stress_child() {
    let path = std::env::var("TEST_FILE").unwrap();
    let builder = match zero_copy() {
        true => Pager::builder()
            .budget(ZERO_COPY_BUDGET)
            .block_size(2 << 20)
            .zero_copy(true),
        false => Pager::builder().budget(BUDGET),
    };
    let pager = pager_or_skip(builder).unwrap();
    assert_eq!(pager.stats().zero_copy, zero_copy());
    let region = Arc::new(
        pager
            .map_file(path.as_ref(), MapOptions::default())
            .unwrap(),
    );
    announce_region(region.as_ptr() as usize, region.map_len());
    let start = Instant::now();
    let run_for = Duration::from_secs(seconds());
    // Milliseconds since `start` at which each thread last finished a chunk.
    let progress: Arc<Vec<AtomicU64>> = Arc::new((0..THREADS).map(|_| AtomicU64::new(0)).collect());
    let chunks = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let (progress, done) = (progress.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(100));
                let now = start.elapsed().as_millis() as u64;
                for (thread, last) in progress.iter().enumerate() {
                    let last = last.load(Ordering::Relaxed);
                    if now.saturating_sub(last) > STALL.as_millis() as u64 {
                        // Raw write: a stalled thread may hold stderr's lock.
                        let message = format!(
                            "watchdog: thread {thread} ({:?}) made no progress for {} ms\n",
                            mode_of(thread),
                            now - last
                        );
                        // SAFETY: writes a live buffer to fd 2.
                        unsafe { libc::write(2, message.as_ptr().cast(), message.len()) };
                        std::process::abort();
                    }
                }
            }
        })
    };
    let threads: Vec<_> = (0..THREADS)
        .map(|thread| {
            let (region, progress, chunks) = (region.clone(), progress.clone(), chunks.clone());
            std::thread::spawn(move || {
                let bytes = region.as_slice();
                let mut x = 0x9E37_79B9_u64 ^ (thread as u64 * 0x1234_5671);
                let mut at = match mode_of(thread) {
                    Mode::Sequential => FILE_LEN / THREADS as u64 * thread as u64,
                    _ => 0,
                };
                while start.elapsed() < run_for {
                    let chunk_start = match mode_of(thread) {
                        Mode::Random => {
                            x = x
                                .wrapping_mul(6364136223846793005)
                                .wrapping_add(1442695040888963407);
                            (x >> 20) % FILE_LEN
                        }
                        Mode::Sequential | Mode::Cyclic => {
                            let here = at;
                            at = (at + CHUNK) % FILE_LEN;
                            here
                        }
                    };
                    check_chunk(bytes, chunk_start, thread);
                    progress[thread].store(start.elapsed().as_millis() as u64, Ordering::Relaxed);
                    chunks.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    done.store(true, Ordering::Relaxed);
    watchdog.join().unwrap();
    let stats = pager.stats();
    assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
    eprintln!(
        "stress: {} chunks of 64 KiB checked in {:?}; {stats:?}",
        chunks.load(Ordering::Relaxed),
        start.elapsed()
    );
    assert_eq!(stats.read_errors, 0);
    assert!(stats.peak_resident_bytes <= budget(), "{stats:?}");
    // The run really cycled through a file 8x the budget several times over.
    assert!(stats.bytes_read > 2 * FILE_LEN, "{stats:?}");
    assert!(stats.evictions > 0, "{stats:?}");
}

fn mode_of(thread: usize) -> Mode {
    match thread % 3 {
        0 => Mode::Sequential,
        1 => Mode::Random,
        _ => Mode::Cyclic,
    }
}

#[test]
fn sixteen_threads_mixed_reads_over_eight_times_the_budget() {
    stress(
        "sixteen_threads_mixed_reads_over_eight_times_the_budget",
        false,
    );
}

#[test]
fn sixteen_threads_mixed_reads_with_zero_copy() {
    stress("sixteen_threads_mixed_reads_with_zero_copy", true);
}

fn stress(test: &str, zero_copy: bool) {
    if is_child() {
        stress_child();
        return;
    }
    let dir = TempDir::new(test);
    let path = dir.path("f.bin");
    pattern_file(&path, FILE_LEN);
    // The child reads its file from TEST_FILE and its mode from STRESS_ZERO_COPY. The
    // two tests run side by side (each child's environment is its own).
    let started = Instant::now();
    let mode = if zero_copy { "1" } else { "0" };
    let (max_rss, samples) = run_child_sampling_rss(
        test,
        Duration::from_secs(seconds() + 60),
        &[
            ("TEST_FILE", path.as_os_str()),
            ("STRESS_ZERO_COPY", mode.as_ref()),
        ],
    );
    eprintln!(
        "stress ({test}): {samples} residency samples, largest {max_rss} bytes, {:?}",
        started.elapsed()
    );
    let budget = if zero_copy { ZERO_COPY_BUDGET } else { BUDGET };
    assert!(samples >= 10, "only {samples} samples");
    assert!(max_rss > 0, "nothing was ever resident");
    assert!(
        max_rss <= budget,
        "resident {max_rss} bytes over the budget of {budget}"
    );
}
