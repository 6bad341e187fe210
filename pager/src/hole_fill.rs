//! Filling a file-shaped region's file (`crate::shaped_region`) from the model file:
//! every hole gets the file's bytes, so that a process mapping it reads them without a
//! userfaultfd behind the mapping (a shared-memory fault on a hole would map a new page
//! of zeros). Used by the service before it stops while forked children live
//! (`service::outliving`) and by the keeper when the process that served them ended
//! without that (`crate::keeper`).
//!
//! Only the holes are written (`sys::files::holes`), with pwrite(2), which puts each page into
//! the file complete before any process can map it (the page is locked from allocation
//! until its bytes are in): a process touching a page meanwhile either faults as before
//! (a hole) or sees the whole page.

use std::ops::Range;
use std::os::fd::BorrowedFd;

/// Bytes read and written per step of a fill.
pub const FILL_CHUNK: u64 = 4 << 20;

/// Where a region's bytes come from: the model file, and the file offset of the
/// region's first byte.
#[derive(Clone, Copy)]
pub struct FillSource<'a> {
    pub file: BorrowedFd<'a>,
    pub file_offset: u64,
    /// Bytes of file data the region holds (the rest of its last page reads as zeros).
    pub data_len: u64,
}

/// The pieces (region offsets) to fill for `holes` of a region's file holding
/// `data_len` bytes of file data: each hole clipped to the data (the rest of the last
/// page reads as zeros once written, as a file mapping's does), cut into pieces of at
/// most `chunk` bytes.
pub fn fill_pieces(holes: &[Range<u64>], data_len: u64, chunk: u64) -> Vec<Range<u64>> {
    let mut pieces = Vec::new();
    for hole in holes {
        let end = hole.end.min(data_len);
        let mut at = hole.start;
        while at < end {
            let next = (at + chunk).min(end);
            pieces.push(at..next);
            at = next;
        }
    }
    pieces
}

/// What a fill did.
#[derive(Default, Debug)]
pub struct Filled {
    pub bytes: u64,
    /// The first failure, if any stopped part of the fill.
    pub error: Option<std::io::Error>,
}

/// Fills every hole of the first `shape_len` bytes of `shape` with the bytes `source`
/// gives, using `buffer` (`FILL_CHUNK` bytes).
pub fn fill_holes(
    shape: BorrowedFd<'_>,
    shape_len: u64,
    source: FillSource<'_>,
    buffer: &mut [u8],
) -> Filled {
    let mut filled = Filled::default();
    let holes = match crate::sys::files::holes(shape, shape_len) {
        Ok(holes) => holes,
        Err(error) => {
            filled.error = Some(error);
            return filled;
        }
    };
    for piece in fill_pieces(&holes, source.data_len, buffer.len() as u64) {
        let len = (piece.end - piece.start) as usize;
        let bytes = &mut buffer[..len];
        if let Err(error) = read_exact(source.file, bytes, source.file_offset + piece.start) {
            filled.error = Some(error);
            return filled;
        }
        if let Err(error) = write_all(shape, bytes, piece.start) {
            filled.error = Some(error);
            return filled;
        }
        filled.bytes += len as u64;
    }
    filled
}

/// Fills the page at region offset `offset` (`page` bytes) if it is a hole; returns the
/// bytes written (0: it held data already, or lies past the data).
pub fn fill_page(
    shape: BorrowedFd<'_>,
    source: FillSource<'_>,
    offset: u64,
    page: u64,
) -> std::io::Result<u64> {
    let end = (offset + page).min(source.data_len);
    if offset >= end || !crate::sys::files::is_hole(shape, offset)? {
        return Ok(0);
    }
    let mut bytes = vec![0u8; (end - offset) as usize];
    read_exact(source.file, &mut bytes, source.file_offset + offset)?;
    write_all(shape, &bytes, offset)?;
    Ok(bytes.len() as u64)
}

/// The 2 MiB-aligned piece of a region's file around region offset `offset`, clipped
/// to its `data_len` bytes of data (None past them): what a rewrite covers. A file of
/// huge pages allocates 2 MiB at a time, so one page written into a hole would leave
/// the other 511 present as zeros; and in a file read in place a page that is not a
/// hole may hold what a read left unfinished.
pub fn chunk_around(offset: u64, data_len: u64) -> Option<Range<u64>> {
    let start = offset - offset % crate::sys::memory::HUGE_PAGE;
    let end = (start + crate::sys::memory::HUGE_PAGE).min(data_len);
    (offset < data_len).then_some(start..end)
}

