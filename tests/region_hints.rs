//! Explicit hints (prefetch, drop, pin) and clean shutdown.

mod common;

use std::time::{Duration, Instant};

use common::*;
use hyperoffload::pager::HintError;
use hyperoffload::policy::{BlockRef, FaultEvent, PrefetchKind, PrefetchPolicy, PrefetchRequest};
use hyperoffload::{MapOptions, Pager};

fn scan(bytes: &[u8]) {
    for (i, &byte) in bytes.iter().enumerate().step_by(997) {
        assert_eq!(byte, pattern_byte(i as u64), "byte {i}");
    }
}

/// Unmaps the second page of `region` (inside block 0), maps a page of 0xAB of our own
/// in its place, and reads every other part of the region's first `len` bytes twice
/// over. Returns our page's address.
fn cut_a_page_and_read_around_it(region: &hyperoffload::Region, len: usize) -> usize {
    let base = region.as_ptr() as usize;
    region.unmap_part(4096..8192).unwrap();
    // SAFETY: MAP_FIXED_NOREPLACE only succeeds if nothing is mapped there.
    let reused = unsafe {
        hyperoffload::sys::memory::mmap(
            base + 4096,
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
            None,
            0,
        )
    }
    .expect("the unmapped page can be mapped again");
    // SAFETY: `reused` is our own fresh read-write mapping.
    unsafe { std::ptr::write_bytes(reused as *mut u8, 0xAB, 4096) };
    for _ in 0..2 {
        for offset in (8192..len).step_by(4093).chain([0, 4095]) {
            // SAFETY: offsets outside the unmapped page of the live region.
            let byte = unsafe { *(base as *const u8).add(offset) };
            assert_eq!(byte, pattern_byte(offset as u64), "offset {offset}");
        }
    }
    reused
}

/// Asserts that the page `cut_a_page_and_read_around_it` mapped kept its bytes.
fn assert_our_page_untouched(reused: usize) {
    // SAFETY: still our mapping.
    let page = unsafe { std::slice::from_raw_parts(reused as *const u8, 4096) };
    assert!(
        page.iter().all(|&b| b == 0xAB),
        "the pager touched a mapping it does not own"
    );
}

#[test]
fn pinned_blocks_stay_resident_through_scans_larger_than_the_budget() {
    let dir = TempDir::new("pin");
    let path = dir.path("f.bin");
    pattern_file(&path, 32 << 20);
    let Some(pager) = pager_or_skip(Pager::builder().budget(8 << 20).block_size(64 << 10)) else {
        return;
    };
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    let pinned = (1 << 20)..(3 << 20);
    region.pin(pinned.clone()).unwrap();
    for _ in 0..3 {
        scan(region.as_slice());
    }
    let base = region.as_ptr() as usize;
    let resident = resident_pages(
        base + pinned.start as usize,
        (pinned.end - pinned.start) as usize,
    );
    assert!(resident.iter().all(|&r| r), "a pinned page was evicted");
    let stats = pager.stats();
    assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
    assert_eq!(stats.pinned_bytes, 2 << 20);
    assert!(stats.evictions > 0 && stats.peak_resident_bytes <= 8 << 20);
    // Unpinned, they are evictable again.
    region.unpin(pinned.clone()).unwrap();
    for _ in 0..2 {
        scan(region.as_slice());
    }
    let resident = resident_pages(
        base + pinned.start as usize,
        (pinned.end - pinned.start) as usize,
    );
    assert!(
        resident.iter().any(|&r| !r),
        "unpinned pages were never evicted"
    );
}

#[test]
fn pinning_beyond_the_budget_is_an_error() {
    let dir = TempDir::new("pin-too-much");
    let path = dir.path("f.bin");
    pattern_file(&path, 16 << 20);
    let Some(pager) = pager_or_skip(Pager::builder().budget(4 << 20).block_size(64 << 10)) else {
        return;
    };
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    let error = region.pin(0..4 << 20).unwrap_err();
    assert!(
        matches!(error, HintError::PinExceedsBudget { .. }),
        "{error}"
    );
    region.pin(0..3 << 20).unwrap();
    let error = region.pin(8 << 20..10 << 20).unwrap_err();
    assert!(
        matches!(error, HintError::PinExceedsBudget { .. }),
        "{error}"
    );
    let error = region.pin(0..17 << 20).unwrap_err();
    assert!(matches!(error, HintError::OutOfRange { .. }), "{error}");
    // The pager still serves everything with the one free megabyte.
    scan(region.as_slice());
}

