//! The local cache tier of remote objects: a sparse data file per object version and its
//! index (`cache_index`), under one directory, bounded in size.
//!
//! Files are `v1/<fnv of name and version>.data` and `.idx`; a directory is used by one
//! mount at a time (an exclusive `flock` on `v1/lock`). Every block is in one of three
//! states: absent, being written (its bytes counted against the limit, not yet readable),
//! present (readable; its entry says so in the index file). An entry is written to the
//! index file after the block's bytes (write-through, one 16-byte `pwrite`), and cleared
//! in it before the block's bytes are punched out; the block's CRC in the entry is
//! checked the first time a mount reads the block, so a crash between the two writes,
//! or a power loss that kept the entry and lost the bytes, costs a fetch, never wrong
//! bytes. Last-use ticks are kept in memory and written on `flush`. One object
//! version's files are `object`'s; this module is the cache over them: what is stored,
//! read, evicted and held.
//!
//! Blocks being read (`pin`) are never evicted, so a read never sees a punched hole.
//!
//! An object opened with FUSE passthrough is *held* (`hold`) from then until the cache
//! is dropped: none of its blocks is evicted, punched or written again. The kernel
//! reads its data file directly then, outside any read the cache could pin, and a
//! program's mapping of it outlives the handle it came from (the kernel maps the cache
//! file itself and releases the mount's handle), so no later moment is known at which
//! the kernel stopped reading it. Only an object wholly present and CRC-checked in this
//! mount is held, so every byte the kernel reads has passed its check. Not covered: a
//! mapping that outlives the mount (its program runs on after the unmount) reads the
//! file still, and a later mount of the directory may evict those blocks under it.

use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use thiserror::Error;

use super::cache_index::{self, Entry, Header, ENTRY_LEN};
use super::eviction::{Candidate, EvictionOrder};
use super::passthrough::Completeness;
use object::{create, load, remove, Object};

mod object;

/// A cache directory that could not be used.
#[derive(Debug, Error)]
pub enum CacheError {
    #[error("cache directory {dir}: {source}")]
    Io {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cache directory {0} is in use by another mount (one mount per cache directory)")]
    Busy(PathBuf),
}

/// A cached object's number in its cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ObjectId(usize);

impl ObjectId {
    /// The number eviction candidates carry (`Candidate::object`).
    pub fn index(self) -> usize {
        self.0
    }
}

/// What the cache did, for the summary and the tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CacheStats {
    /// Bytes the cache holds now (blocks present or being written).
    pub used_bytes: u64,
    /// The limit.
    pub limit_bytes: u64,
    /// Bytes read from the cache (hits).
    pub hit_bytes: u64,
    /// Bytes written into the cache.
    pub stored_bytes: u64,
    /// Blocks evicted, and their bytes.
    pub evicted_blocks: u64,
    pub evicted_bytes: u64,
    /// Blocks whose bytes did not match their CRC when first read (fetched again).
    pub corrupt_blocks: u64,
    /// Blocks not stored because everything else was in use (or the limit is smaller
    /// than the block).
    pub not_stored_blocks: u64,
}

struct State {
    objects: Vec<Option<Object>>,
    pins: HashMap<(usize, u64), u32>,
    /// Objects held whole (`Cache::hold`): never an eviction candidate, never dropped.
    held: HashSet<usize>,
    /// Blocks a `store` is writing now. One store of a block at a time: two, with an
    /// eviction of the block between them, would leave the later one marking present
    /// a block whose bytes the eviction punched out (zeros served as data).
    storing: HashSet<(usize, u64)>,
    tick: u64,
    stats: CacheStats,
}

impl State {
    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn object(&mut self, id: ObjectId) -> &mut Object {
        self.objects[id.0]
            .as_mut()
            .expect("object removed while attached")
    }

    fn pin(&mut self, object: usize, block: u64) {
        *self.pins.entry((object, block)).or_default() += 1;
    }

    fn unpin(&mut self, object: usize, block: u64) {
        let pins = self.pins.get_mut(&(object, block)).expect("not pinned");
        *pins -= 1;
        if *pins == 0 {
            self.pins.remove(&(object, block));
        }
    }

    /// Drops a present block: entry cleared on disk first, then the bytes punched out.
    fn drop_block(&mut self, object: usize, block: u64) -> io::Result<()> {
        assert!(
            !self.held.contains(&object),
            "a block of an object held whole would be dropped"
        );
        let Some(entry) = self.objects[object].as_mut() else {
            return Ok(());
        };
        if !entry.entries[block as usize].present() {
            return Ok(());
        }
        let bytes = entry.block_bytes(block);
        entry.entries[block as usize] = Entry::default();
        entry.verified[block as usize] = false;
        entry.write_entry(block)?;
        crate::sys::files::punch_hole(entry.data.as_fd(), block * entry.header.block, bytes)?;
        self.stats.used_bytes -= bytes;
        Ok(())
    }
}

