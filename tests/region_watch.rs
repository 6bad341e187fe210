//! Watching resident blocks (`EvictionPolicy::watch`): with zero copy the pager drops a
//! watched block's page-table entries and keeps its frame, so the program's next access
//! is a fault the policy hears of, served without a read, with the file's bytes. Copying
//! in, the pager cannot keep the bytes, and the policy is never asked.

mod common;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use common::*;
use hyperoffload::policy::{
    BlockRef, EvictionPolicy, FaultEvent, FaultOutcome, PrefetchKind, ReadKind, RecordingEviction,
    RegionId, RegionInfo,
};
use hyperoffload::{MapOptions, Pager, Region};

/// What the test policy saw.
#[derive(Default)]
struct Seen {
    /// `RegionInfo::watch_resident` of the last region added.
    watch_resident: Option<bool>,
    /// Watch faults: `Resident` faults on a block this policy watched.
    watched_faults: u64,
    /// Blocks handed to the pager to watch.
    watches: u64,
}

/// The recording runs' eviction (FIFO, every resident block watched but the one faulted
/// on last, so that a sequential pass over resident blocks faults once per block), with
/// what the pager tells it and asks of it noted.
struct Observed {
    policy: RecordingEviction,
    /// Blocks handed out to watch and not yet seen again.
    watched: HashSet<BlockRef>,
    seen: Arc<Mutex<Seen>>,
}

impl EvictionPolicy for Observed {
    fn name(&self) -> &'static str {
        "observed recording eviction"
    }

    fn region_added(&mut self, info: &RegionInfo<'_>) {
        self.seen.lock().unwrap().watch_resident = Some(info.watch_resident);
        self.policy.region_added(info);
    }

    fn region_removed(&mut self, region: RegionId) {
        self.policy.region_removed(region);
        self.watched.retain(|block| block.region != region);
    }

    fn inserted(&mut self, block: BlockRef) {
        self.policy.inserted(block);
    }

    fn removed(&mut self, block: BlockRef) {
        self.policy.removed(block);
        self.watched.remove(&block);
    }

    fn touched(&mut self, fault: &FaultEvent) {
        if self.watched.remove(&fault.block) {
            assert_eq!(fault.outcome, FaultOutcome::Resident, "{fault:?}");
            self.seen.lock().unwrap().watched_faults += 1;
        }
        self.policy.touched(fault);
    }

    fn watch(&mut self, out: &mut Vec<BlockRef>) {
        let from = out.len();
        self.policy.watch(out);
        self.watched.extend(&out[from..]);
        self.seen.lock().unwrap().watches += (out.len() - from) as u64;
    }

    fn victim(&mut self, incoming: BlockRef, kind: ReadKind) -> Option<BlockRef> {
        let victim = self.policy.victim(incoming, kind)?;
        self.watched.remove(&victim);
        Some(victim)
    }
}

fn pager(budget: u64, zero_copy: bool, seen: &Arc<Mutex<Seen>>) -> Option<Pager> {
    pager_serving_forks(budget, zero_copy, false, seen)
}

/// As `pager`, serving forks from the first one on if `at_fork`.
fn pager_serving_forks(
    budget: u64,
    zero_copy: bool,
    at_fork: bool,
    seen: &Arc<Mutex<Seen>>,
) -> Option<Pager> {
    let policy = Observed {
        policy: RecordingEviction::default(),
        watched: HashSet::new(),
        seen: Arc::clone(seen),
    };
    pager_or_skip(
        Pager::builder()
            .budget(budget)
            .block_size(2 << 20)
            .zero_copy(zero_copy)
            .serve_forks_at_fork(at_fork)
            .prefetch(PrefetchKind::None.build())
            .eviction(Box::new(policy)),
    )
}

/// A file of `len` pattern bytes in a new directory, and a pager with the watching
/// policy over it; `None` where the test may skip.
fn setup(
    name: &str,
    len: u64,
    budget: u64,
    zero_copy: bool,
) -> Option<(TempDir, Region, Pager, Arc<Mutex<Seen>>)> {
    let dir = TempDir::new(name);
    let path = dir.path("model.bin");
    pattern_file(&path, len);
    let seen = Arc::new(Mutex::new(Seen::default()));
    let pager = pager(budget, zero_copy, &seen)?;
    assert_eq!(
        pager.stats().zero_copy,
        zero_copy,
        "{:?}",
        pager.stats().zero_copy_refused
    );
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    Some((dir, region, pager, seen))
}

fn check_every_byte(bytes: &[u8]) {
    for (offset, &byte) in bytes.iter().enumerate() {
        if byte != pattern_byte(offset as u64) {
            panic!(
                "byte {offset}: {byte} instead of {}",
                pattern_byte(offset as u64)
            );
        }
    }
}

