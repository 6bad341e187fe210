//! The device yardstick (`hyperoffload bench`'s): it reads the whole file from the
//! device, whatever memory the reads land in, and names the file when it cannot.
//!
//! An integration test, not a unit test of the binary: it counts the storage reads of
//! the whole process, so it runs in a small process of its own. The yardstick belongs
//! to the binary; its file is compiled here.

mod common;

#[path = "../src/cli/device.rs"]
mod device;

use common::*;
use device::{drop_page_cache, read_rate, sequential_read_rate};

/// Bytes this process has had read from storage (`read_bytes` of /proc/self/io: reads
/// that reached the block layer, io_uring's worker threads included).
fn storage_read_bytes() -> u64 {
    let io = std::fs::read_to_string("/proc/self/io").unwrap();
    io.lines()
        .find_map(|line| line.strip_prefix("read_bytes: "))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn every_shape_reads_the_whole_file_from_the_device() {
    let dir = TempDir::new("device-rate");
    let path = dir.path("model.bin");
    // Not a multiple of the read size nor of a page: the last read is short.
    let len = (24 << 20) + 12_345;
    pattern_file(&path, len);
    // (what, read size, depth, landing room; None: the reads' own buffers)
    let shapes = [
        ("1 MiB x 32 into its own buffers", 1 << 20, 32, None),
        ("2 MiB x 2 across 16 MiB", 2 << 20, 2, Some(16 << 20)),
        (
            "1 MiB x 4, less landing room than reads in flight",
            1 << 20,
            4,
            Some(1 << 20),
        ),
    ];
    for (shape, chunk, depth, landing) in shapes {
        if !drop_page_cache() {
            if std::env::var("HYPEROFFLOAD_ALLOW_SKIP").as_deref() == Ok("1") {
                eprintln!("skipped: cannot drop the page cache (not root)");
                return;
            }
            panic!("cannot drop the page cache: run as root (or HYPEROFFLOAD_ALLOW_SKIP=1)");
        }
        // The file's inode (and with it its extents) read back first, so what is
        // counted below is the reads of its data.
        std::fs::File::open(&path).unwrap().metadata().unwrap();
        let before = storage_read_bytes();
        let rate = match landing {
            None => sequential_read_rate(&path, chunk, depth),
            Some(landing) => read_rate(&path, chunk, depth, landing),
        }
        .unwrap();
        let read = storage_read_bytes() - before;
        assert!(rate.is_finite() && rate > 0.0, "{shape}: rate {rate}");
        // Direct reads bypass the page cache, so they all reach the device: the file,
        // its last page rounded up.
        assert!(
            read == len.next_multiple_of(4096),
            "{shape}: {read} bytes from storage for a file of {len}"
        );
    }
}

#[test]
fn a_missing_file_is_named_in_the_error() {
    let dir = TempDir::new("device-rate-missing");
    let path = dir.path("no-such-model.gguf");
    let error = read_rate(&path, 1 << 20, 4, 8 << 20)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("no-such-model.gguf") && error.contains("O_DIRECT"),
        "{error}"
    );
}