/// A cache directory, open.
pub struct Cache {
    dir: PathBuf,
    _lock: File,
    order: Box<dyn EvictionOrder>,
    state: Mutex<State>,
}

impl Cache {
    /// Opens (creating) the cache in `dir` with at most `limit` bytes, evicting in
    /// `order`; takes every object cached there before (their bytes count against the
    /// limit and are evicted like any other). An unreadable index is deleted with its
    /// data. A cache above `limit` (a smaller limit than last time) is evicted down.
    pub fn open(dir: &Path, limit: u64, order: Box<dyn EvictionOrder>) -> Result<Self, CacheError> {
        let root = dir.join("v1");
        let err = |source| CacheError::Io {
            dir: dir.to_path_buf(),
            source,
        };
        std::fs::create_dir_all(&root).map_err(err)?;
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(root.join("lock"))
            .map_err(err)?;
        if !crate::sys::files::try_lock_exclusive(lock.as_fd()).map_err(err)? {
            return Err(CacheError::Busy(dir.to_path_buf()));
        }
        let mut state = State {
            objects: Vec::new(),
            pins: HashMap::new(),
            held: HashSet::new(),
            storing: HashSet::new(),
            tick: 0,
            stats: CacheStats {
                limit_bytes: limit,
                ..CacheStats::default()
            },
        };
        for entry in std::fs::read_dir(&root).map_err(err)? {
            let path = entry.map_err(err)?.path();
            if path.extension().is_some_and(|e| e == "idx") {
                let stem = path.with_extension("");
                match load(&stem) {
                    Ok(object) => {
                        for (block, entry) in object.entries.iter().enumerate() {
                            if entry.present() {
                                state.stats.used_bytes += object.block_bytes(block as u64);
                                state.tick = state.tick.max(entry.tick);
                            }
                        }
                        state.objects.push(Some(object));
                    }
                    Err(_) => remove(&stem),
                }
            }
        }
        let cache = Self {
            dir: dir.to_path_buf(),
            _lock: lock,
            order,
            state: Mutex::new(state),
        };
        cache.make_room(0).map_err(err)?;
        Ok(cache)
    }

    /// The cache directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The cache entry of `name` at `version` (`size` bytes, cut in `block`-byte
    /// blocks), created empty if there is none; other versions of `name` are deleted.
    pub fn attach(&self, name: &str, version: &str, size: u64, block: u64) -> io::Result<ObjectId> {
        let header = Header {
            name: name.to_string(),
            version: version.to_string(),
            size,
            block,
        };
        let mut state = crate::lock::lock(&self.state);
        let mut found = None;
        for index in 0..state.objects.len() {
            let Some(object) = &state.objects[index] else {
                continue;
            };
            if object.header.name != name {
                continue;
            }
            if object.header == header {
                found = Some(index);
                continue;
            }
            // Another version (or block size) of the same object: its bytes are of no use.
            let blocks = object.header.blocks();
            for block in 0..blocks {
                state.drop_block(index, block)?;
            }
            let stem = state.objects[index].take().unwrap().stem;
            remove(&stem);
        }
        if let Some(index) = found {
            return Ok(ObjectId(index));
        }
        let key = format!("{name}\0{version}\0{block}");
        let stem = self
            .dir
            .join("v1")
            .join(format!("{:016x}", cache_index::fnv1a(key.as_bytes())));
        let object = create(&stem, header)?;
        state.objects.push(Some(object));
        Ok(ObjectId(state.objects.len() - 1))
    }

    /// Whether block `block` of `id` is present.
    pub fn contains(&self, id: ObjectId, block: u64) -> bool {
        let mut state = crate::lock::lock(&self.state);
        state.object(id).entries[block as usize].present()
    }

    /// Asks the kernel to read block `block` of `id` into the page cache ahead of its
    /// use, if the cache holds it (the warm path's read-ahead); true if it does.
    pub fn prefetch(&self, id: ObjectId, block: u64) -> bool {
        let mut state = crate::lock::lock(&self.state);
        let object = state.object(id);
        if !object.entries[block as usize].present() {
            return false;
        }
        let start = block * object.header.block;
        let len = object.block_bytes(block);
        // Only advice: a refusal costs a slower read, nothing else.
        let _ = crate::sys::files::fadvise(
            object.data.as_fd(),
            start as i64,
            len as i64,
            libc::POSIX_FADV_WILLNEED,
        );
        true
    }

