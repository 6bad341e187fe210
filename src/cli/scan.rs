//! `hyperoffload scan`: reads a file through a region, like a program would, and
//! reports throughput and the pager's statistics.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::Context;
use clap::{Args, ValueEnum};
use hyperoffload::policy_name::{policies_by_name, ModelHint};
use hyperoffload::shim_config::{default_block_size, BudgetSpec};
use hyperoffload::size::format_size;
use hyperoffload::{MapOptions, Pager, Stats};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::size_arg;

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum ScanPattern {
    /// Each thread scans its own contiguous slice, once per pass.
    Seq,
    /// Each thread touches its share of the pages in random order, once per pass.
    Random,
    /// Every thread scans the whole file from the start, once per pass.
    Cyclic,
}

#[derive(Args, Debug)]
pub struct ScanArgs {
    /// The file to read.
    file: PathBuf,
    /// Most bytes of the file resident at once, as `run --budget` takes it: a size
    /// (48M, 2G) or a percentage of the file (50%).
    #[arg(long, value_parser = super::run::budget_arg)]
    budget: BudgetSpec,
    /// Block size, as `run --block` takes it. Default: `run`'s (2M with zero copy and a
    /// budget of at least 16M, else 4K).
    #[arg(long, value_parser = super::run::block_arg)]
    block: Option<u64>,
    /// Prefetch and eviction policy, by `run`'s names (graph needs a GGUF or
    /// safetensors file to predict anything).
    #[arg(long, default_value = "readahead", value_parser = super::run::policy_arg)]
    policy: String,
    #[arg(long, default_value_t = 1)]
    threads: u32,
    /// Threads installing prefetched reads beside the fault service thread.
    #[arg(
        long,
        default_value_t = hyperoffload::pager::DEFAULT_INSTALL_THREADS as u16,
        value_parser = clap::value_parser!(u16).range(0..=16)
    )]
    install_threads: u16,
    /// Copy blocks in rather than map them from a huge-page store, as `run
    /// --no-zero-copy` (zero copy needs blocks of a multiple of 2M and CAP_SYS_ADMIN;
    /// without either it copies anyway).
    #[arg(long)]
    no_zero_copy: bool,
    #[arg(long, value_enum, default_value_t = ScanPattern::Seq)]
    pattern: ScanPattern,
    #[arg(long, default_value_t = 1)]
    passes: u32,
    /// Check every byte read against the file read directly (pread); exit non-zero on
    /// any mismatch.
    #[arg(long)]
    verify: bool,
    /// Print the stats as one JSON object.
    #[arg(long)]
    json: bool,
    /// Largest read: neighbouring prefetched blocks are merged up to this size.
    #[arg(long, value_parser = size_arg, default_value = "1M")]
    max_read: u64,
    /// Reads in flight at once.
    #[arg(long, default_value_t = hyperoffload::pager::DEFAULT_QUEUE_DEPTH)]
    queue_depth: u32,
}

const PAGE: u64 = 4096;
const CHUNK: u64 = 1 << 20;

