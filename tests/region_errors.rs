//! Bad input gets a clear error; read errors and accesses past the end of the file
//! reach the faulting thread as SIGBUS, never as wrong bytes and never as a hang.

mod common;

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use common::*;
use hyperoffload::{MapError, MapOptions, Pager, PagerError};

fn pager() -> Option<Pager> {
    pager_or_skip(Pager::builder().budget(4 << 20))
}

#[test]
fn a_read_error_reaches_the_faulting_thread_as_sigbus() {
    read_error_raises_sigbus("a_read_error_reaches_the_faulting_thread_as_sigbus", false);
}

#[test]
fn a_read_error_raises_sigbus_without_copying_too() {
    read_error_raises_sigbus("a_read_error_raises_sigbus_without_copying_too", true);
}

fn read_error_raises_sigbus(test: &str, zero_copy: bool) {
    if is_child() {
        let path = std::env::var("TEST_FILE").unwrap();
        let mut builder = Pager::builder()
            .budget(4 << 20)
            .inject_read_error(5 << 20..(5 << 20) + 1, libc::EIO);
        if zero_copy {
            builder = builder.block_size(2 << 20).zero_copy(true);
        }
        let pager = pager_or_skip(builder).unwrap();
        assert_eq!(pager.stats().zero_copy, zero_copy);
        let region = pager
            .map_file(path.as_ref(), MapOptions::default())
            .unwrap();
        // Bytes before the bad range read fine.
        assert_eq!(region.as_slice()[4096], pattern_byte(4096));
        eprintln!("touching the bad block");
        let byte = std::hint::black_box(region.as_slice()[(5 << 20) + 100]);
        panic!("read {byte} from a block whose read failed: wrong data instead of SIGBUS");
    }
    let dir = TempDir::new("eio");
    let path = dir.path("f.bin");
    pattern_file(&path, 8 << 20);
    let status = run_child(
        test,
        &[("TEST_FILE", path.display().to_string())],
        Duration::from_secs(60),
    );
    assert_eq!(
        status.signal(),
        Some(libc::SIGBUS),
        "child ended with {status}"
    );
}

#[test]
fn a_whole_page_past_the_end_of_the_file_raises_sigbus() {
    past_the_end_raises_sigbus("a_whole_page_past_the_end_of_the_file_raises_sigbus", false);
}

#[test]
fn past_the_end_raises_sigbus_without_copying_too() {
    past_the_end_raises_sigbus("past_the_end_raises_sigbus_without_copying_too", true);
}

fn past_the_end_raises_sigbus(test: &str, zero_copy: bool) {
    if is_child() {
        let path = std::env::var("TEST_FILE").unwrap();
        let pager = match zero_copy {
            false => pager().unwrap(),
            true => pager_or_skip(
                Pager::builder()
                    .budget(4 << 20)
                    .block_size(2 << 20)
                    .zero_copy(true),
            )
            .unwrap(),
        };
        assert_eq!(pager.stats().zero_copy, zero_copy);
        let region = pager
            .map_file(
                path.as_ref(),
                MapOptions {
                    map_len: Some(4 * 4096),
                    ..Default::default()
                },
            )
            .unwrap();
        // SAFETY: the mapping is four pages long.
        let mapping = unsafe { std::slice::from_raw_parts(region.as_ptr(), 4 * 4096) };
        assert_eq!(mapping[5000], pattern_byte(5000));
        assert_eq!(
            mapping[4096 + 2000],
            0,
            "the rest of the last data page is zeros"
        );
        let byte = std::hint::black_box(mapping[2 * 4096 + 1]);
        panic!("read {byte} past the end of the file instead of SIGBUS");
    }
    let dir = TempDir::new("eof");
    let path = dir.path("f.bin");
    pattern_file(&path, 4096 + 1000);
    let status = run_child(
        test,
        &[("TEST_FILE", path.display().to_string())],
        Duration::from_secs(60),
    );
    assert_eq!(
        status.signal(),
        Some(libc::SIGBUS),
        "child ended with {status}"
    );
}

