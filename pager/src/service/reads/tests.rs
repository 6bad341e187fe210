//! The read decisions without a ring or a kernel: what a completion asks for next, how
//! reads are counted against the queue and the device, which prefetch requests merge.

use super::*;
use crate::policy::{RegionId, Urgency};

const MIB: usize = 1 << 20;

/// A read's result that failed with `errno`, as the ring hands it on.
fn failed(errno: i32) -> io::Result<usize> {
    Err(io::Error::from_raw_os_error(errno))
}

fn tag(valid: usize) -> ReadTag {
    ReadTag {
        region: RegionId(1),
        first: 0,
        count: 1,
        file_offset: 0,
        len: valid.next_multiple_of(DIRECT_IO_ALIGN as usize),
        valid,
        done: 0,
        attempts: 1,
        submitted_ns: 0,
        reserved: 0,
        install: Install::Eager,
        prefetch: false,
    }
}

#[test]
fn a_whole_read_completes_and_a_short_one_continues_until_it_is_whole() {
    let mut whole = tag(MIB);
    assert_eq!(whole.step(&Ok(MIB), 3, true), ReadStep::Complete);
    assert_eq!(whole.done, MIB);

    let mut short = tag(MIB);
    assert_eq!(short.step(&Ok(4096), 3, true), ReadStep::Continue);
    assert_eq!(short.done, 4096);
    assert!(short.rest_is_aligned());
    assert_eq!(short.step(&Ok(100), 3, true), ReadStep::Continue);
    assert!(
        !short.rest_is_aligned(),
        "4196 bytes in: off O_DIRECT alignment"
    );
    assert_eq!(short.step(&Ok(MIB - 4196), 3, true), ReadStep::Complete);
    assert_eq!(short.done, MIB);
}

#[test]
fn a_read_past_the_data_is_complete_and_the_padding_does_not_count_as_missing() {
    // The request's length is aligned up; the file's data ends at `valid`.
    let mut tail = tag(5000);
    assert_eq!(tail.len, 8192);
    assert_eq!(tail.step(&Ok(5000), 3, true), ReadStep::Complete);
}

#[test]
fn end_of_file_before_the_data_means_the_file_shrank() {
    let mut read = tag(MIB);
    assert_eq!(read.step(&Ok(4096), 3, true), ReadStep::Continue);
    assert_eq!(read.step(&Ok(0), 3, true), ReadStep::FileShrank);
    assert_eq!(read.done, 4096, "nothing arrived");
}

#[test]
fn errors_are_retried_until_the_attempts_run_out() {
    let mut read = tag(MIB);
    assert_eq!(read.step(&failed(libc::EIO), 3, true), ReadStep::Retry);
    assert_eq!(read.attempts, 2);
    assert_eq!(read.step(&failed(libc::EIO), 3, true), ReadStep::Retry);
    assert_eq!(read.attempts, 3);
    assert_eq!(read.step(&failed(libc::EIO), 3, true), ReadStep::Fail);
    assert_eq!(read.done, 0);

    let mut once = tag(MIB);
    assert_eq!(once.step(&failed(libc::EIO), 1, true), ReadStep::Fail);
}

#[test]
fn an_interrupted_or_busy_read_is_retried_as_any_error_is() {
    for errno in [libc::EINTR, libc::EAGAIN] {
        let mut read = tag(MIB);
        assert_eq!(read.step(&failed(errno), 2, true), ReadStep::Retry);
        assert_eq!(read.step(&failed(errno), 2, true), ReadStep::Fail);
    }
}

#[test]
fn a_refused_direct_read_goes_buffered_without_spending_an_attempt() {
    let mut read = tag(MIB);
    assert_eq!(
        read.step(&failed(libc::EINVAL), 1, true),
        ReadStep::GoBuffered
    );
    assert_eq!(read.attempts, 1);
    // Read buffered already, EINVAL is an error like any other.
    assert_eq!(read.step(&failed(libc::EINVAL), 2, false), ReadStep::Retry);
    assert_eq!(read.step(&failed(libc::EINVAL), 2, false), ReadStep::Fail);
}