#[test]
fn a_watched_block_faults_once_and_is_served_without_a_read() {
    let len = 24 << 20;
    let Some((_dir, region, pager, seen)) = setup("watch-fits", len, 64 << 20, true) else {
        return;
    };
    check_every_byte(region.as_slice());
    let first = pager.stats();
    assert_eq!(seen.lock().unwrap().watch_resident, Some(true));
    assert_eq!(first.bytes_read, len, "{}", first.to_json());
    // Every block is resident and watched; each pass faults once per block, reads
    // nothing, and sees the same bytes.
    for pass in 1..=3u64 {
        check_every_byte(region.as_slice());
        let stats = pager.stats();
        assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
        assert_eq!(
            stats.bytes_read,
            len,
            "pass {pass} read: {}",
            stats.to_json()
        );
        assert_eq!(
            stats.watch_faults,
            12 * pass,
            "pass {pass}: {}",
            stats.to_json()
        );
        assert!(stats.watched_blocks >= 12 * pass, "{}", stats.to_json());
        // All but the last block used are watched again: their pages are gone.
        let present = pages_present(region.as_ptr() as usize, region.map_len());
        let block_pages = (2 << 20) / 4096;
        let mapped: Vec<usize> = (0..12).filter(|&i| present[i * block_pages]).collect();
        assert_eq!(mapped, [11], "after pass {pass}");
    }
    let policy_saw = seen.lock().unwrap().watched_faults;
    assert_eq!(policy_saw, 36, "the policy heard of each watch fault");
}

/// A pager serving forks from the first fork on makes its regions file-shaped then:
/// resident blocks go on being watched (their page-table entries dropped, the file
/// keeping their pages), so the policy still hears of every pass, and nothing is read.
#[test]
fn watching_goes_on_after_a_fork_makes_the_region_file_shaped() {
    let len = 24 << 20;
    let dir = TempDir::new("watch-after-fork");
    let path = dir.path("model.bin");
    pattern_file(&path, len);
    let seen = Arc::new(Mutex::new(Seen::default()));
    let Some(pager) = pager_serving_forks(64 << 20, true, true, &seen) else {
        return;
    };
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    check_every_byte(region.as_slice());
    assert!(!pager.serves_forks());
    // SAFETY: the child only leaves with _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: ends the child without running the parent's destructors.
        unsafe { libc::_exit(0) };
    }
    let mut status = 0;
    // SAFETY: waits for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(pager.serves_forks(), "{:?}", pager.stats().forks_refused);
    let forked = pager.stats();
    // The first pass maps every block again (minor faults); by the second, every block
    // but the last one used is watched again after each access.
    check_every_byte(region.as_slice());
    check_every_byte(region.as_slice());
    let after = pager.stats();
    assert_eq!(after.bytes_read, len, "{}", after.to_json());
    assert!(
        after.watch_faults >= forked.watch_faults + 11,
        "watch faults {} before, {} after two passes: {}",
        forked.watch_faults,
        after.watch_faults,
        after.to_json()
    );
}

#[test]
fn watched_blocks_keep_the_file_s_bytes_under_eviction_with_threads() {
    let (len, budget) = (64 << 20, 16 << 20);
    let Some((_dir, region, pager, _)) = setup("watch-evicts", len, budget, true) else {
        return;
    };
    let region = Arc::new(region);
    std::thread::scope(|scope| {
        for thread in 0..4u64 {
            let region = Arc::clone(&region);
            scope.spawn(move || {
                let bytes = region.as_slice();
                // Each thread sweeps a quarter of the file forwards and back, twice:
                // blocks are watched, used, evicted and read again.
                let quarter = len / 4;
                let (start, end) = (thread * quarter, (thread + 1) * quarter);
                for _ in 0..2 {
                    for page in (start..end).step_by(4096) {
                        assert_eq!(bytes[page as usize], pattern_byte(page));
                    }
                    for page in (start / 4096..end / 4096).rev().map(|page| page * 4096) {
                        assert_eq!(bytes[page as usize], pattern_byte(page));
                    }
                }
            });
        }
    });
    check_every_byte(region.as_slice());
    let stats = pager.stats();
    assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
    assert!(
        stats.evictions > 0 && stats.watch_faults > 0,
        "{}",
        stats.to_json()
    );
    assert!(stats.peak_resident_bytes <= budget, "{}", stats.to_json());
    assert!(
        stats.peak_frame_memory_bytes <= budget,
        "{}",
        stats.to_json()
    );
}

#[test]
fn copying_in_the_pager_never_asks_to_watch() {
    let len = 8 << 20;
    let Some((_dir, region, pager, seen)) = setup("watch-copy", len, 64 << 20, false) else {
        return;
    };
    check_every_byte(region.as_slice());
    check_every_byte(region.as_slice());
    let stats = pager.stats();
    assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
    let seen = seen.lock().unwrap();
    assert_eq!(seen.watch_resident, Some(false));
    assert_eq!(
        (seen.watches, stats.watched_blocks, stats.watch_faults),
        (0, 0, 0)
    );
    assert_eq!(stats.bytes_read, len);
}
