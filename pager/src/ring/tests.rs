use std::io::Write;
use std::os::fd::AsRawFd;

use super::*;

fn reaped(ring: &mut ReadRing<u32>) -> Vec<Completion> {
    let mut out = Vec::new();
    while out.is_empty() {
        ring.submit_and_wait(1).unwrap();
        ring.reap(&mut out);
    }
    out
}

/// The reads among `completions`: (slot, bytes or errno).
fn reads(completions: Vec<Completion>) -> Vec<(u32, Result<usize, Option<i32>>)> {
    completions
        .into_iter()
        .map(|completion| match completion {
            Completion::Read { slot, result } => {
                (slot, result.map_err(|error| error.raw_os_error()))
            }
            other => panic!("not a read: {other:?}"),
        })
        .collect()
}

/// The readiness among `completions`: (token, rearm).
fn readable(completions: Vec<Completion>) -> Vec<(u32, bool)> {
    completions
        .into_iter()
        .map(|completion| match completion {
            Completion::Readable { token, rearm } => (token, rearm),
            other => panic!("not a readiness: {other:?}"),
        })
        .collect()
}

#[test]
fn a_raw_result_is_bytes_or_the_errno_it_negates() {
    assert_eq!(read_result(4096).unwrap(), 4096);
    assert_eq!(read_result(0).unwrap(), 0, "end of file");
    assert_eq!(read_result(i32::MAX).unwrap(), i32::MAX as usize);
    for errno in [libc::EIO, libc::EINTR, libc::EAGAIN, libc::EINVAL, 4095] {
        let error = read_result(-errno).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(errno));
    }
}

#[test]
fn a_failed_read_is_reaped_as_its_error() {
    let (_read_end, write_end) = pipe();
    let mut ring: ReadRing<u32> = ReadRing::new(1, 4096).unwrap();
    let slot = ring.checkout().unwrap();
    // Reading the write end of a pipe: EBADF.
    ring.read(slot, write_end.as_raw_fd(), 0, 0, 4096, 1)
        .unwrap();
    assert_eq!(
        reads(reaped(&mut ring)),
        vec![(slot, Err(Some(libc::EBADF)))]
    );
    assert_eq!(ring.checkin(slot), Some(1));
}

#[test]
fn a_slot_lends_its_buffer_only_when_no_read_is_in_flight() {
    let mut file = tempfile();
    file.write_all(&[7u8; 4096]).unwrap();
    let mut ring: ReadRing<u32> = ReadRing::new(2, 4096).unwrap();
    let slot = ring.checkout().unwrap();
    ring.buffer_mut(slot).fill(1);
    ring.read(slot, file.as_raw_fd(), 0, 0, 4096, 42).unwrap();
    assert_eq!(ring.tag(slot), Some(&42));
    assert_eq!(reads(reaped(&mut ring)), vec![(slot, Ok(4096))]);
    assert!(ring.buffer(slot).iter().all(|&byte| byte == 7));
    // The rest of a request reuses the slot, its tag and its buffer.
    let tag = ring.reclaim(slot);
    ring.read(slot, file.as_raw_fd(), 0, 0, 10, tag + 1)
        .unwrap();
    assert_eq!(reads(reaped(&mut ring)), vec![(slot, Ok(10))]);
    assert_eq!(ring.reads_in_flight(), 1);
    assert_eq!(ring.checkin(slot), Some(43));
    assert_eq!(ring.reads_in_flight(), 0);
    assert_eq!(ring.checkout(), Some(slot));
}

#[test]
fn a_watch_is_readable_until_unwatched_and_the_unwatch_itself_is_not_reaped() {
    let (read_end, write_end) = pipe();
    let mut ring: ReadRing<u32> = ReadRing::new(1, 4096).unwrap();
    ring.watch(read_end.as_raw_fd(), 7).unwrap();
    std::fs::File::from(write_end).write_all(b"x").unwrap();
    assert_eq!(readable(reaped(&mut ring)), vec![(7, false)]);
    ring.unwatch(7).unwrap();
    // The poll's last completion says it ended; the removal's own says nothing.
    assert_eq!(readable(reaped(&mut ring)), vec![(7, true)]);
    let mut more = Vec::new();
    ring.submit_and_wait(0).unwrap();
    ring.reap(&mut more);
    assert!(more.is_empty(), "{more:?}");
}

#[test]
#[should_panic(expected = "while in flight")]
fn the_buffer_of_a_read_in_flight_is_refused() {
    let (read_end, _write_end) = pipe();
    let mut ring: ReadRing<u32> = ReadRing::new(1, 4096).unwrap();
    let slot = ring.checkout().unwrap();
    // Nothing is ever written to the pipe: the read stays in flight.
    ring.read(slot, read_end.as_raw_fd(), 0, 0, 4096, 1)
        .unwrap();
    ring.submit().unwrap();
    let _ = ring.buffer(slot);
}

#[test]
#[should_panic(expected = "checked in while in flight")]
fn a_slot_in_flight_cannot_be_freed() {
    let (read_end, _write_end) = pipe();
    let mut ring: ReadRing<u32> = ReadRing::new(1, 4096).unwrap();
    let slot = ring.checkout().unwrap();
    ring.read(slot, read_end.as_raw_fd(), 0, 0, 4096, 1)
        .unwrap();
    ring.submit().unwrap();
    ring.checkin(slot);
}

#[test]
fn slots_run_out_at_the_limit_and_come_back() {
    let mut ring: ReadRing<u32> = ReadRing::new(2, 4096).unwrap();
    let (a, b) = (ring.checkout().unwrap(), ring.checkout().unwrap());
    assert_ne!(a, b);
    assert!(!ring.has_free_slot());
    assert_eq!(ring.checkout(), None);
    assert_eq!(ring.checkin(a), None);
    assert_eq!(ring.checkout(), Some(a));
}

fn tempfile() -> std::fs::File {
    let path = std::env::temp_dir().join(format!("hyperoffload-ring-{}", std::process::id()));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    file
}

fn pipe() -> (std::os::fd::OwnedFd, std::os::fd::OwnedFd) {
    rustix::pipe::pipe().unwrap()
}