#[test]
fn a_read_error_on_another_block_leaves_the_rest_readable() {
    let dir = TempDir::new("eio-partial");
    let path = dir.path("f.bin");
    pattern_file(&path, 8 << 20);
    let Some(pager) = pager_or_skip(
        Pager::builder()
            .budget(2 << 20)
            .inject_read_error(7 << 20..8 << 20, libc::EIO),
    ) else {
        return;
    };
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    // Sequential readahead runs into the bad range: a failed prefetch must not poison
    // anything or stop the pager.
    for (i, &byte) in region.as_slice()[..7 << 20].iter().enumerate() {
        assert_eq!(byte, pattern_byte(i as u64));
    }
    let stats = pager.stats();
    assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
    assert_eq!(stats.poisoned_pages, 0, "{}", stats.to_json());
}

#[test]
fn bad_files_and_ranges_are_refused_with_the_reason() {
    let Some(pager) = pager() else {
        return;
    };
    let dir = TempDir::new("bad");
    let message = |error: MapError| error.to_string();

    let missing = dir.path("missing.gguf");
    let error = pager
        .map_file(&missing, MapOptions::default())
        .err()
        .unwrap();
    assert!(matches!(error, MapError::Open(_)));
    assert!(message(error).contains("no such file"));

    let error = pager.map_file(&dir.0, MapOptions::default()).err().unwrap();
    assert!(message(error).contains("not a regular file"));

    let empty = dir.path("empty");
    std::fs::write(&empty, b"").unwrap();
    let error = pager.map_file(&empty, MapOptions::default()).err().unwrap();
    assert!(message(error).contains("empty"));

    let file = dir.path("f");
    pattern_file(&file, 10_000);
    let at = |offset, len| MapOptions {
        offset,
        len,
        ..Default::default()
    };
    let error = pager.map_file(&file, at(100, None)).err().unwrap();
    assert!(
        matches!(error, MapError::UnalignedOffset { offset: 100, .. }),
        "{error}"
    );
    let error = pager.map_file(&file, at(12_288, None)).err().unwrap();
    assert!(matches!(error, MapError::OutOfRange { .. }), "{error}");
    let error = pager.map_file(&file, at(4096, Some(6000))).err().unwrap();
    assert!(matches!(error, MapError::OutOfRange { .. }), "{error}");
    let error = pager.map_file(&file, at(0, Some(0))).err().unwrap();
    assert!(matches!(error, MapError::ZeroLength { .. }), "{error}");
    let error = pager
        .map_file(
            &file,
            MapOptions {
                map_len: Some(4096),
                ..Default::default()
            },
        )
        .err()
        .unwrap();
    assert!(matches!(error, MapError::MapTooShort { .. }), "{error}");
    let error = pager
        .map_file(
            &file,
            MapOptions {
                prot: libc::PROT_READ | libc::PROT_WRITE,
                ..Default::default()
            },
        )
        .err()
        .unwrap();
    assert!(matches!(error, MapError::Writable), "{error}");
    // A good range after all the bad ones still works.
    let region = pager.map_file(&file, at(4096, Some(5000))).unwrap();
    assert_eq!(region.as_slice()[0], pattern_byte(4096));
}