#[test]
fn dropped_ranges_fault_back_in_with_the_same_bytes() {
    let dir = TempDir::new("drop");
    let path = dir.path("f.bin");
    pattern_file(&path, 4 << 20);
    let Some(pager) = pager_or_skip(Pager::builder().budget(8 << 20)) else {
        return;
    };
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    scan(region.as_slice());
    let base = region.as_ptr() as usize;
    assert!(resident_pages(base, 4 << 20).iter().all(|&r| r));
    region.drop_range(1 << 20..2 << 20).unwrap();
    let resident = resident_pages(base, 4 << 20);
    assert!(
        resident[256..512].iter().all(|&r| !r),
        "dropped pages are still resident"
    );
    assert!(
        resident[..256].iter().all(|&r| r),
        "pages outside the range were dropped"
    );
    scan(region.as_slice());
    assert!(pager.stats().dropped_blocks > 0);
}

#[test]
fn prefetch_reads_ahead_of_the_program() {
    let dir = TempDir::new("prefetch");
    let path = dir.path("f.bin");
    pattern_file(&path, 8 << 20);
    let Some(pager) = pager_or_skip(
        Pager::builder()
            .budget(16 << 20)
            .prefetch(PrefetchKind::None.build()),
    ) else {
        return;
    };
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    region.prefetch(0..8 << 20).unwrap();
    let base = region.as_ptr() as usize;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !resident_pages(base, 8 << 20).iter().all(|&r| r) {
        assert!(Instant::now() < deadline, "prefetch never completed");
        std::thread::sleep(Duration::from_millis(5));
    }
    scan(region.as_slice());
    let stats = pager.stats();
    assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
    assert_eq!(
        stats.faults,
        0,
        "every page was prefetched: {}",
        stats.to_json()
    );
    assert_eq!(stats.blocks_prefetched, stats.blocks_read);
}

#[test]
fn dropping_the_pager_stops_its_thread_and_unmaps() {
    if is_child() {
        let path = std::env::var("TEST_FILE").unwrap();
        let threads = || {
            std::fs::read_dir("/proc/self/task")
                .unwrap()
                .filter(|task| {
                    let comm = task.as_ref().unwrap().path().join("comm");
                    std::fs::read_to_string(comm).unwrap().trim() == "hyperoffload-fa"
                })
                .count()
        };
        let pager = pager_or_skip(Pager::builder().budget(1 << 20)).unwrap();
        let region = pager
            .map_file(path.as_ref(), MapOptions::default())
            .unwrap();
        scan(region.as_slice());
        let base = region.as_ptr() as usize;
        assert_eq!(threads(), 1);
        drop(region);
        drop(pager);
        assert_eq!(threads(), 0, "the service thread outlived its pager");
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        assert!(
            !maps.contains(&format!("{base:x}-")),
            "the region is still mapped"
        );
        return;
    }
    let dir = TempDir::new("shutdown");
    let path = dir.path("f.bin");
    pattern_file(&path, 4 << 20);
    let status = run_child(
        "dropping_the_pager_stops_its_thread_and_unmaps",
        &[("TEST_FILE", path.display().to_string())],
        Duration::from_secs(60),
    );
    assert!(status.success(), "child ended with {status}");
}

#[test]
fn unmapping_part_of_a_region_keeps_the_rest_and_spares_a_reused_hole() {
    let dir = TempDir::new("unmap-part");
    let path = dir.path("f.bin");
    pattern_file(&path, 8 << 20);
    let Some(pager) = pager_or_skip(Pager::builder().budget(2 << 20)) else {
        return;
    };
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    let base = region.as_ptr() as usize;
    scan(&region.as_slice()[..4 << 20]);
    // Unmap 2..3 MiB (after reading it) and the last page-unaligned tail.
    region.unmap_part(2 << 20..3 << 20).unwrap();
    region.unmap_part((7 << 20) + 100..8 << 20).unwrap();
    assert!(!region.fully_unmapped());
    // The hole is really gone: map something else exactly there.
    // SAFETY: MAP_FIXED_NOREPLACE only succeeds if nothing is mapped there.
    let reused = unsafe {
        hyperoffload::sys::memory::mmap(
            base + (2 << 20),
            1 << 20,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
            None,
            0,
        )
    }
    .expect("the unmapped hole can be mapped again");
    assert_eq!(reused, base + (2 << 20));
    // SAFETY: `reused` is our own fresh read-write mapping.
    unsafe { std::ptr::write_bytes(reused as *mut u8, 0xAB, 1 << 20) };
    // The rest still reads the file, twice over the budget.
    for _ in 0..2 {
        for range in [0..2 << 20, 3 << 20..7 << 20] {
            for offset in range.step_by(4093) {
                // SAFETY: offsets outside the unmapped parts of the live region.
                let byte = unsafe { *(base as *const u8).add(offset) };
                assert_eq!(byte, pattern_byte(offset as u64));
            }
        }
    }
    drop(region);
    // Dropping the region left the reused hole alone.
    // SAFETY: still our mapping.
    assert_eq!(unsafe { *((reused + 4096) as *const u8) }, 0xAB);
    // SAFETY: our mapping, no longer used.
    unsafe { hyperoffload::sys::memory::munmap(reused, 1 << 20) }.unwrap();
}

