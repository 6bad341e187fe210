//! `Pager::set_budget` against the kernel: a smaller budget is met before the call
//! returns (the pager's resident bytes and the region's resident set in the kernel's
//! page tables fall to it; with zero copy the frames' memory too), a larger one lets
//! the pager hold more, and the bytes stay the file's throughout.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use common::*;
use hyperoffload::policy::{EvictionKind, FaultEvent, PrefetchPolicy, PrefetchRequest};
use hyperoffload::{MapOptions, Pager, Region};

const MIB: u64 = 1 << 20;

/// Reads every byte of the region once, checking it is the file's.
fn scan(region: &Region) {
    let bytes = region.as_slice();
    for (offset, &byte) in bytes.iter().enumerate() {
        assert_eq!(byte, pattern_byte(offset as u64), "byte at offset {offset}");
    }
}

fn region_rss(region: &Region) -> u64 {
    mapping_rss(region.as_ptr() as usize, region.len())
}

fn budgets(pager: &Pager) -> Vec<u64> {
    (pager.stats().budget_history.iter())
        .map(|point| point.bytes)
        .collect()
}

#[test]
fn shrinking_evicts_to_the_new_budget_and_growing_holds_more() {
    let dir = TempDir::new("budget-copy");
    let path = dir.path("data");
    pattern_file(&path, 64 * MIB);
    let Some(pager) = pager_or_skip(
        Pager::builder()
            .budget(32 * MIB)
            .max_budget(48 * MIB)
            .block_size(64 << 10)
            .eviction(EvictionKind::Lru.build()),
    ) else {
        return;
    };
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    scan(&region);
    let full = pager.stats().resident_bytes;
    assert!(full > 24 * MIB && full <= 32 * MIB, "resident {full}");

    assert_eq!(pager.set_budget(8 * MIB).unwrap(), 8 * MIB);
    assert_eq!(pager.budget(), 8 * MIB);
    let stats = pager.stats();
    assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
    assert_eq!(stats.budget_bytes, 8 * MIB);
    assert!(
        stats.resident_bytes <= 8 * MIB,
        "resident {}",
        stats.resident_bytes
    );
    assert!(stats.evicted_bytes >= full - 8 * MIB, "{stats:?}");
    // The kernel agrees: the evicted pages are gone from the region.
    let rss = region_rss(&region);
    assert!(rss <= 8 * MIB, "region rss {rss}");

    scan(&region);
    let stats = pager.stats();
    assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
    assert!(stats.peak_resident_bytes <= 32 * MIB);
    assert!(
        stats.resident_bytes <= 8 * MIB,
        "resident {}",
        stats.resident_bytes
    );

    // Growing: a scan fills the larger budget.
    assert_eq!(pager.set_budget(48 * MIB).unwrap(), 48 * MIB);
    scan(&region);
    let resident = pager.stats().resident_bytes;
    assert!(
        resident > 32 * MIB && resident <= 48 * MIB,
        "resident {resident}"
    );

    // Outside the bounds: the ceiling, and the floor (two blocks a CPU, at most the
    // starting budget), never less.
    let (floor, ceiling) = pager.budget_bounds();
    assert_eq!(ceiling, 48 * MIB);
    assert!(
        (2 * (64 << 10)..=32 * MIB).contains(&floor),
        "floor {floor}"
    );
    assert_eq!(pager.set_budget(1 << 40).unwrap(), 48 * MIB);
    assert_eq!(pager.set_budget(1).unwrap(), floor);
    assert!(pager.stats().resident_bytes <= floor);
    scan(&region);
    assert!(pager.stats().resident_bytes <= floor);

    assert_eq!(
        budgets(&pager),
        [32 * MIB, 8 * MIB, 48 * MIB, floor],
        "the history records each change once"
    );
}

/// Reads nothing ahead; keeps each budget it is told of.
struct HearsBudgets(Arc<Mutex<Vec<u64>>>);