pub fn run(args: ScanArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.threads >= 1, "--threads must be at least 1");
    anyhow::ensure!(args.passes >= 1, "--passes must be at least 1");
    // The pager opens it again; this gives its size, with the pager's errors.
    let file_len = hyperoffload::file::BackingFile::open(&args.file)?.len();
    let budget = (args.budget).resolve(
        file_len,
        hyperoffload::budget::memory_limits::auto_budget_now,
    );
    let zero_copy = !args.no_zero_copy;
    let block = args
        .block
        .unwrap_or_else(|| default_block_size(zero_copy, budget, file_len));
    let hint = ModelHint {
        path: &args.file,
        file_offset: 0,
        data_len: file_len,
        block_size: block,
        block_cuts: &[],
        saved_experts: true,
    };
    let policies = policies_by_name(&args.policy, Some(&hint))?;
    if !args.json {
        println!("policy {}", policies.description);
    }
    let pager = Pager::builder()
        .budget(budget)
        .block_size(block)
        .queue_depth(args.queue_depth)
        .max_read(args.max_read)
        .install_threads(usize::from(args.install_threads))
        .zero_copy(zero_copy)
        .prefetch(policies.prefetch)
        .eviction(policies.eviction)
        .build()?;
    let region = pager.map_file(&args.file, MapOptions::default())?;
    let file = File::open(&args.file)
        .with_context(|| format!("opening {} for --verify", args.file.display()))?;
    let started = Instant::now();
    let scanned = scan(&args, region.as_slice(), &file);
    let elapsed = started.elapsed().as_secs_f64();
    let stats = pager.stats();
    let len = region.as_slice().len() as u64;
    if args.json {
        print_json(&args, &stats, len, &scanned, elapsed)?;
    } else {
        print_summary(&args, &stats, len, &scanned, elapsed);
    }
    drop(region);
    Ok(if scanned.mismatches == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// What the scanning threads did.
struct Scanned {
    touched: u64,
    /// Chunks whose bytes differ from the file's (with --verify).
    mismatches: u64,
}

/// Reads (or verifies) `bytes` from `args.threads` threads in `args.pattern`.
fn scan(args: &ScanArgs, bytes: &[u8], file: &File) -> Scanned {
    let len = bytes.len() as u64;
    let mismatches = AtomicU64::new(0);
    let touched = AtomicU64::new(0);
    std::thread::scope(|scope| {
        for thread in 0..args.threads as u64 {
            let (mismatches, touched) = (&mismatches, &touched);
            scope.spawn(move || {
                let mut expected = vec![0u8; CHUNK as usize];
                for range in thread_ranges(args, thread, len) {
                    let slice = &bytes[range.start as usize..range.end as usize];
                    if args.verify {
                        let expected = &mut expected[..slice.len()];
                        if file.read_exact_at(expected, range.start).is_err() || slice != expected {
                            let first_bad = slice
                                .iter()
                                .zip(expected.iter())
                                .position(|(a, b)| a != b)
                                .unwrap_or(0);
                            if mismatches.fetch_add(1, Ordering::Relaxed) < 10 {
                                eprintln!("mismatch at offset {}", range.start + first_bad as u64);
                            }
                        }
                    } else {
                        touch_pages(slice);
                    }
                    touched.fetch_add(range.end - range.start, Ordering::Relaxed);
                }
            });
        }
    });
    Scanned {
        touched: touched.into_inner(),
        mismatches: mismatches.into_inner(),
    }
}

fn print_json(
    args: &ScanArgs,
    stats: &Stats,
    len: u64,
    scanned: &Scanned,
    elapsed: f64,
) -> anyhow::Result<()> {
    let mut json = serde_json::to_value(stats)?;
    let object = json.as_object_mut().expect("stats serialize to an object");
    object.insert("file_bytes".into(), len.into());
    object.insert("bytes_touched".into(), scanned.touched.into());
    object.insert("scan_seconds".into(), elapsed.into());
    let throughput = scanned.touched as f64 / elapsed / 1e6;
    object.insert("throughput_mb_s".into(), throughput.into());
    if args.verify {
        object.insert("mismatches".into(), scanned.mismatches.into());
    }
    println!("{json}");
    Ok(())
}

fn print_summary(args: &ScanArgs, stats: &Stats, len: u64, scanned: &Scanned, elapsed: f64) {
    let throughput = scanned.touched as f64 / elapsed / 1e6;
    println!(
        "scanned {} of {} in {elapsed:.3} s: {throughput:.0} MB/s ({:?}, {} thread(s), {} pass(es))",
        format_size(scanned.touched),
        format_size(len),
        args.pattern,
        args.threads,
        args.passes
    );
    println!(
        "faults {} (demand {}, prefetch hits {}, hit rate {:.1}%), read {} in {} blocks / {} requests, evictions {}",
        stats.faults,
        stats.demand_faults,
        stats.prefetch_hits,
        stats.hit_rate() * 100.0,
        format_size(stats.bytes_read),
        stats.blocks_read,
        stats.read_requests,
        stats.evictions
    );
    println!(
        "budget {}, peak resident {}, fault latency us p50 {:.0} p90 {:.0} p99 {:.0} max {:.0}{}",
        format_size(stats.budget_bytes),
        format_size(stats.peak_resident_bytes),
        stats.fault_latency_us.p50,
        stats.fault_latency_us.p90,
        stats.fault_latency_us.p99,
        stats.fault_latency_us.max,
        stats
            .direct_io_fallback
            .as_deref()
            .map(|why| format!("; {why}"))
            .unwrap_or_default()
    );
    if args.verify {
        println!("verify: {} mismatching chunk(s)", scanned.mismatches);
    }
}

/// The byte ranges one thread reads, in order, for all passes.
fn thread_ranges(args: &ScanArgs, thread: u64, len: u64) -> Vec<std::ops::Range<u64>> {
    let threads = args.threads as u64;
    let chunks = |range: std::ops::Range<u64>, step: u64| {
        (range.start..range.end)
            .step_by(step as usize)
            .map(move |at| at..(at + step).min(range.end))
    };
    let mut ranges = Vec::new();
    for pass in 0..args.passes as u64 {
        match args.pattern {
            ScanPattern::Seq => {
                let share = len.div_ceil(threads).next_multiple_of(PAGE);
                let start = (share * thread).min(len);
                ranges.extend(chunks(start..(start + share).min(len), CHUNK));
            }
            ScanPattern::Cyclic => ranges.extend(chunks(0..len, CHUNK)),
            ScanPattern::Random => {
                let pages = len.div_ceil(PAGE);
                let mut mine: Vec<u64> = (thread..pages).step_by(threads as usize).collect();
                mine.shuffle(&mut SmallRng::seed_from_u64(thread * 1000 + pass));
                ranges.extend(
                    mine.into_iter()
                        .map(|page| page * PAGE..(page * PAGE + PAGE).min(len)),
                );
            }
        }
    }
    ranges
}

/// Reads one word per page: enough to fault every page in, cheap enough that the scan
/// measures the pager rather than the loop.
fn touch_pages(slice: &[u8]) {
    let mut sum = 0u8;
    for offset in (0..slice.len()).step_by(PAGE as usize) {
        sum = sum.wrapping_add(slice[offset]);
    }
    std::hint::black_box(sum);
}