#[test]
fn evicting_a_block_cut_by_an_unmap_spares_what_is_mapped_in_the_hole() {
    // llama.cpp unmaps the unused head and tail of a model mapping after loading; with
    // blocks larger than a page that cuts blocks, and the freed pages can be handed to
    // the next mmap (a thread stack, a malloc arena). Evicting the cut block must not
    // drop those pages: MADV_DONTNEED on them would zero another mapping's memory.
    let dir = TempDir::new("unmap-cut");
    let path = dir.path("f.bin");
    pattern_file(&path, 8 << 20);
    let Some(pager) = pager_or_skip(Pager::builder().budget(1 << 20).block_size(64 << 10)) else {
        return;
    };
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    scan(&region.as_slice()[..512 << 10]);
    // One page in the middle of block 0, which is resident; reading the rest of the
    // file twice over evicts block 0 and reads it back.
    let reused = cut_a_page_and_read_around_it(&region, 8 << 20);
    assert!(pager.stats().evictions > 0);
    assert_our_page_untouched(reused);
    drop(region);
    // SAFETY: our mapping, no longer used.
    unsafe { hyperoffload::sys::memory::munmap(reused, 4096) }.unwrap();
}

#[test]
fn zero_copy_regions_keep_pins_drops_and_the_holes_the_program_cuts() {
    let dir = TempDir::new("zero-copy-hints");
    let path = dir.path("f.bin");
    pattern_file(&path, (32 << 20) + 5000);
    let Some(pager) = zero_copy_pager(8 << 20) else {
        return;
    };
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    let base = region.as_ptr() as usize;
    // Pinned blocks stay through scans four times the budget.
    let pinned = (2 << 20)..(4 << 20);
    region.pin(pinned.clone()).unwrap();
    for _ in 0..2 {
        scan(region.as_slice());
    }
    let resident = resident_pages(base + pinned.start as usize, 2 << 20);
    assert!(resident.iter().all(|&r| r), "a pinned page was evicted");
    // A dropped range leaves memory and faults back in with the same bytes.
    let check_dropped = |region: &hyperoffload::Region| {
        for offset in (6 << 20..8 << 20).step_by(997) {
            assert_eq!(region.as_slice()[offset], pattern_byte(offset as u64));
        }
    };
    check_dropped(&region);
    region.drop_range(6 << 20..8 << 20).unwrap();
    let resident = resident_pages(base + (6 << 20), 2 << 20);
    assert!(
        resident.iter().all(|&r| !r),
        "dropped pages are still mapped"
    );
    check_dropped(&region);
    // A page the program unmaps in block 0 and maps again is never touched.
    let reused = cut_a_page_and_read_around_it(&region, 32 << 20);
    let stats = pager.stats();
    assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
    assert!(
        stats.evictions > 0 && stats.peak_resident_bytes <= 8 << 20,
        "{}",
        stats.to_json()
    );
    assert_our_page_untouched(reused);
    drop(region);
    // SAFETY: our mapping, no longer used.
    unsafe { hyperoffload::sys::memory::munmap(reused, 4096) }.unwrap();
}

/// The kernel function thread `tid` of this process sleeps in (`0` when running).
fn wchan(tid: i32) -> String {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/wchan")).unwrap_or_default()
}

/// The thread id of the pager's service thread (named `hyperoffload-fa...`).
fn service_thread() -> i32 {
    let tids: Vec<i32> = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|task| {
            let task = task.unwrap();
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap();
            (comm.trim() == "hyperoffload-fa").then(|| task.file_name().to_str()?.parse().ok())?
        })
        .collect();
    assert_eq!(tids.len(), 1, "one service thread");
    tids[0]
}

