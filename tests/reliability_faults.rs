//! Issue 7, fault injection: short and slow reads still deliver exactly the file's
//! bytes; a file truncated or modified in place while mapped gives SIGBUS (with one
//! message) for pages not read yet, never a mix of old and new bytes and never a hang;
//! a file replaced by rename keeps being served from the inode that was mapped; a
//! panicking fault service ends the process with a clear message instead of a hang.

mod common;

use std::io::Read;
use std::os::unix::fs::FileExt;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::*;
use hyperoffload::policy::PrefetchKind;
use hyperoffload::{MapOptions, Pager, PagerBuilder, Region};

/// Like `run_child`, but also returns the child's stderr (the service's messages).
fn run_child_stderr(test: &str, env: &[(&str, String)], limit: Duration) -> (ExitStatus, String) {
    let mut command = child_test_command(test);
    command.stderr(Stdio::piped());
    for (key, value) in env {
        command.env(key, value);
    }
    let mut child = command.spawn().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            let text = reader.join().unwrap();
            panic!("child test {test} hung for {limit:?}; its stderr:\n{text}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = reader.join().unwrap();
    eprintln!("--- child {test} ({status}) stderr ---\n{text}---");
    (status, text)
}

/// Checks every byte of `region[range]` against the pattern, in 64 KiB chunks.
fn check_bytes(region: &Region, range: std::ops::Range<usize>) {
    let bytes = region.as_slice();
    let mut at = range.start;
    while at < range.end {
        let end = (at + (64 << 10)).min(range.end);
        for (i, &byte) in bytes[at..end].iter().enumerate() {
            let offset = (at + i) as u64;
            assert_eq!(byte, pattern_byte(offset), "wrong byte at {offset:#x}");
        }
        at = end;
    }
}

fn test_file_env(path: &Path) -> [(&'static str, String); 1] {
    [("TEST_FILE", path.display().to_string())]
}

fn child_file() -> String {
    std::env::var("TEST_FILE").unwrap()
}

fn no_prefetch(budget: u64) -> PagerBuilder {
    Pager::builder()
        .budget(budget)
        .prefetch(PrefetchKind::None.build())
}

// ---- short and slow reads -------------------------------------------------------------

#[test]
fn short_reads_still_deliver_every_byte() {
    let dir = TempDir::new("short-reads");
    let path = dir.path("f.bin");
    // Not a multiple of a page: the last request ends inside a page.
    let len = (16 << 20) + 1234;
    pattern_file(&path, len);
    let Some(pager) = pager_or_skip(Pager::builder().budget(4 << 20).inject_short_reads(true))
    else {
        return;
    };
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    let started = Instant::now();
    // A sequential pass (merged prefetch reads of up to 1 MiB, each delivered in halves)
    // then random pages (single-block demand reads) after eviction.
    check_bytes(&region, 0..len as usize);
    let mut x = 0x1234_5678_u64;
    for _ in 0..500 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let page = (x >> 33) % (len / 4096);
        let start = (page * 4096) as usize;
        check_bytes(&region, start..(start + 4096).min(len as usize));
    }
    let stats = pager.stats();
    assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
    assert_eq!(stats.read_errors, 0);
    assert!(stats.bytes_read >= len, "{stats:?}");
    assert!(stats.peak_resident_bytes <= 4 << 20, "{stats:?}");
    eprintln!("short reads: {:?}, {stats:?}", started.elapsed());
}

#[test]
fn slow_reads_are_waited_for_not_lost() {
    let dir = TempDir::new("slow-reads");
    let path = dir.path("f.bin");
    let len: u64 = 4 << 20;
    pattern_file(&path, len);
    let delay = Duration::from_millis(5);
    let Some(pager) = pager_or_skip(
        Pager::builder()
            .budget(1 << 20)
            .max_read(64 << 10)
            .inject_read_delay(delay),
    ) else {
        return;
    };
    let region = std::sync::Arc::new(pager.map_file(&path, MapOptions::default()).unwrap());
    let started = Instant::now();
    // Four threads, each over its own quarter and then a neighbour's (shared blocks).
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let region = region.clone();
            std::thread::spawn(move || {
                let quarter = (len / 4) as usize;
                check_bytes(&region, t * quarter..(t + 1) * quarter);
                let next = (t + 1) % 4;
                check_bytes(&region, next * quarter..(next + 1) * quarter);
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    let elapsed = started.elapsed();
    let stats = pager.stats();
    assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
    // Each read completion was held `delay`: the knob really slowed the service.
    assert!(
        elapsed >= delay * stats.read_requests as u32 / 2,
        "{elapsed:?} for {} reads of {delay:?}",
        stats.read_requests
    );
    assert_eq!(stats.read_errors, 0);
    eprintln!("slow reads: {elapsed:?}, {} reads", stats.read_requests);
}

// ---- the file changes while mapped ----------------------------------------------------

#[test]
fn a_file_truncated_while_mapped_raises_sigbus_past_the_new_end() {
    if is_child() {
        let pager = pager_or_skip(no_prefetch(8 << 20)).unwrap();
        let region = pager
            .map_file(child_file().as_ref(), MapOptions::default())
            .unwrap();
        check_bytes(&region, 0..1 << 20);
        // Coarse timestamps: make sure the truncation gets a new mtime.
        std::thread::sleep(Duration::from_millis(20));
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(child_file())
            .unwrap();
        file.set_len(2 << 20).unwrap();
        // What was read before still reads the same (it is resident: the budget holds
        // the whole file).
        check_bytes(&region, 0..1 << 20);
        eprintln!("touching past the new end");
        let byte = std::hint::black_box(region.as_slice()[(6 << 20) + 100]);
        panic!("read {byte} past the end of a truncated file instead of SIGBUS");
    }
    let dir = TempDir::new("truncated");
    let path = dir.path("f.bin");
    pattern_file(&path, 8 << 20);
    let (status, stderr) = run_child_stderr(
        "a_file_truncated_while_mapped_raises_sigbus_past_the_new_end",
        &test_file_env(&path),
        Duration::from_secs(60),
    );
    assert_eq!(
        status.signal(),
        Some(libc::SIGBUS),
        "child ended with {status}"
    );
    assert!(stderr.contains("touching past the new end"), "{stderr}");
    assert!(
        stderr.contains("was modified while mapped (size 8388608 -> 2097152"),
        "{stderr}"
    );
}

#[test]
fn a_file_modified_in_place_while_mapped_raises_sigbus_not_new_bytes() {
    if is_child() {
        let pager = pager_or_skip(no_prefetch(8 << 20)).unwrap();
        let region = pager
            .map_file(child_file().as_ref(), MapOptions::default())
            .unwrap();
        check_bytes(&region, 0..64 << 10);
        std::thread::sleep(Duration::from_millis(20));
        // Rewrite 1..2 MiB in place (same inode, same size, new mtime).
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(child_file())
            .unwrap();
        file.write_all_at(&vec![0xA5; 1 << 20], 1 << 20).unwrap();
        check_bytes(&region, 0..64 << 10);
        eprintln!("touching a rewritten block");
        let byte = std::hint::black_box(region.as_slice()[(3 << 19) + 7]);
        panic!("read {byte:#x} from a file rewritten under the mapping instead of SIGBUS");
    }
    let dir = TempDir::new("modified");
    let path = dir.path("f.bin");
    pattern_file(&path, 4 << 20);
    let (status, stderr) = run_child_stderr(
        "a_file_modified_in_place_while_mapped_raises_sigbus_not_new_bytes",
        &test_file_env(&path),
        Duration::from_secs(60),
    );
    assert_eq!(
        status.signal(),
        Some(libc::SIGBUS),
        "child ended with {status}"
    );
    assert!(stderr.contains("touching a rewritten block"), "{stderr}");
    assert_eq!(
        stderr.matches("was modified while mapped").count(),
        1,
        "one message: {stderr}"
    );
}

#[test]
fn a_file_replaced_by_rename_keeps_serving_the_mapped_file() {
    if is_child() {
        let path = child_file();
        let pager = pager_or_skip(no_prefetch(1 << 20)).unwrap();
        let region = pager
            .map_file(path.as_ref(), MapOptions::default())
            .unwrap();
        check_bytes(&region, 0..64 << 10);
        std::thread::sleep(Duration::from_millis(20));
        // A new version, written aside and renamed over the mapped one.
        let new = format!("{path}.new");
        std::fs::write(&new, vec![0x5A; 4 << 20]).unwrap();
        std::fs::rename(&new, &path).unwrap();
        // Every byte, including blocks never read before and blocks evicted (the budget
        // is a quarter of the file), is the mapped version's.
        check_bytes(&region, 0..4 << 20);
        check_bytes(&region, 0..4 << 20);
        assert_eq!(pager.stats().read_errors, 0);
        return;
    }
    let dir = TempDir::new("replaced");
    let path = dir.path("f.bin");
    pattern_file(&path, 4 << 20);
    let (status, stderr) = run_child_stderr(
        "a_file_replaced_by_rename_keeps_serving_the_mapped_file",
        &test_file_env(&path),
        Duration::from_secs(60),
    );
    assert!(status.success(), "child ended with {status}");
    assert!(!stderr.contains("modified while mapped"), "{stderr}");
    // The path now holds the new version; the mapping never showed it.
    assert_eq!(std::fs::read(&path).unwrap()[100], 0x5A);
}

// ---- service death --------------------------------------------------------------------

#[test]
fn a_panicking_service_ends_the_process_with_a_message() {
    if is_child() {
        let pager = pager_or_skip(no_prefetch(4 << 20).inject_service_panic_after(20)).unwrap();
        let region = pager
            .map_file(child_file().as_ref(), MapOptions::default())
            .unwrap();
        let bytes = region.as_slice();
        let mut sum = 0u64;
        for page in 0..256 {
            sum += std::hint::black_box(bytes[page * 4096]) as u64;
        }
        panic!("256 faults served by a service that should have died after 20 ({sum})");
    }
    let dir = TempDir::new("service-panic");
    let path = dir.path("f.bin");
    pattern_file(&path, 4 << 20);
    let started = Instant::now();
    let (status, stderr) = run_child_stderr(
        "a_panicking_service_ends_the_process_with_a_message",
        &test_file_env(&path),
        Duration::from_secs(30),
    );
    assert_eq!(
        status.signal(),
        Some(libc::SIGABRT),
        "child ended with {status}"
    );
    assert!(
        stderr.contains(
            "the fault service failed and the process cannot continue: \
             injected panic after 20 faults"
        ),
        "{stderr}"
    );
    eprintln!("service death reported in {:?}", started.elapsed());
}