/// Writes the file's bytes over the whole chunk around `offset` (`chunk_around`),
/// holes and pages alike; returns the chunk (region offsets).
pub fn rewrite_chunk(
    shape: BorrowedFd<'_>,
    source: FillSource<'_>,
    offset: u64,
) -> std::io::Result<Range<u64>> {
    let chunk = chunk_around(offset, source.data_len).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("offset {offset} is past the region's data"),
        )
    })?;
    rewrite(shape, source, chunk.clone())?;
    Ok(chunk)
}

/// Writes the file's bytes over `range` (region offsets, within the data) of the
/// region's file, holes and pages alike.
pub fn rewrite(
    shape: BorrowedFd<'_>,
    source: FillSource<'_>,
    range: Range<u64>,
) -> std::io::Result<()> {
    let mut bytes = vec![0u8; (range.end - range.start) as usize];
    read_exact(source.file, &mut bytes, source.file_offset + range.start)?;
    write_all(shape, &bytes, range.start)
}

/// pread(2) until `buffer` is full; an end of file before that is an error.
pub fn read_exact(
    file: BorrowedFd<'_>,
    mut buffer: &mut [u8],
    mut offset: u64,
) -> std::io::Result<()> {
    while !buffer.is_empty() {
        match crate::sys::files::pread(file, buffer, offset)? {
            0 => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("the file ends before offset {offset}"),
                ))
            }
            n => {
                buffer = &mut buffer[n..];
                offset += n as u64;
            }
        }
    }
    Ok(())
}

/// pwrite(2) of all of `buffer` at `offset`.
pub fn write_all(fd: BorrowedFd<'_>, mut buffer: &[u8], mut offset: u64) -> std::io::Result<()> {
    while !buffer.is_empty() {
        let n = crate::sys::files::pwrite(fd, buffer, offset)?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        buffer = &buffer[n..];
        offset += n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn holes_are_clipped_to_the_data_and_cut_into_chunks() {
        let pieces = fill_pieces(&[0..4096, 8192..20480, 24576..32768], 28000, 8192);
        assert_eq!(
            pieces,
            vec![0..4096, 8192..16384, 16384..20480, 24576..28000]
        );
    }

    #[test]
    fn a_rewrite_covers_the_huge_page_around_the_offset_within_the_data() {
        let mib = 1 << 20;
        assert_eq!(chunk_around(0, 8 * mib), Some(0..2 * mib));
        assert_eq!(
            chunk_around(5 * mib + 4096, 8 * mib),
            Some(4 * mib..6 * mib)
        );
        assert_eq!(
            chunk_around(7 * mib, 7 * mib + 100),
            Some(6 * mib..7 * mib + 100)
        );
        assert_eq!(chunk_around(8 * mib, 8 * mib), None);
    }

    #[test]
    fn nothing_past_the_data_is_filled() {
        let past_the_data = vec![8192..12288, 12288..16384];
        assert!(fill_pieces(&past_the_data, 8192, 4096).is_empty());
        assert!(fill_pieces(&[], 8192, 4096).is_empty());
    }

    #[test]
    fn only_the_holes_get_the_files_bytes() {
        let page = crate::sys::memory::page_size();
        let source = crate::sys::files::memfd(c"source", 4 * page).unwrap();
        let bytes: Vec<u8> = (0..4 * page).map(|i| (i % 251) as u8).collect();
        write_all(source.as_fd(), &bytes, 0).unwrap();
        let shape = crate::sys::files::memfd(c"shape", 3 * page).unwrap();
        // Page 1 is data already (other bytes, which stay); pages 0 and 2 are holes.
        write_all(shape.as_fd(), &vec![7u8; page as usize], page).unwrap();
        let source = FillSource {
            file: source.as_fd(),
            file_offset: page,
            data_len: 3 * page - 100,
        };
        let mut buffer = vec![0u8; FILL_CHUNK as usize];
        let filled = fill_holes(shape.as_fd(), 3 * page, source, &mut buffer);
        assert!(filled.error.is_none(), "{:?}", filled.error);
        assert_eq!(filled.bytes, 2 * page - 100);
        let mut got = vec![0u8; 3 * page as usize];
        read_exact(shape.as_fd(), &mut got, 0).unwrap();
        let page = page as usize;
        assert_eq!(got[..page], bytes[page..2 * page]);
        assert!(got[page..2 * page].iter().all(|&b| b == 7));
        assert_eq!(
            got[2 * page..3 * page - 100],
            bytes[3 * page..4 * page - 100]
        );
        assert!(got[3 * page - 100..].iter().all(|&b| b == 0));
        assert!(crate::sys::files::holes(shape.as_fd(), 3 * page as u64)
            .unwrap()
            .is_empty());
    }
}