/// Waits (at most 10 s) until thread `tid` sleeps in a kernel function whose name
/// contains `function`; `what` says what that means, for the failure.
fn wait_until_sleeping_in(tid: i32, function: &str, what: &str) -> Instant {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if wchan(tid).contains(function) {
            return Instant::now();
        }
        assert!(
            Instant::now() < deadline,
            "{what}: thread {tid} never slept in {function} (it is in {:?})",
            wchan(tid)
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A thread waits on a block, and the program unmaps that block before it is read. The
/// waiter used to be forgotten, asleep in the kernel for good; woken, it faults on
/// unmapped memory: SIGSEGV, as without a pager. The service is held up by a slow read
/// (injected delay): the test sees it asleep in that delay, then sees the waiter asleep
/// on its fault (`handle_userfault`), and only then unmaps, so both the wait and the
/// unmap reach the service before the block's read, every time.
#[test]
fn a_thread_waiting_on_a_block_the_program_unmaps_is_woken() {
    let test = "a_thread_waiting_on_a_block_the_program_unmaps_is_woken";
    if !is_child() {
        let status = run_child(test, &[], Duration::from_secs(60));
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            status.signal(),
            Some(libc::SIGSEGV),
            "{test}: the waiting thread should fault on the unmapped block: {status}"
        );
        return;
    }
    const DELAY: Duration = Duration::from_secs(2);
    let dir = TempDir::new("unmap-waiter");
    let path = dir.path("f.bin");
    pattern_file(&path, 16 << 20);
    let builder = Pager::builder()
        .budget(8 << 20)
        .block_size(1 << 20)
        .inject_read_delay(DELAY);
    let Some(pager) = pager_or_skip(builder) else {
        // Skipped: end the way the parent expects.
        // SAFETY: raising a signal in this child process ends it, as intended.
        unsafe { libc::raise(libc::SIGSEGV) };
        return;
    };
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    let base = region.as_ptr() as usize;
    let service = service_thread();
    let read_at = move |offset: usize| {
        let (tid, reader_tid) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            // SAFETY: gettid(2) has no preconditions.
            tid.send(unsafe { libc::gettid() }).unwrap();
            // SAFETY: a byte of the live region (unmapped by the test only for the
            // second reader, which is the point).
            unsafe { std::ptr::read_volatile((base + offset) as *const u8) }
        });
        (reader, reader_tid.recv().unwrap())
    };
    // The first read holds the service in its injected delay...
    let (first, first_tid) = read_at(0);
    wait_until_sleeping_in(first_tid, "handle_userfault", "the first reader's fault");
    let delayed = wait_until_sleeping_in(service, "nanosleep", "the service's injected delay");
    // ...while a second thread faults on block 12 and the program unmaps that block.
    let (waiter, waiter_tid) = read_at(12 << 20);
    wait_until_sleeping_in(waiter_tid, "handle_userfault", "the waiter's fault");
    // Both must reach the service within the first delay: after it the service could
    // read block 12 before it learns of the unmap.
    assert!(
        delayed.elapsed() < DELAY / 2,
        "the waiter took {:?} to fault: too slow to reach the service within its delay",
        delayed.elapsed()
    );
    region.unmap_part((12 << 20)..(13 << 20)).unwrap();
    assert_eq!(first.join().unwrap(), pattern_byte(0));
    // The woken waiter faults on nothing and the process dies of SIGSEGV; a forgotten
    // one sleeps, and the parent's limit fails the test.
    let _ = waiter.join();
    panic!("the waiting thread read an unmapped block");
}

/// Plans a prefetch marker (`Install::OnFault`) for one block when block 0 faults.
struct MarksBlock(u32);

impl PrefetchPolicy for MarksBlock {
    fn name(&self) -> &'static str {
        "marks-block"
    }

    fn plan(&mut self, fault: &FaultEvent, out: &mut Vec<PrefetchRequest>) {
        if fault.block.index == 0 {
            let marked = BlockRef::new(fault.block.region, self.0);
            out.push(PrefetchRequest::marker(marked));
        }
    }
}

