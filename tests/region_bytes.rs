//! A region presents exactly the file's bytes, under a budget a quarter of the file,
//! with 8 threads reading sequentially, randomly and in cycles; resident memory sampled
//! from the kernel never exceeds the budget.

mod common;

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use hyperoffload::policy::{EvictionKind, PrefetchKind};
use hyperoffload::{MapOptions, Pager, Region};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

#[derive(Clone, Copy, Debug)]
enum Pattern {
    /// Scans everything once, from a thread-specific starting point, wrapping around.
    Sequential,
    /// Reads random ranges (crossing block and page boundaries).
    Random,
    /// Scans everything from the start, three times.
    Cyclic,
}

/// How a reader checks what it sees.
#[derive(Clone, Copy)]
enum Check {
    /// Every byte.
    Every,
    /// The first byte of each page, and every byte of the data ranges (sparse files).
    PagesAnd(&'static [Range<u64>]),
}

fn expected_byte(offset: u64, check: Check) -> u8 {
    match check {
        Check::Every => pattern_byte(offset),
        Check::PagesAnd(data) => {
            if data.iter().any(|range| range.contains(&offset)) {
                pattern_byte(offset)
            } else {
                0
            }
        }
    }
}

fn check_range(bytes: &[u8], range: Range<u64>, check: Check) {
    match check {
        Check::Every => {
            for offset in range {
                let got = bytes[offset as usize];
                assert_eq!(got, pattern_byte(offset), "byte at offset {offset}");
            }
        }
        Check::PagesAnd(_) => {
            let mut offset = range.start;
            while offset < range.end {
                let got = bytes[offset as usize];
                assert_eq!(got, expected_byte(offset, check), "byte at offset {offset}");
                offset = (offset / 4096 + 1) * 4096;
            }
        }
    }
}

fn reader(region: &Region, thread: u64, pattern: Pattern, check: Check, random_reads: u32) {
    let bytes = region.as_slice();
    let len = bytes.len() as u64;
    let chunk = 256 << 10;
    match pattern {
        Pattern::Sequential => {
            let start = (len / 8 * thread) & !4095;
            let mut offset = 0;
            while offset < len {
                let at = (start + offset) % len;
                let end = (at + chunk).min(len);
                check_range(bytes, at..end, check);
                offset += end - at;
            }
        }
        Pattern::Cyclic => {
            for _ in 0..3 {
                let mut at = 0;
                while at < len {
                    let end = (at + chunk).min(len);
                    check_range(bytes, at..end, check);
                    at = end;
                }
            }
        }
        Pattern::Random => {
            let mut rng = SmallRng::seed_from_u64(thread);
            for _ in 0..random_reads {
                let at = rng.gen_range(0..len);
                let end = (at + rng.gen_range(1..20_000)).min(len);
                check_range(bytes, at..end, check);
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn run_readers(
    file_len: u64,
    budget: u64,
    block: u64,
    patterns: &[Pattern],
    check: Check,
    random_reads: u32,
    path: &std::path::Path,
    zero_copy: bool,
    block_cuts: &[u64],
) {
    for prefetch in [PrefetchKind::Readahead, PrefetchKind::None] {
        let Some(pager) = pager_or_skip(
            Pager::builder()
                .budget(budget)
                .block_size(block)
                .zero_copy(zero_copy)
                .prefetch(prefetch.build())
                .eviction(EvictionKind::Fifo.build()),
        ) else {
            return;
        };
        let stats = pager.stats();
        assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
        assert_eq!(
            stats.zero_copy, zero_copy,
            "zero copy not as asked: {:?}",
            stats.zero_copy_refused
        );
        let options = MapOptions {
            block_cuts: block_cuts.to_vec(),
            ..Default::default()
        };
        let region = Arc::new(pager.map_file(path, options).unwrap());
        assert_eq!(region.len() as u64, file_len);
        announce_region(region.as_ptr() as usize, region.map_len());
        std::thread::scope(|scope| {
            for (thread, &pattern) in patterns.iter().enumerate() {
                let region = region.clone();
                scope.spawn(move || reader(&region, thread as u64, pattern, check, random_reads));
            }
        });
        let stats = pager.stats();
        assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
        eprintln!(
            "{prefetch:?} file {file_len} budget {budget}: {}",
            stats.to_json()
        );
        assert!(
            stats.peak_resident_bytes <= budget,
            "peak resident {} exceeds budget {budget}",
            stats.peak_resident_bytes
        );
        if zero_copy {
            // Frames are reused: their memory stays within the budget, plus one frame
            // for the file's short last block.
            assert!(
                stats.peak_frame_memory_bytes <= budget + block,
                "frames held {} for a budget of {budget}",
                stats.peak_frame_memory_bytes
            );
            assert!(
                stats.peak_frame_memory_bytes >= budget / 2,
                "{}",
                stats.to_json()
            );
        }
        assert!(stats.faults > 0 && stats.bytes_read >= file_len);
        if file_len > budget * 2 {
            assert!(stats.evictions > 0, "a file 4x the budget must evict");
        }
        assert!(mapping_rss(region.as_ptr() as usize, region.map_len()) <= budget);
        // Long enough for the sampling parent to see this region at least once (it
        // samples every 5 ms), however short the reading was.
        std::thread::sleep(std::time::Duration::from_millis(50));
        retire_region(region.as_ptr() as usize);
    }
}

const MIXED: [Pattern; 8] = [
    Pattern::Sequential,
    Pattern::Sequential,
    Pattern::Sequential,
    Pattern::Random,
    Pattern::Random,
    Pattern::Random,
    Pattern::Cyclic,
    Pattern::Cyclic,
];

/// Runs `body` in a child process while this process samples the child's region
/// residency with the child stopped; asserts the samples stay within `budget`.
fn sampled(test: &str, budget: u64, body: impl FnOnce()) {
    if is_child() {
        body();
        return;
    }
    let (max_rss, samples) = run_child_sampling_rss(test, Duration::from_secs(600), &[]);
    eprintln!("{test}: largest resident sample {max_rss} of budget {budget} ({samples} samples)");
    assert!(samples > 0, "no residency sample was taken");
    assert!(
        max_rss <= budget,
        "sampled resident {max_rss} exceeds budget {budget}"
    );
}

#[test]
fn awkward_size_file_with_a_quarter_budget() {
    let len = (48 << 20) + 4097;
    sampled(
        "awkward_size_file_with_a_quarter_budget",
        len / 4 / 4096 * 4096,
        || {
            let dir = TempDir::new("awkward");
            let path = dir.path("model.bin");
            // Not a block multiple, not a page multiple.
            pattern_file(&path, len);
            run_readers(
                len,
                len / 4 / 4096 * 4096,
                64 << 10,
                &MIXED,
                Check::Every,
                2000,
                &path,
                false,
                &[],
            );
        },
    );
}

#[test]
fn each_pattern_alone_with_eight_threads() {
    sampled("each_pattern_alone_with_eight_threads", 4 << 20, || {
        let dir = TempDir::new("patterns");
        let path = dir.path("model.bin");
        let len = (16 << 20) + 100;
        pattern_file(&path, len);
        for pattern in [Pattern::Sequential, Pattern::Random, Pattern::Cyclic] {
            run_readers(
                len,
                4 << 20,
                256 << 10,
                &[pattern; 8],
                Check::Every,
                2000,
                &path,
                false,
                &[],
            );
        }
    });
}

#[test]
fn zero_copy_regions_see_the_files_bytes_within_the_budget() {
    // Blocks are whole huge pages; the file ends mid-page, and its last block is short.
    let len = (40 << 20) + 4097;
    let budget = 10 << 20;
    sampled(
        "zero_copy_regions_see_the_files_bytes_within_the_budget",
        budget,
        || {
            let dir = TempDir::new("zero-copy");
            let path = dir.path("model.bin");
            pattern_file(&path, len);
            run_readers(
                len,
                budget,
                2 << 20,
                &MIXED,
                Check::Every,
                2000,
                &path,
                true,
                &[],
            );
        },
    );
}

/// Blocks cut besides the huge-page grid, as the shim cuts a mixture of experts' at
/// each expert's slice: the short blocks take small-page frames, the whole ones huge
/// frames, and every byte is the file's, within the budget, over 4x the budget.
#[test]
fn zero_copy_regions_cut_at_slices_see_the_files_bytes_within_the_budget() {
    let len = (40 << 20) + 4097;
    let budget = 10 << 20;
    // Slices of 172 to 174 pages (an expert of a fine-grained model is about 688 KiB),
    // so cuts fall on and off the grid, and a few single pages between them.
    let mut cuts = Vec::new();
    let mut at = 0u64;
    for k in 0u64.. {
        at += (172 + k % 3) * 4096;
        if at >= len {
            break;
        }
        cuts.push(at);
        if k % 5 == 0 {
            cuts.push(at + 4096);
        }
    }
    sampled(
        "zero_copy_regions_cut_at_slices_see_the_files_bytes_within_the_budget",
        budget,
        || {
            let dir = TempDir::new("zero-copy-cut");
            let path = dir.path("model.bin");
            pattern_file(&path, len);
            run_readers(
                len,
                budget,
                2 << 20,
                &MIXED,
                Check::Every,
                2000,
                &path,
                true,
                &cuts,
            );
        },
    );
}

/// Threads of this process that are io_uring's workers.
fn io_uring_workers() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("iou-wrk"))
        .count()
}

/// A zero-copy frame's first read faults its pages in, which the kernel clears first:
/// the service hands those reads to io_uring's workers instead of doing that work inside
/// its own submit (see `FaultService::start_read`). In a child process, so that no other
/// test's ring adds workers.
#[test]
fn zero_copy_first_reads_are_issued_by_io_uring_workers() {
    let test = "zero_copy_first_reads_are_issued_by_io_uring_workers";
    if !in_child_process(test, Duration::from_secs(120)) {
        return;
    }
    let dir = TempDir::new("first-reads");
    let path = dir.path("model.bin");
    let len = 16 << 20;
    pattern_file(&path, len);
    assert_eq!(
        io_uring_workers(),
        0,
        "workers before the pager read anything"
    );
    let Some(pager) = pager_or_skip(
        Pager::builder()
            .budget(32 << 20)
            .block_size(2 << 20)
            .zero_copy(true),
    ) else {
        return;
    };
    let stats = pager.stats();
    assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
    assert!(
        stats.zero_copy,
        "zero copy refused: {:?}",
        stats.zero_copy_refused
    );
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    check_range(region.as_slice(), 0..len, Check::Every);
    // Workers stay a few seconds after their last work; the reads ended just now.
    assert!(
        io_uring_workers() > 0,
        "the frames' first reads ran without an io_uring worker: {}",
        pager.stats().to_json()
    );
}

#[test]
fn file_smaller_than_a_page() {
    sampled("file_smaller_than_a_page", 4096, || {
        let dir = TempDir::new("tiny");
        let path = dir.path("tiny.bin");
        pattern_file(&path, 3000);
        // The smallest budget there is: one page-sized block (a quarter of a sub-page file
        // is less than any block).
        run_readers(
            3000,
            4096,
            4096,
            &MIXED,
            Check::Every,
            200,
            &path,
            false,
            &[],
        );
        let pager = pager_or_skip(Pager::builder().budget(4096).block_size(4096)).unwrap();
        let region = pager.map_file(&path, MapOptions::default()).unwrap();
        // The rest of the last page reads as zeros, as with mmap.
        // SAFETY: the mapping is one whole page long.
        let page = unsafe { std::slice::from_raw_parts(region.as_ptr(), 4096) };
        assert!(page[3000..].iter().all(|&b| b == 0));
    });
}

static SPARSE_DATA: [Range<u64>; 3] = [
    0..10_000,
    (1 << 30) + 12_345..(1 << 30) + 200_000,
    (3 << 30) - 5000..(3 << 30) + 12_345,
];

#[test]
fn several_gib_sparse_file() {
    let len = (3 << 30) + 12_345;
    sampled("several_gib_sparse_file", len / 4 / 4096 * 4096, || {
        let dir = TempDir::new("sparse");
        let path = dir.path("sparse.bin");
        sparse_file(&path, len, &SPARSE_DATA);
        // Two whole passes and six random readers: every page is checked, and the
        // budget is a quarter of the file. The cyclic reader's three passes over
        // 3 GiB are `awkward_size_file_with_a_quarter_budget`'s, at a smaller
        // size: here they cost CI minutes and found nothing more. A random read mostly
        // costs a 1 MiB block (the budget holds a quarter of the file): 1500 of them
        // per reader and the two passes read about 12 GB per prefetch kind.
        let patterns = [
            Pattern::Sequential,
            Pattern::Sequential,
            Pattern::Random,
            Pattern::Random,
            Pattern::Random,
            Pattern::Random,
            Pattern::Random,
            Pattern::Random,
        ];
        run_readers(
            len,
            len / 4 / 4096 * 4096,
            1 << 20,
            &patterns,
            Check::PagesAnd(&SPARSE_DATA),
            1500,
            &path,
            false,
            &[],
        );
    });
}

#[test]
fn an_offset_and_length_present_that_part_of_the_file() {
    let dir = TempDir::new("window");
    let path = dir.path("f.bin");
    pattern_file(&path, 10 << 20);
    let Some(pager) = pager_or_skip(Pager::builder().budget(1 << 20)) else {
        return;
    };
    let offset = 3 * 4096;
    let len = (5 << 20) + 7;
    let region = pager
        .map_file(
            &path,
            MapOptions {
                offset,
                len: Some(len),
                ..Default::default()
            },
        )
        .unwrap();
    for (i, &byte) in region.as_slice().iter().enumerate() {
        assert_eq!(byte, pattern_byte(offset + i as u64), "byte {i}");
    }
}