    /// Reads `buf.len()` bytes at `offset` within block `block` of `id` if the block is
    /// present (true), or reads nothing (false). The first read of a block in a mount
    /// checks the whole block's CRC; a block that fails it is dropped (false).
    pub fn read(&self, id: ObjectId, block: u64, offset: u64, buf: &mut [u8]) -> io::Result<bool> {
        let (verify, data, block_len, start, crc) = {
            let mut state = crate::lock::lock(&self.state);
            let tick = state.next_tick();
            let object = state.object(id);
            if !object.entries[block as usize].present() {
                return Ok(false);
            }
            object.entries[block as usize].tick = tick;
            let verify = !object.verified[block as usize];
            let data = Arc::clone(&object.data);
            let block_len = object.block_bytes(block);
            let start = block * object.header.block;
            let crc = object.entries[block as usize].crc;
            state.pin(id.0, block);
            (verify, data, block_len, start, crc)
        };
        assert!(
            offset + buf.len() as u64 <= block_len,
            "read past the block"
        );
        let result = if verify {
            let mut whole = vec![0u8; block_len as usize];
            data.read_exact_at(&mut whole, start).map(|()| {
                let good = crc32fast::hash(&whole) == crc;
                if good {
                    buf.copy_from_slice(&whole[offset as usize..offset as usize + buf.len()]);
                }
                good
            })
        } else {
            data.read_exact_at(buf, start + offset).map(|()| true)
        };
        let mut state = crate::lock::lock(&self.state);
        state.unpin(id.0, block);
        match result {
            Ok(true) => {
                state.object(id).verified[block as usize] = true;
                state.stats.hit_bytes += buf.len() as u64;
                Ok(true)
            }
            Ok(false) => {
                state.stats.corrupt_blocks += 1;
                state.drop_block(id.0, block)?;
                Ok(false)
            }
            Err(error) => Err(error),
        }
    }

    /// Stores the bytes of block `block` of `id` (the whole block), evicting others to
    /// stay within the limit. False when it was not stored: no room that is not in use.
    /// Also false when another store of the block is writing it: that one stores it.
    pub fn store(&self, id: ObjectId, block: u64, bytes: &[u8]) -> io::Result<bool> {
        if !crate::lock::lock(&self.state).storing.insert((id.0, block)) {
            return Ok(false);
        }
        let stored = self.store_alone(id, block, bytes);
        crate::lock::lock(&self.state)
            .storing
            .remove(&(id.0, block));
        stored
    }

    /// `store`, with no other store of the block running.
    fn store_alone(&self, id: ObjectId, block: u64, bytes: &[u8]) -> io::Result<bool> {
        let (data, start) = {
            let mut state = crate::lock::lock(&self.state);
            let object = state.object(id);
            assert_eq!(
                bytes.len() as u64,
                object.block_bytes(block),
                "not the whole block"
            );
            if object.entries[block as usize].present() {
                return Ok(true);
            }
            let data = Arc::clone(&object.data);
            let start = block * object.header.block;
            let len = bytes.len() as u64;
            drop(state);
            if !self.make_room(len)? {
                let mut state = crate::lock::lock(&self.state);
                state.stats.not_stored_blocks += 1;
                return Ok(false);
            }
            (data, start)
        };
        let written = data.write_all_at(bytes, start);
        let mut state = crate::lock::lock(&self.state);
        if let Err(error) = written {
            state.stats.used_bytes -= bytes.len() as u64;
            return Err(error);
        }
        let tick = state.next_tick();
        let object = state.object(id);
        if object.entries[block as usize].present() {
            // Present already (no other store of the block runs meanwhile, but the
            // bytes would be the same): count them once.
            state.stats.used_bytes -= bytes.len() as u64;
            return Ok(true);
        }
        object.entries[block as usize] = Entry {
            tick,
            crc: crc32fast::hash(bytes),
        };
        object.verified[block as usize] = true;
        object.write_entry(block)?;
        state.stats.stored_bytes += bytes.len() as u64;
        Ok(true)
    }

