//! The fault service on a scripted ring (`crate::ring::scripted`): a pager whose reads
//! end as a script says, serving a real file through a real region and userfaultfd, so
//! that what the service makes of a failed, short or reordered read is seen
//! deterministically, with no hook in the service. Needs userfaultfd (root), as the
//! integration tests do; `HYPEROFFLOAD_ALLOW_SKIP=1` skips where it is refused.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;

use crate::pager::{MapOptions, Pager, PagerError};
use crate::policy::{EvictionKind, PrefetchKind};
use crate::ring::scripted::{ReadScript, ScriptLog, ScriptedRead};
use crate::stats::Stats;

const BLOCK: u64 = 256 << 10;
const FILE_LEN: u64 = 16 * BLOCK + 12345;

/// The byte at `offset` of the test file: differs between neighbouring pages and
/// blocks, so a block installed at the wrong place is caught.
fn byte_at(offset: u64) -> u8 {
    (offset ^ (offset >> 12) ^ (offset >> 18)).wrapping_mul(31) as u8
}

/// A file of `FILE_LEN` bytes of `byte_at`, removed when dropped.
struct TestFile(PathBuf);

impl TestFile {
    fn new(name: &str) -> Self {
        let path = std::env::temp_dir().join(format!(
            "hyperoffload-service-{name}-{}",
            std::process::id()
        ));
        let bytes: Vec<u8> = (0..FILE_LEN).map(byte_at).collect();
        std::fs::write(&path, bytes).expect("write the test file");
        TestFile(path)
    }
}

impl Drop for TestFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A pager on a ring scripted by `script`, prefetching with `prefetch`; None where
/// userfaultfd is refused and skipping is allowed.
fn scripted_pager(script: ReadScript, prefetch: PrefetchKind) -> Option<Pager> {
    let built = Pager::builder()
        .budget(FILE_LEN * 2)
        .block_size(BLOCK)
        .max_read(4 * BLOCK)
        .queue_depth(8)
        .read_attempts(3)
        .prefetch(prefetch.build())
        .eviction(EvictionKind::Lru.build())
        .read_script(script)
        .build();
    match built {
        Ok(pager) => Some(pager),
        Err(
            error @ (PagerError::UffdNotPermitted(_)
            | PagerError::UffdUnavailable(_)
            | PagerError::UffdNoPoison),
        ) if std::env::var("HYPEROFFLOAD_ALLOW_SKIP").as_deref() == Ok("1") => {
            eprintln!("skipped: {error}");
            None
        }
        Err(error) => panic!("pager: {error} (HYPEROFFLOAD_ALLOW_SKIP=1 skips)"),
    }
}

/// Reads the whole file through a region of `pager` with `threads` threads, each
/// starting at its own block, and checks every byte.
fn read_and_check(pager: &Pager, file: &TestFile, threads: u64) {
    let region = Arc::new(
        pager
            .map_file(&file.0, MapOptions::default())
            .expect("map the test file"),
    );
    std::thread::scope(|scope| {
        for thread in 0..threads {
            let region = Arc::clone(&region);
            scope.spawn(move || {
                let bytes = region.as_slice();
                let start = (thread * FILE_LEN / threads) as usize;
                for at in (start..bytes.len()).chain(0..start) {
                    assert_eq!(bytes[at], byte_at(at as u64), "byte at {at}");
                }
            });
        }
    });
}

/// Serves the test file `name` through a pager on a ring scripted by `script`, reads it
/// whole with `threads` threads checking every byte, and gives the pager's stats after
/// and the ring's log; None where skipped.
fn serve_scripted(
    name: &str,
    script: ReadScript,
    prefetch: PrefetchKind,
    threads: u64,
) -> Option<(Stats, Arc<ScriptLog>)> {
    let file = TestFile::new(name);
    let log = Arc::clone(&script.log);
    let pager = scripted_pager(script, prefetch)?;
    read_and_check(&pager, &file, threads);
    Some((pager.stats(), log))
}

#[test]
fn a_failed_read_is_retried_and_the_region_holds_the_files_bytes() {
    let script = ReadScript {
        reads: VecDeque::from([ScriptedRead::Fail(libc::EIO)]),
        ..ReadScript::default()
    };
    let Some((stats, log)) = serve_scripted("failed", script, PrefetchKind::None, 1) else {
        return;
    };
    assert_eq!(ScriptLog::get(&log.scripted), 1, "the failure was scripted");
    assert_eq!(stats.read_retries, 1, "{stats:?}");
    assert_eq!(stats.read_errors, 0, "{stats:?}");
    assert_eq!(stats.poisoned_pages, 0, "{stats:?}");
}

#[test]
fn short_reads_are_continued_to_the_end_of_each_block() {
    // Every block's first read delivers one 64 KiB piece of its 256 KiB; the rest
    // must be read by continuing it, else the region shows zeros there.
    let script = ReadScript {
        reads: std::iter::repeat_n(ScriptedRead::Short(64 << 10), 16).collect(),
        ..ReadScript::default()
    };
    let Some((stats, log)) = serve_scripted("short", script, PrefetchKind::None, 1) else {
        return;
    };
    assert_eq!(ScriptLog::get(&log.scripted), 16);
    assert!(
        ScriptLog::get(&log.reads) > stats.read_requests,
        "continuations are reads of their own: {} reads for {} requests",
        ScriptLog::get(&log.reads),
        stats.read_requests
    );
    assert_eq!(
        stats.read_retries, 0,
        "a short read is no failure: {stats:?}"
    );
    assert_eq!(stats.read_errors, 0, "{stats:?}");
}

#[test]
fn reads_completed_in_reverse_land_in_their_own_blocks() {
    // Readahead issues several reads a turn; each turn's completions come back last
    // first, as a device may finish them.
    let script = ReadScript {
        reverse: true,
        ..ReadScript::default()
    };
    let Some((stats, log)) = serve_scripted("reverse", script, PrefetchKind::Readahead, 4) else {
        return;
    };
    assert!(
        ScriptLog::get(&log.reversed) > 0,
        "no turn had two completions to reverse: {stats:?}"
    );
    assert_eq!(stats.read_errors, 0, "{stats:?}");
    assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
}