#[test]
fn prefetch_leaves_a_quarter_of_the_slots_to_demand() {
    let mut load = ReadLoad::default();
    for _ in 0..48 {
        assert!(load.prefetch_may_start(64, u64::MAX));
        load.issued(true, 4096);
    }
    assert!(!load.prefetch_may_start(64, u64::MAX), "48 of 64 slots");
    // Demand reads do not count against prefetch's share.
    load.issued(false, 4096);
    assert_eq!(load.demand_in_flight(), 1);
    load.finished(true);
    assert!(load.prefetch_may_start(64, u64::MAX));
    // A ring of one slot still prefetches.
    assert!(ReadLoad::default().prefetch_may_start(1, u64::MAX));
}

#[test]
fn prefetch_stops_at_the_device_share_until_the_device_answers() {
    let mut load = ReadLoad::default();
    load.issued(true, 3 * MIB as u64);
    assert!(load.prefetch_may_start(64, 4 * MIB as u64));
    load.issued(true, MIB as u64);
    assert!(
        !load.prefetch_may_start(64, 4 * MIB as u64),
        "4 MiB on the device"
    );
    // Answered, but not yet installed: no longer on the device.
    load.device_answered(true, MIB as u64);
    assert!(load.prefetch_may_start(64, 4 * MIB as u64));
    // A short read's rest goes back on the device.
    load.resubmitted(true, MIB as u64);
    assert!(!load.prefetch_may_start(64, 4 * MIB as u64));
    // Demand bytes never count.
    load.device_answered(false, 100 * MIB as u64);
    load.resubmitted(false, 100 * MIB as u64);
    assert!(!load.prefetch_may_start(64, 4 * MIB as u64));
}

#[test]
#[should_panic(expected = "a read finishes once")]
fn a_read_finished_twice_is_refused() {
    let mut load = ReadLoad::default();
    load.issued(false, 4096);
    load.finished(false);
    load.finished(false);
}

fn request(region: u32, index: u32, install: Install) -> PrefetchRequest {
    PrefetchRequest {
        block: BlockRef::new(RegionId(region), index),
        install,
        urgency: Urgency::Ahead,
    }
}

#[test]
fn following_requests_for_the_next_blocks_merge_into_one_read() {
    let queue: Vec<_> = (10..20).map(|i| request(1, i, Install::Eager)).collect();
    let merge = |max_blocks, block_count, queued: &dyn Fn(u32) -> bool| {
        merged_count(
            &queue[0],
            queue.iter().skip(1),
            max_blocks,
            block_count,
            queued,
        )
    };
    assert_eq!(merge(8, 100, &|_| true), 8, "at most max_blocks");
    assert_eq!(merge(64, 100, &|_| true), 10, "the whole run");
    assert_eq!(
        merge(64, 14, &|_| true),
        4,
        "not past the region's last block"
    );
    assert_eq!(
        merge(64, 100, &|i| i != 13),
        3,
        "up to a block no longer queued"
    );
}

#[test]
fn requests_of_other_regions_gaps_and_markers_end_a_merge() {
    let first = request(1, 10, Install::Eager);
    let cases = [
        (
            vec![
                request(1, 11, Install::Eager),
                request(2, 12, Install::Eager),
            ],
            2,
        ),
        (vec![request(1, 12, Install::Eager)], 1),
        (vec![request(1, 11, Install::OnFault)], 1),
        (vec![request(1, 9, Install::Eager)], 1),
    ];
    for (following, expected) in cases {
        let count = merged_count(&first, following.iter(), 64, 100, |_| true);
        assert_eq!(count, expected, "{following:?}");
    }
    // A marker stays alone whatever follows it.
    let marker = request(1, 10, Install::OnFault);
    let following = [request(1, 11, Install::OnFault)];
    assert_eq!(
        merged_count(&marker, following.iter(), 64, 100, |_| true),
        1
    );
}