impl PrefetchPolicy for HearsBudgets {
    fn name(&self) -> &'static str {
        "hears-budgets"
    }

    fn plan(&mut self, _fault: &FaultEvent, _out: &mut Vec<PrefetchRequest>) {}

    fn budget_changed(&mut self, budget: u64) {
        self.0.lock().unwrap().push(budget);
    }
}

#[test]
fn the_prefetch_policy_hears_each_change_of_the_budget() {
    let dir = TempDir::new("budget-policy");
    let path = dir.path("data");
    pattern_file(&path, 16 * MIB);
    let heard = Arc::new(Mutex::new(Vec::new()));
    let Some(pager) = pager_or_skip(
        Pager::builder()
            .budget(8 * MIB)
            .block_size(64 << 10)
            .prefetch(Box::new(HearsBudgets(heard.clone()))),
    ) else {
        return;
    };
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    scan(&region);
    pager.set_budget(2 * MIB).unwrap();
    pager.set_budget(2 * MIB).unwrap();
    pager.set_budget(8 * MIB).unwrap();
    scan(&region);
    assert_eq!(
        *heard.lock().unwrap(),
        [2 * MIB, 8 * MIB],
        "each change once, none for a budget that stayed"
    );
}

#[test]
fn shrinking_while_threads_read_keeps_their_bytes_right() {
    let dir = TempDir::new("budget-busy");
    let path = dir.path("data");
    pattern_file(&path, 48 * MIB);
    let Some(pager) = pager_or_skip(Pager::builder().budget(24 * MIB).block_size(16 << 10)) else {
        return;
    };
    let region = Arc::new(pager.map_file(&path, MapOptions::default()).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (region, stop) = (region.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut scans = 0;
                while !stop.load(Ordering::Relaxed) || scans == 0 {
                    scan(&region);
                    scans += 1;
                }
                scans
            })
        })
        .collect();
    // Down and up while the readers fault.
    for budget in [4 * MIB, 12 * MIB, 2 * MIB, 24 * MIB, 4 * MIB] {
        assert_eq!(pager.set_budget(budget).unwrap(), budget);
        // Reads in flight may still hold their reservations: at most the queue depth
        // times the largest read over the budget.
        let resident = pager.stats().resident_bytes;
        let in_flight = 32 * hyperoffload::pager::DEFAULT_MAX_READ;
        assert!(
            resident <= budget + in_flight,
            "resident {resident} of {budget}"
        );
        scan(&region);
    }
    stop.store(true, Ordering::Relaxed);
    for reader in readers {
        assert!(reader.join().unwrap() >= 1);
    }
    // Quiet again: everything held fits the last budget.
    let stats = pager.stats();
    assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
    assert!(
        stats.resident_bytes <= 4 * MIB,
        "resident {}",
        stats.resident_bytes
    );
    assert!(region_rss(&region) <= 4 * MIB);
}

#[test]
fn with_zero_copy_the_frames_give_their_memory_back() {
    let dir = TempDir::new("budget-frames");
    let path = dir.path("data");
    pattern_file(&path, 64 * MIB);
    let Some(pager) = zero_copy_pager(32 * MIB) else {
        return;
    };
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    scan(&region);
    let before = pager.stats();
    assert!(before.frame_memory_bytes > 16 * MIB, "{before:?}");
    let floor = pager.budget_bounds().0;
    let asked = (8 * MIB).max(floor);
    assert_eq!(pager.set_budget(asked).unwrap(), asked);
    let after = pager.stats();
    assert!(
        after.resident_bytes <= asked,
        "resident {}",
        after.resident_bytes
    );
    // The evicted frames were emptied, not kept warm for the next read: what the
    // frames hold now is what is resident, and a frame or two not yet reused.
    assert!(
        after.frame_memory_bytes <= asked + 2 * (2 * MIB),
        "frame memory {} after shrinking to {asked}",
        after.frame_memory_bytes
    );
    assert!(region_rss(&region) <= asked);
    scan(&region);
    assert!(pager.stats().resident_bytes <= asked);
}
