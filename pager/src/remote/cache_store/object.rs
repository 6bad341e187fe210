//! One cached object version on disk: its sparse data file, its index file (`cache_index`)
//! and its entries held in memory, opened from an earlier mount's files or created empty.
//! The cache (`cache_store`) decides what goes in and out; this is the files.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::super::cache_index::{self, Entry, Header, ENTRY_LEN};
use super::super::passthrough::Completeness;

/// A cached object version: what its index file says, and its two files open.
pub(super) struct Object {
    pub(super) header: Header,
    /// Where the entries start in the index file.
    pub(super) header_len: u64,
    /// One per block, as in the index file but for the last-use ticks (written on
    /// `Cache::flush`).
    pub(super) entries: Vec<Entry>,
    /// Whether this mount checked the block's CRC already.
    pub(super) verified: Vec<bool>,
    /// Shared with the reads and writes in progress, which use it outside the lock.
    pub(super) data: Arc<File>,
    pub(super) index: File,
    pub(super) stem: PathBuf,
}

impl Object {
    /// The bytes of block `block` (the last one may be short).
    pub(super) fn block_bytes(&self, block: u64) -> u64 {
        let start = block * self.header.block;
        (start + self.header.block).min(self.header.size) - start
    }

    /// Every block present and checked in this mount, present, or not.
    pub(super) fn completeness(&self) -> Completeness {
        if !self.entries.iter().all(Entry::present) {
            Completeness::Partial
        } else if self.verified.iter().all(|&v| v) {
            Completeness::Whole
        } else {
            Completeness::Unchecked
        }
    }

    /// Writes block `block`'s entry to the index file (one 16-byte write).
    pub(super) fn write_entry(&self, block: u64) -> io::Result<()> {
        let entry = self.entries[block as usize].encode();
        self.index
            .write_all_at(&entry, self.header_len + block * ENTRY_LEN as u64)
    }
}

/// The object whose files are `stem.idx` and `stem.data`, as an earlier mount left
/// them; an error if the index does not read or the data file is not the object's size.
pub(super) fn load(stem: &Path) -> io::Result<Object> {
    let index_path = stem.with_extension("idx");
    let bytes = std::fs::read(&index_path)?;
    let (header, header_len, entries) =
        cache_index::decode(&bytes).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    let index = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&index_path)?;
    let data = OpenOptions::new()
        .read(true)
        .write(true)
        .open(stem.with_extension("data"))?;
    if data.metadata()?.len() != header.size {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "data file of another size",
        ));
    }
    let entries = cache_index::padded(&header, entries)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    Ok(Object {
        verified: vec![false; entries.len()],
        header,
        header_len: header_len as u64,
        entries,
        data: Arc::new(data),
        index,
        stem: stem.to_path_buf(),
    })
}

/// A new object of `header` at `stem`, every block absent (any files there replaced).
pub(super) fn create(stem: &Path, header: Header) -> io::Result<Object> {
    let entries = cache_index::padded(&header, Vec::new())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let blocks = entries.len();
    remove(stem);
    let data = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(stem.with_extension("data"))?;
    data.set_len(header.size)?;
    let encoded = header.encode();
    let mut bytes = encoded.clone();
    bytes.resize(encoded.len() + blocks * ENTRY_LEN, 0);
    // The index is written whole under a temporary name and renamed, so an index file
    // always has a complete header.
    let tmp = stem.with_extension("idx.tmp");
    std::fs::write(&tmp, &bytes)?;
    std::fs::rename(&tmp, stem.with_extension("idx"))?;
    let index = OpenOptions::new()
        .read(true)
        .write(true)
        .open(stem.with_extension("idx"))?;
    Ok(Object {
        header_len: encoded.len() as u64,
        entries,
        verified: vec![false; blocks],
        header,
        data: Arc::new(data),
        index,
        stem: stem.to_path_buf(),
    })
}

/// Deletes the object's files at `stem`.
pub(super) fn remove(stem: &Path) {
    // The index goes first: data without an index is never read.
    let _ = std::fs::remove_file(stem.with_extension("idx"));
    let _ = std::fs::remove_file(stem.with_extension("data"));
}