/// The program unmaps a block while the read of its prefetch marker is in flight, as a
/// program closing a mapping with prefetches on the device does. The read finishes
/// without holding the block back: held back, a block the program unmapped would take
/// `Staged` from `Unmapped`, which no transition allows (`invariant_breaches`), and
/// keep its frame or stash buffer for a fault that never comes. With one read slot, the
/// marker's read is issued only once block 0's read is installed; the test unmaps the
/// marker's block while the service sleeps in block 0's slow read (injected delay), so
/// the unmap reaches the service after the marker's read is issued and before its
/// completion, every time. Copied in (stash) and with zero copy (frames).
#[test]
fn a_marker_the_program_unmaps_while_it_is_read_is_not_held_back() {
    let test = "a_marker_the_program_unmaps_while_it_is_read_is_not_held_back";
    if !in_child_process(test, Duration::from_secs(60)) {
        return;
    }
    const DELAY: Duration = Duration::from_millis(300);
    const BLOCK: u64 = 2 << 20;
    const MARKED: u32 = 4;
    let dir = TempDir::new("unmap-marker");
    let path = dir.path("f.bin");
    pattern_file(&path, 8 * BLOCK);
    for zero_copy in [false, true] {
        let builder = Pager::builder()
            .budget(8 * BLOCK)
            .block_size(BLOCK)
            .queue_depth(1)
            .zero_copy(zero_copy)
            .prefetch(Box::new(MarksBlock(MARKED)))
            .inject_read_delay(DELAY);
        let Some(pager) = pager_or_skip(builder) else {
            return;
        };
        assert_eq!(pager.stats().zero_copy, zero_copy);
        let region = pager.map_file(&path, MapOptions::default()).unwrap();
        let base = region.as_ptr() as usize;
        let service = service_thread();
        let reader = std::thread::spawn(move || {
            // SAFETY: a byte of block 0 of the live region, never unmapped.
            unsafe { std::ptr::read_volatile(base as *const u8) }
        });
        wait_until_sleeping_in(service, "nanosleep", "block 0's injected delay");
        let marked = MARKED as u64 * BLOCK;
        region.unmap_part(marked..marked + BLOCK).unwrap();
        assert_eq!(reader.join().unwrap(), pattern_byte(0));
        let deadline = Instant::now() + Duration::from_secs(10);
        while pager.stats().blocks_read < 2 {
            assert!(
                Instant::now() < deadline,
                "the marker's read never finished"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let stats = pager.stats();
        assert_eq!(stats.read_requests, 2, "{}", stats.to_json());
        assert_eq!(
            stats.invariant_breaches,
            0,
            "zero copy {zero_copy}: {}",
            stats.to_json()
        );
        drop(region);
        drop(pager);
    }
}

/// A child forked from a program that uses the library has a copy of the pager but no
/// service thread, and no regions (MADV_DONTFORK). Its calls used to wait forever for a
/// service that is not there; dropping its copies could have unregistered the parent's
/// region (the userfaultfd is shared). Now they answer at once, and the parent is
/// untouched.
#[test]
fn a_forked_child_gets_answers_not_hangs_and_leaves_the_parents_region_alone() {
    let test = "a_forked_child_gets_answers_not_hangs_and_leaves_the_parents_region_alone";
    if !in_child_process(test, Duration::from_secs(60)) {
        return;
    }
    let dir = TempDir::new("forked-library");
    let path = dir.path("f.bin");
    pattern_file(&path, 16 << 20);
    let Some(pager) = pager_or_skip(Pager::builder().budget(4 << 20).block_size(1 << 20)) else {
        return;
    };
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    scan(region.as_slice());
    // SAFETY: the child below only calls the pager (which must not take locks or wait
    // there) and ends with _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        // Answered from the snapshot the fork copied (published every 100 ms).
        let _ = pager.stats();
        let pinned = region.pin(0..1 << 20);
        let mapped = pager.map_file(&path, MapOptions::default()).err();
        let dropped = region.drop_range(0..1 << 20);
        // One bit per wrong answer, in the exit status.
        let wrong = !matches!(pinned, Err(HintError::ForkedChild { .. })) as i32
            | (!matches!(mapped, Some(hyperoffload::MapError::ForkedChild { .. })) as i32) << 1
            | (!matches!(dropped, Err(HintError::ForkedChild { .. })) as i32) << 2;
        drop(region);
        drop(pager);
        // SAFETY: ends the child without running the parent's exit handlers.
        unsafe { libc::_exit(wrong) };
    }
    let mut status = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        // SAFETY: waits for our own child without blocking.
        let done = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if done == pid {
            break;
        }
        if Instant::now() > deadline {
            // SAFETY: kills our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("the forked child hung calling the pager");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the forked child's calls answered wrongly: status {status:#x}"
    );
    // Still registered and served here: evicted blocks come back with the file's bytes.
    for _ in 0..2 {
        scan(region.as_slice());
    }
    assert!(pager.stats().evictions > 0);
}