    /// Evicts until `len` more bytes fit, and reserves them; false (nothing reserved)
    /// when the blocks not in use do not free enough.
    fn make_room(&self, len: u64) -> io::Result<bool> {
        let mut state = crate::lock::lock(&self.state);
        let limit = state.stats.limit_bytes;
        if len > limit {
            return Ok(false);
        }
        let need = (state.stats.used_bytes + len).saturating_sub(limit);
        if need > 0 {
            let mut candidates = Vec::new();
            for (index, object) in state.objects.iter().enumerate() {
                let Some(object) = object else { continue };
                if state.held.contains(&index) {
                    continue;
                }
                for (block, entry) in object.entries.iter().enumerate() {
                    let block = block as u64;
                    if entry.present() && !state.pins.contains_key(&(index, block)) {
                        candidates.push(Candidate {
                            object: index,
                            block,
                            tick: entry.tick,
                            bytes: object.block_bytes(block),
                        });
                    }
                }
            }
            let victims = self.order.victims(&candidates, need);
            let freed: u64 = victims.iter().map(|v| v.bytes).sum();
            if freed < need {
                return Ok(false);
            }
            for victim in victims {
                state.drop_block(victim.object, victim.block)?;
                state.stats.evicted_blocks += 1;
                state.stats.evicted_bytes += victim.bytes;
            }
        }
        state.stats.used_bytes += len;
        Ok(true)
    }

    /// What the cache holds of `id`: every block present and checked, present, or not.
    pub fn completeness(&self, id: ObjectId) -> Completeness {
        crate::lock::lock(&self.state).object(id).completeness()
    }

    /// Checks the CRC of every block of `id` not checked yet in this mount (as the first
    /// `read` of each would), dropping one that fails it; stops at the first block
    /// absent. What the cache holds of `id` after. Reads the whole object: slow.
    pub fn check_all(&self, id: ObjectId) -> io::Result<Completeness> {
        let blocks = crate::lock::lock(&self.state).object(id).entries.len() as u64;
        let mut scratch = Vec::new();
        for block in 0..blocks {
            let (data, start, len, crc) = {
                let mut state = crate::lock::lock(&self.state);
                let object = state.object(id);
                let entry = object.entries[block as usize];
                if !entry.present() {
                    return Ok(Completeness::Partial);
                }
                if object.verified[block as usize] {
                    continue;
                }
                let found = (
                    Arc::clone(&object.data),
                    block * object.header.block,
                    object.block_bytes(block),
                    entry.crc,
                );
                state.pin(id.0, block);
                found
            };
            scratch.resize(len as usize, 0);
            let result = data
                .read_exact_at(&mut scratch, start)
                .map(|()| crc32fast::hash(&scratch) == crc);
            let mut state = crate::lock::lock(&self.state);
            state.unpin(id.0, block);
            match result? {
                true => state.object(id).verified[block as usize] = true,
                false => {
                    state.stats.corrupt_blocks += 1;
                    state.drop_block(id.0, block)?;
                    return Ok(Completeness::Partial);
                }
            }
        }
        Ok(self.completeness(id))
    }

    /// Holds `id` whole until the cache is dropped (see the module's comment) if every
    /// block of it is present and checked; false (nothing held) if not.
    pub fn hold(&self, id: ObjectId) -> bool {
        let mut state = crate::lock::lock(&self.state);
        let whole = state.object(id).completeness() == Completeness::Whole;
        if whole {
            state.held.insert(id.0);
        }
        whole
    }

    /// Whether `id` is held whole.
    pub fn held(&self, id: ObjectId) -> bool {
        crate::lock::lock(&self.state).held.contains(&id.0)
    }

    /// The data file of `id`: the file passthrough hands to the kernel.
    pub fn data_file(&self, id: ObjectId) -> Arc<File> {
        Arc::clone(&crate::lock::lock(&self.state).object(id).data)
    }

    /// Whether the cache directory's filesystem opens files with O_DIRECT: the kernel
    /// opens the data file with the flags of the program's open under passthrough, so
    /// one that refuses O_DIRECT would fail the pager's opens.
    pub fn opens_direct(&self) -> io::Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(self.dir.join("v1").join("lock"))
            .map(drop)
    }

    /// Writes every entry (the last-use ticks) to the index files.
    pub fn flush(&self) -> io::Result<()> {
        let state = crate::lock::lock(&self.state);
        for object in state.objects.iter().flatten() {
            let mut bytes = Vec::with_capacity(object.entries.len() * ENTRY_LEN);
            for entry in &object.entries {
                bytes.extend_from_slice(&entry.encode());
            }
            object.index.write_all_at(&bytes, object.header_len)?;
        }
        Ok(())
    }

    pub fn stats(&self) -> CacheStats {
        crate::lock::lock(&self.state).stats
    }
}

#[cfg(test)]
mod tests;
