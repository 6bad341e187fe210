//! Cold-read benchmark of the pager core against the kernel's own mmap paging and the
//! device's limit, all measured by this program in the same run.
//!
//! `cargo bench --bench scan` (root: drops the page cache before every cold run).
//! Environment: HYPEROFFLOAD_BENCH_FILE (default target/bench/scan-2g.bin, created with
//! random bytes if missing), HYPEROFFLOAD_BENCH_SIZE (default 2G), HYPEROFFLOAD_BENCH_RUNS
//! (repeats per case, default 3; medians are reported), HYPEROFFLOAD_BENCH_TOUCHES
//! (random touches per thread, default 4000).

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

use hyperoffload::policy::PrefetchKind;
use hyperoffload::size::{format_size, parse_size};
use hyperoffload::stats::{LatencyHistogram, LatencySummary};
use hyperoffload::{MapOptions, Pager};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{RngCore, SeedableRng};

// The device yardstick belongs to the binary (`hyperoffload bench` measures with it);
// this benchmark compiles the same file.
#[allow(dead_code)]
#[path = "../src/cli/device.rs"]
mod device;

const PAGE: usize = 4096;
const THREADS: usize = 8;

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

fn ensure_file(path: &Path, len: u64) {
    if std::fs::metadata(path).is_ok_and(|m| m.len() == len) {
        return;
    }
    eprintln!(
        "writing {} of random bytes to {}",
        format_size(len),
        path.display()
    );
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let tmp = path.with_extension("tmp");
    let mut file = File::create(&tmp).unwrap();
    let mut rng = SmallRng::seed_from_u64(42);
    let mut chunk = vec![0u8; 1 << 20];
    let mut written = 0;
    while written < len {
        rng.fill_bytes(&mut chunk);
        let n = ((len - written) as usize).min(chunk.len());
        file.write_all(&chunk[..n]).unwrap();
        written += n as u64;
    }
    file.sync_all().unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// The device's limit: one pass of O_DIRECT 1 MiB reads at queue depth 32.
fn device_limit(path: &Path) -> f64 {
    device::sequential_read_rate(path, 1 << 20, 32).unwrap() / 1e6
}

struct Mmap {
    ptr: *mut u8,
    len: usize,
}

impl Mmap {
    fn new(file: &File, len: usize, advice: Option<i32>) -> Self {
        // SAFETY: maps a file we opened read-only; unmapped in Drop.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        if let Some(advice) = advice {
            // SAFETY: advises the mapping just created.
            unsafe { libc::madvise(ptr, len, advice) };
        }
        Self {
            ptr: ptr.cast(),
            len,
        }
    }

    fn slice(&self) -> &[u8] {
        // SAFETY: the mapping is live and read-only for as long as self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for Mmap {
    fn drop(&mut self) {
        // SAFETY: unmaps what `new` mapped.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn sequential_scan(bytes: &[u8]) -> f64 {
    let started = Instant::now();
    let mut sum = 0u8;
    for offset in (0..bytes.len()).step_by(PAGE) {
        sum = sum.wrapping_add(bytes[offset]);
    }
    std::hint::black_box(sum);
    bytes.len() as f64 / started.elapsed().as_secs_f64() / 1e6
}

/// `threads` threads touch distinct random pages; returns touches per second and the latency
/// of every touch as seen by the program.
fn random_touches(
    bytes: &[u8],
    threads: usize,
    touches_per_thread: usize,
) -> (f64, LatencyHistogram) {
    let pages = bytes.len() / PAGE;
    let mut order: Vec<usize> = (0..pages).collect();
    order.shuffle(&mut SmallRng::seed_from_u64(7));
    let started = Instant::now();
    let histograms: Vec<LatencyHistogram> = std::thread::scope(|scope| {
        let handles: Vec<_> = order
            .chunks(pages / threads)
            .take(threads)
            .map(|mine| {
                scope.spawn(move || {
                    let mut histogram = LatencyHistogram::default();
                    for &page in mine.iter().take(touches_per_thread) {
                        let at = Instant::now();
                        std::hint::black_box(bytes[page * PAGE]);
                        histogram.record_ns(at.elapsed().as_nanos() as u64);
                    }
                    histogram
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let elapsed = started.elapsed().as_secs_f64();
    let mut all = LatencyHistogram::default();
    for histogram in &histograms {
        all.merge(histogram);
    }
    ((touches_per_thread * threads) as f64 / elapsed, all)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(|a, b| a.partial_cmp(b).unwrap());
    values[values.len() / 2]
}

/// What every case runs on: the file, the pager's budget, the repeats.
struct Bench {
    path: PathBuf,
    len: u64,
    file: File,
    /// The pager's budget: half the file.
    budget: u64,
    runs: usize,
    /// Random touches per thread.
    touches: usize,
}

impl Bench {
    /// The benchmark the environment asks for, its file written if missing; prints the
    /// report's title.
    fn from_env() -> Self {
        let len = parse_size(&env_or("HYPEROFFLOAD_BENCH_SIZE", "2G")).unwrap();
        let path = PathBuf::from(env_or(
            "HYPEROFFLOAD_BENCH_FILE",
            "target/bench/scan-2g.bin",
        ));
        let runs: usize = env_or("HYPEROFFLOAD_BENCH_RUNS", "3").parse().unwrap();
        let touches: usize = env_or("HYPEROFFLOAD_BENCH_TOUCHES", "4000")
            .parse()
            .unwrap();
        ensure_file(&path, len);
        let cold = device::drop_page_cache();
        if !cold {
            eprintln!("warning: cannot drop the page cache (not root?): runs are not cold");
        }
        let file = File::open(&path).unwrap();
        let budget = len / 2;
        println!(
            "# scan benchmark: {} file {}, budget {} for the pager, {runs} runs per case (median), cold={cold}",
            format_size(len),
            path.display(),
            format_size(budget)
        );
        Self {
            path,
            len,
            file,
            budget,
            runs,
            touches,
        }
    }
}

/// Measurements of each case, by name, in the order first measured.
type Cases = Vec<(String, Vec<f64>)>;

/// Adds `value` to the measurements of the case `name`.
fn record(table: &mut Cases, name: &str, value: f64) {
    match table.iter_mut().find(|(n, _)| n == name) {
        Some((_, values)) => values.push(value),
        None => table.push((name.to_string(), vec![value])),
    }
}

fn main() {
    if std::env::args().any(|arg| arg == "--list" || arg == "--test") {
        return; // `cargo test --benches` probes benches; nothing to do then.
    }
    let bench = Bench::from_env();
    let mut device = Vec::new();
    let mut seq = Cases::new();
    for _ in 0..bench.runs {
        device::drop_page_cache();
        device.push(device_limit(&bench.path));
        kernel_sequential(&bench, &mut seq);
        pager_sequential(&bench, &mut seq);
    }
    print_sequential(&mut device, &mut seq);
    print_random_touches(&bench);
}

/// One cold sequential scan through the kernel's mmap, without and with
/// MADV_SEQUENTIAL.
fn kernel_sequential(bench: &Bench, seq: &mut Cases) {
    for (name, advice) in [
        ("kernel mmap", None),
        ("kernel mmap + MADV_SEQUENTIAL", Some(libc::MADV_SEQUENTIAL)),
    ] {
        device::drop_page_cache();
        let map = Mmap::new(&bench.file, bench.len as usize, advice);
        let mbs = sequential_scan(map.slice());
        record(seq, name, mbs);
    }
}

/// One cold sequential scan through the pager, readahead policy, per block size and
/// install mode; zero copy scans twice.
fn pager_sequential(bench: &Bench, seq: &mut Cases) {
    let workers = hyperoffload::pager::DEFAULT_INSTALL_THREADS;
    for (block, install_threads, zero_copy) in [
        (4 << 10, 0, false),
        (4 << 10, workers, false),
        (64 << 10, workers, false),
        (1 << 20, workers, false),
        (2 << 20, workers, false),
        (2 << 20, workers, true),
    ] {
        device::drop_page_cache();
        let pager = Pager::builder()
            .budget(bench.budget)
            .block_size(block)
            .install_threads(install_threads)
            .zero_copy(zero_copy)
            .prefetch(PrefetchKind::Readahead.build())
            .build()
            .unwrap();
        assert_eq!(
            pager.stats().zero_copy,
            zero_copy,
            "{:?}",
            pager.stats().zero_copy_refused
        );
        let region = pager.map_file(&bench.path, MapOptions::default()).unwrap();
        let mbs = sequential_scan(region.as_slice());
        let install = if zero_copy {
            "zero copy".to_string()
        } else {
            format!("copy, {install_threads} install threads")
        };
        record(
            seq,
            &format!("pager readahead, block {}, {install}", format_size(block)),
            mbs,
        );
        if zero_copy {
            // The same pager again, page cache dropped: every block is read from
            // the disk again (the first half of the pass evicts what the last pass
            // left), but into frames whose memory is already in use. The first pass
            // paid for fresh memory, which this VM backs on first touch.
            device::drop_page_cache();
            let mbs = sequential_scan(region.as_slice());
            record(
                seq,
                &format!(
                    "pager readahead, block {}, zero copy, second pass",
                    format_size(block)
                ),
                mbs,
            );
        }
    }
}

/// The sequential scan's table: each case's median against the device and the kernel.
fn print_sequential(device: &mut [f64], seq: &mut Cases) {
    let device_mbs = median(device);
    println!("\n## cold sequential scan (one byte per page, one thread)\n");
    println!("| case | MB/s | of device limit | vs kernel mmap |");
    println!("|---|---|---|---|");
    println!("| device limit (io_uring O_DIRECT 1 MiB, QD32) | {device_mbs:.0} | 100% | |");
    let kernel_mbs = median(&mut seq[0].1.clone());
    for (name, values) in seq {
        let mbs = median(values);
        println!(
            "| {name} | {mbs:.0} | {:.0}% | {:.2}x |",
            mbs / device_mbs * 100.0,
            mbs / kernel_mbs
        );
    }
}

/// The random touches' table: each case on 8 threads, then on one.
fn print_random_touches(bench: &Bench) {
    let touches = bench.touches;
    println!("\n## cold random 4 KiB touches, {touches} distinct pages per thread\n");
    println!(
        "| threads | case | touches/s | latency p50 us | p90 | p99 | max | p50 vs kernel MADV_RANDOM |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for threads in [THREADS, 1] {
        let mut kernel_p50 = None;
        let cases: Vec<(String, Option<i32>, Option<u64>)> = vec![
            ("kernel mmap".into(), None, None),
            (
                "kernel mmap + MADV_RANDOM".into(),
                Some(libc::MADV_RANDOM),
                None,
            ),
            ("pager, block 4 KiB".into(), None, Some(4 << 10)),
            ("pager, block 16 KiB".into(), None, Some(16 << 10)),
            ("pager, block 64 KiB".into(), None, Some(64 << 10)),
        ];
        for (name, advice, block) in cases {
            let (mut rates, mut p50s, summary) = random_case(bench, threads, advice, block);
            let p50 = median(&mut p50s);
            if advice == Some(libc::MADV_RANDOM) {
                kernel_p50 = Some(p50);
            }
            println!(
                "| {threads} | {name} | {:.0} | {p50:.0} | {:.0} | {:.0} | {:.0} | {} |",
                median(&mut rates),
                summary.p90,
                summary.p99,
                summary.max,
                kernel_p50
                    .map(|k| format!("{:.2}x", p50 / k))
                    .unwrap_or_default()
            );
        }
    }
}

/// `bench.runs` cold runs of random touches on `threads` threads, through the kernel's
/// mmap (with `advice`) or, with a `block` size, the pager without prefetch: each run's
/// touch rate and p50 latency, and the last run's latency summary.
fn random_case(
    bench: &Bench,
    threads: usize,
    advice: Option<i32>,
    block: Option<u64>,
) -> (Vec<f64>, Vec<f64>, LatencySummary) {
    let mut rates = Vec::new();
    let mut p50s = Vec::new();
    let mut last = None;
    for _ in 0..bench.runs {
        device::drop_page_cache();
        let (rate, histogram) = match block {
            None => {
                let map = Mmap::new(&bench.file, bench.len as usize, advice);
                random_touches(map.slice(), threads, bench.touches)
            }
            Some(block) => {
                let pager = Pager::builder()
                    .budget(bench.budget)
                    .block_size(block)
                    .prefetch(PrefetchKind::None.build())
                    .build()
                    .unwrap();
                let region = pager.map_file(&bench.path, MapOptions::default()).unwrap();
                random_touches(region.as_slice(), threads, bench.touches)
            }
        };
        rates.push(rate);
        p50s.push(histogram.summary().p50);
        last = Some(histogram.summary());
    }
    (rates, p50s, last.unwrap())
}
