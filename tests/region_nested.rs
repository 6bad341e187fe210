//! A region placed in a hole the program cut in another region of the same pager. Programs
//! unmap parts of model mappings (llama.cpp unmaps the head of its mapping), and the
//! kernel hands such holes to the next mapping, which may be another region: both must
//! be served, each with its own file's bytes, on either side of the inner one.
//!
//! Each case runs in a child process: a fault the service cannot place spins forever,
//! and the parent turns that into a failure.

mod common;

use std::ops::Range;
use std::path::Path;
use std::time::Duration;

use common::*;
use hyperoffload::{MapOptions, Pager, Region};

const OUTER_LEN: usize = 8 << 20;
const INNER_LEN: usize = 1 << 20;
/// The inner file's bytes are the pattern's from this offset on, so that a byte read
/// from the wrong region (at the same offset) is caught.
const INNER_SHIFT: u64 = 12345;

#[test]
fn a_region_in_a_hole_in_the_middle_of_another_is_served_and_so_is_the_rest() {
    nested_case(
        "a_region_in_a_hole_in_the_middle_of_another_is_served_and_so_is_the_rest",
        2 << 20,
    );
}

#[test]
fn a_region_in_a_hole_at_the_head_of_another_is_served_and_so_is_the_rest() {
    nested_case(
        "a_region_in_a_hole_at_the_head_of_another_is_served_and_so_is_the_rest",
        0,
    );
}

/// In the parent, runs test `test` as a child with the files it needs; in the child,
/// cuts a hole at `hole_start` and checks both regions.
fn nested_case(test: &str, hole_start: usize) {
    if is_child() {
        let outer = std::env::var("OUTER_FILE").unwrap();
        let inner = std::env::var("INNER_FILE").unwrap();
        check_nested(outer.as_ref(), inner.as_ref(), hole_start);
        return;
    }
    let dir = TempDir::new("nested");
    let outer = dir.path("outer.bin");
    let inner = dir.path("inner.bin");
    pattern_file(&outer, OUTER_LEN as u64);
    shifted_pattern_file(&inner, INNER_LEN, INNER_SHIFT);
    let status = run_child(
        test,
        &[
            ("OUTER_FILE", outer.display().to_string()),
            ("INNER_FILE", inner.display().to_string()),
        ],
        Duration::from_secs(60),
    );
    assert!(status.success(), "child ended with {status}");
}

fn check_nested(outer_path: &Path, inner_path: &Path, hole_start: usize) {
    // A budget below the two files' size: blocks of both are evicted and read again.
    let Some(pager) = pager_or_skip(Pager::builder().budget(4 << 20).block_size(64 << 10)) else {
        return;
    };
    let outer = pager.map_file(outer_path, MapOptions::default()).unwrap();
    let outer_base = outer.as_ptr() as usize;
    let hole = hole_start..hole_start + INNER_LEN;
    outer
        .unmap_part(hole.start as u64..hole.end as u64)
        .unwrap();
    let (inner, others) = map_at(&pager, inner_path, outer_base + hole.start);
    let live: Vec<Range<usize>> = [0..hole.start, hole.end..OUTER_LEN]
        .into_iter()
        .filter(|part| !part.is_empty())
        .collect();
    for _ in 0..2 {
        for part in &live {
            check_bytes(outer_base, part.clone(), 0);
        }
        check_bytes(inner.as_ptr() as usize, 0..INNER_LEN, INNER_SHIFT);
    }
    // With the inner region gone, the outer one still serves all it has left.
    drop(inner);
    drop(others);
    for part in &live {
        outer
            .drop_range(part.start as u64..part.end as u64)
            .unwrap();
        check_bytes(outer_base, part.clone(), 0);
    }
}

/// Maps `path` until the kernel places a region at `at`, and returns it with the copies
/// it placed elsewhere first (kept mapped, so the next attempt goes lower). There is no
/// fixed-address mapping in the API; the kernel takes the highest gap that fits, and the
/// hole is one. Gaps above it (memory other threads freed) are filled first, however
/// large: the attempts stop only once a copy lands below the hole, which means the
/// kernel passed it over.
fn map_at(pager: &Pager, path: &Path, at: usize) -> (Region, Vec<Region>) {
    let mut others = Vec::new();
    for _ in 0..16_384 {
        let region = pager.map_file(path, MapOptions::default()).unwrap();
        let placed = region.as_ptr() as usize;
        if placed == at {
            return (region, others);
        }
        others.push(region);
        if placed < at {
            break;
        }
    }
    let placed: Vec<String> = others
        .iter()
        .rev()
        .take(8)
        .map(|region| format!("{:#x}", region.as_ptr() as usize))
        .collect();
    panic!(
        "the kernel never placed a region at {at:#x} ({} copies placed, the last at {placed:?})",
        others.len()
    );
}

/// Reads `offsets` of the region at `base` (some bytes of every page, and both ends) and
/// compares them with the pattern `shift` bytes on.
fn check_bytes(base: usize, offsets: Range<usize>, shift: u64) {
    let ends = [offsets.start, offsets.end - 1];
    for offset in offsets.clone().step_by(4093).chain(ends) {
        // SAFETY: `offsets` is a live part of the region at `base`, which the caller keeps
        // mapped.
        let byte = unsafe { *(base as *const u8).add(offset) };
        assert_eq!(
            byte,
            pattern_byte(offset as u64 + shift),
            "offset {offset:#x} of the region at {base:#x}"
        );
    }
}

fn shifted_pattern_file(path: &Path, len: usize, shift: u64) {
    let bytes: Vec<u8> = (0..len as u64).map(|i| pattern_byte(i + shift)).collect();
    std::fs::write(path, bytes).unwrap();
}