#[test]
fn bad_pager_settings_are_refused_with_the_reason() {
    let error = Pager::builder().budget(1000).build().err().unwrap();
    assert!(
        matches!(error, PagerError::BudgetTooSmall { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("smaller than one block"));
    let error = Pager::builder().block_size(3000).build().err().unwrap();
    assert!(matches!(error, PagerError::BadBlockSize(3000)), "{error}");
    let error = Pager::builder().block_size(1024).build().err().unwrap();
    assert!(matches!(error, PagerError::BadBlockSize(1024)), "{error}");
    let error = Pager::builder().queue_depth(0).build().err().unwrap();
    assert!(matches!(error, PagerError::BadQueueDepth), "{error}");
    let error = Pager::builder()
        .block_size(64 << 10)
        .max_read(100 << 10)
        .build()
        .err()
        .unwrap();
    assert!(matches!(error, PagerError::BadReadSize { .. }), "{error}");
}

#[test]
fn zero_copy_with_blocks_smaller_than_a_huge_page_copies_and_says_why() {
    let dir = TempDir::new("zero-copy-small-blocks");
    let path = dir.path("f.bin");
    pattern_file(&path, 1 << 20);
    let Some(pager) = pager_or_skip(
        Pager::builder()
            .budget(1 << 20)
            .block_size(64 << 10)
            .zero_copy(true),
    ) else {
        return;
    };
    let stats = pager.stats();
    assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
    assert!(!stats.zero_copy);
    let why = stats.zero_copy_refused.unwrap_or_default();
    assert!(why.contains("not whole 2 MiB pages"), "{why}");
    // And it serves the file, by copying.
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    for (i, &byte) in region.as_slice().iter().enumerate().step_by(4093) {
        assert_eq!(byte, pattern_byte(i as u64));
    }
}

/// Takes all but `spare` of this process's memory mappings (vm.max_map_count), as a
/// big program may: page-sized pieces of one reservation with alternating protections,
/// so that no two merge.
fn use_up_mappings_but(spare: u64) {
    let (limit, in_use) = hyperoffload::map_count::limit_and_in_use().unwrap();
    let pieces = (limit - in_use - spare) as usize;
    // SAFETY: a fresh private anonymous mapping at a kernel-chosen address.
    let base = unsafe {
        hyperoffload::sys::memory::mmap(
            0,
            pieces * 4096,
            libc::PROT_READ,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            None,
            0,
        )
    }
    .unwrap();
    for piece in (0..pieces).step_by(2) {
        // SAFETY: changes the protection of a page of our own fresh mapping.
        unsafe { hyperoffload::sys::memory::mprotect(base + piece * 4096, 4096, libc::PROT_NONE) }
            .unwrap();
    }
    let (_, now) = hyperoffload::map_count::limit_and_in_use().unwrap();
    assert!(
        now + spare + 2 >= limit,
        "mappings merged: {now} of {limit}"
    );
}

/// With zero copy each block touched is a mapping of its own, so a process can run out
/// of mappings (vm.max_map_count), and then mapping a frame failed and the service
/// stopped the program. A region that may not fit is refused up front, with the reason;
/// one that fits is served to the end.
#[test]
fn a_zero_copy_region_the_process_has_no_mappings_for_is_refused_up_front() {
    let test = "a_zero_copy_region_the_process_has_no_mappings_for_is_refused_up_front";
    if !in_child_process(test, Duration::from_secs(120)) {
        return;
    }
    let dir = TempDir::new("map-count");
    let (big, small) = (dir.path("big.bin"), dir.path("small.bin"));
    pattern_file(&big, 256 << 20);
    pattern_file(&small, 64 << 20);
    let Some(pager) = zero_copy_pager(16 << 20) else {
        return;
    };
    // Room for 200 mappings beyond the program's spare: 128 blocks may take 257.
    use_up_mappings_but(hyperoffload::map_count::SPARE_MAPPINGS + 200);
    match pager.map_file(&big, MapOptions::default()) {
        Err(error @ MapError::TooManyMappings { needed: 257, .. }) => {
            let message = error.to_string();
            assert!(message.contains("vm.max_map_count"), "{message}");
            assert!(message.contains("big.bin"), "{message}");
        }
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("a region that may need 257 mappings, with 200 to spare"),
    }
    // 32 blocks may take 65: mapped, and every block touched, in an order that keeps
    // frames from lining up, twice over a budget of 8 blocks.
    let region = pager.map_file(&small, MapOptions::default()).unwrap();
    let bytes = region.as_slice();
    for _ in 0..2 {
        for block in (0..32usize).rev().chain(0..32) {
            let offset = block * (2 << 20) + 4099;
            assert_eq!(
                bytes[offset],
                pattern_byte(offset as u64),
                "offset {offset}"
            );
        }
    }
    assert!(pager.stats().evictions > 0);
}
