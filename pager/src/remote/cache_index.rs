//! The persistent index of one cached object: which of its blocks the cache file holds,
//! when each was last used (for eviction), and each block's CRC-32 (checked the first
//! time a mount reads the block, so a block torn by a crash, or punched out after the
//! index last reached the disk, is fetched again instead of read as zeros).
//!
//! Layout (little-endian): a header, then one 16-byte entry per block.
//! ```text
//! "HOCACHE1" | header_len u32 | block u64 | size u64 | name_len u32 | name
//!            | version_len u32 | version | fnv1a-64 of all the header before it
//! entry: tick u64 (0: absent) | crc32 u32 | 0 u32
//! ```
//! Pure: encoding and decoding only; the files are `cache_store`'s.

use thiserror::Error;

const MAGIC: &[u8; 8] = b"HOCACHE1";
/// Bytes per block entry.
pub const ENTRY_LEN: usize = 16;

/// A header or index that cannot be used (the object is then cached afresh).
#[derive(Debug, Error, PartialEq, Eq)]
pub enum IndexError {
    #[error("cache index is not one of ours (bad magic)")]
    BadMagic,
    #[error("cache index is truncated")]
    Truncated,
    #[error("cache index header is corrupt (checksum)")]
    BadChecksum,
    #[error("cache index header's {0} is not UTF-8")]
    NotUtf8(&'static str),
    #[error("cache index has {found} entries for {expected} blocks")]
    WrongLength { found: usize, expected: u64 },
    #[error("cache index has block size {0}, not a power of two of at least {MIN_BLOCK}")]
    BadBlock(u64),
    #[error("cache index is for an object of {blocks} blocks, more than the {MAX_BLOCKS} one index holds")]
    TooManyBlocks { blocks: u64 },
}

/// The smallest block a mount caches in (`mount --block`).
pub const MIN_BLOCK: u64 = 4096;
/// The most blocks one object's index holds: 4 GiB of entries in memory, an object of
/// 1 TiB in the smallest blocks and of 256 TiB in mount's default 1 MiB ones.
pub const MAX_BLOCKS: u64 = 1 << 28;

/// One block's entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Entry {
    /// When the block was last used (a cache-wide counter); 0 when absent.
    pub tick: u64,
    /// CRC-32 of the block's bytes.
    pub crc: u32,
}

impl Entry {
    pub fn present(&self) -> bool {
        self.tick != 0
    }

    pub fn encode(&self) -> [u8; ENTRY_LEN] {
        let mut out = [0u8; ENTRY_LEN];
        out[..8].copy_from_slice(&self.tick.to_le_bytes());
        out[8..12].copy_from_slice(&self.crc.to_le_bytes());
        out
    }

    fn decode(bytes: &[u8]) -> Self {
        Self {
            tick: u64::from_le_bytes(bytes[..8].try_into().unwrap()),
            crc: u32::from_le_bytes(bytes[8..12].try_into().unwrap()),
        }
    }
}

/// What an index is the index of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// The object's name in the mount.
    pub name: String,
    /// The version (`consistency::version_key`).
    pub version: String,
    /// The object's size.
    pub size: u64,
    /// The block size.
    pub block: u64,
}

impl Header {
    pub fn blocks(&self) -> u64 {
        self.size.div_ceil(self.block)
    }

    /// The encoded header; entries start at its length.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        let len = 8 + 4 + 8 + 8 + 4 + self.name.len() + 4 + self.version.len() + 8;
        out.extend_from_slice(&(len as u32).to_le_bytes());
        out.extend_from_slice(&self.block.to_le_bytes());
        out.extend_from_slice(&self.size.to_le_bytes());
        out.extend_from_slice(&(self.name.len() as u32).to_le_bytes());
        out.extend_from_slice(self.name.as_bytes());
        out.extend_from_slice(&(self.version.len() as u32).to_le_bytes());
        out.extend_from_slice(self.version.as_bytes());
        let sum = fnv1a(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        debug_assert_eq!(out.len(), len);
        out
    }

    /// Decodes a header from the start of `bytes`; returns it and its length.
    pub fn decode(bytes: &[u8]) -> Result<(Self, usize), IndexError> {
        let mut at = 0usize;
        let mut take = |n: usize| -> Result<&[u8], IndexError> {
            let part = bytes.get(at..at + n).ok_or(IndexError::Truncated)?;
            at += n;
            Ok(part)
        };
        if take(8)? != MAGIC {
            return Err(IndexError::BadMagic);
        }
        let len = u32::from_le_bytes(take(4)?.try_into().unwrap()) as usize;
        let block = u64::from_le_bytes(take(8)?.try_into().unwrap());
        let size = u64::from_le_bytes(take(8)?.try_into().unwrap());
        let name_len = u32::from_le_bytes(take(4)?.try_into().unwrap()) as usize;
        // Strict, not lossy: a name read lossily would encode to other bytes, and an
        // index whose header does not round-trip cannot be trusted to be this object's.
        let name = utf8(take(name_len)?, "name")?;
        let version_len = u32::from_le_bytes(take(4)?.try_into().unwrap()) as usize;
        let version = utf8(take(version_len)?, "version")?;
        let body_len = 8 + 4 + 8 + 8 + 4 + name_len + 4 + version_len;
        let sum = u64::from_le_bytes(take(8)?.try_into().unwrap());
        if len != body_len + 8 || fnv1a(&bytes[..body_len]) != sum {
            return Err(IndexError::BadChecksum);
        }
        if !block.is_power_of_two() || block < MIN_BLOCK {
            return Err(IndexError::BadBlock(block));
        }
        Ok((
            Self {
                name,
                version,
                size,
                block,
            },
            len,
        ))
    }
}

fn utf8(bytes: &[u8], what: &'static str) -> Result<String, IndexError> {
    String::from_utf8(bytes.to_vec()).map_err(|_| IndexError::NotUtf8(what))
}

/// Decodes a whole index file: its header and the entries the file holds, at most one
/// per block; more entries than blocks is an error. Entries missing at the end (a file
/// cut short) are absent blocks: `padded` adds them, once the caller has checked the
/// header against the object, so that a header claiming a huge object costs nothing
/// before that check.
pub fn decode(bytes: &[u8]) -> Result<(Header, usize, Vec<Entry>), IndexError> {
    let (header, len) = Header::decode(bytes)?;
    let body = &bytes[len..];
    let found = body.len() / ENTRY_LEN;
    if found as u64 > header.blocks() {
        return Err(IndexError::WrongLength {
            found,
            expected: header.blocks(),
        });
    }
    let entries: Vec<Entry> = body.chunks_exact(ENTRY_LEN).map(Entry::decode).collect();
    Ok((header, len, entries))
}

/// `entries` (as `decode` returns them) with absent entries up to one per block of
/// `header`'s object.
pub fn padded(header: &Header, mut entries: Vec<Entry>) -> Result<Vec<Entry>, IndexError> {
    let blocks = header.blocks();
    if blocks > MAX_BLOCKS {
        return Err(IndexError::TooManyBlocks { blocks });
    }
    entries.resize(blocks as usize, Entry::default());
    Ok(entries)
}

/// 64-bit FNV-1a: a stable hash (the same in every build), for checksums and file names.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        Header {
            name: "dir/model.gguf".into(),
            version: "abc-123:10000".into(),
            size: 10_000,
            block: 4096,
        }
    }

    #[test]
    fn an_index_round_trips() {
        let mut bytes = header().encode();
        let entries = [
            Entry { tick: 5, crc: 7 },
            Entry::default(),
            Entry { tick: 9, crc: 1 },
        ];
        for entry in &entries {
            bytes.extend_from_slice(&entry.encode());
        }
        let (decoded, len, read) = decode(&bytes).unwrap();
        assert_eq!(decoded, header());
        assert_eq!(len, header().encode().len());
        assert_eq!(read, entries);
        assert!(read[0].present() && !read[1].present());
    }

    #[test]
    fn a_short_index_has_absent_blocks_and_a_long_one_is_refused() {
        let mut bytes = header().encode();
        bytes.extend_from_slice(&Entry { tick: 1, crc: 2 }.encode());
        bytes.extend_from_slice(&[1, 2, 3]); // a torn entry
        let (decoded, _, read) = decode(&bytes).unwrap();
        assert_eq!(read.len(), 1);
        let read = padded(&decoded, read).unwrap();
        assert_eq!(read.len(), 3);
        assert!(read[0].present() && !read[1].present() && !read[2].present());
        for _ in 0..3 {
            bytes.extend_from_slice(&Entry { tick: 1, crc: 2 }.encode());
        }
        assert!(matches!(
            decode(&bytes),
            Err(IndexError::WrongLength { .. })
        ));
    }

    #[test]
    fn damaged_headers_are_refused() {
        let good = header().encode();
        assert_eq!(decode(b"nope"), Err(IndexError::Truncated));
        assert_eq!(decode(b"NOTCACHE00000000000000"), Err(IndexError::BadMagic));
        for at in 12..good.len() {
            let mut bad = good.clone();
            bad[at] ^= 0x40;
            assert!(decode(&bad).is_err(), "flip at {at} accepted");
        }
        assert_eq!(decode(&good[..good.len() - 1]), Err(IndexError::Truncated));
    }

    #[test]
    fn a_name_or_version_that_is_not_utf8_is_refused() {
        // Checksummed as it stands, so only the UTF-8 check can refuse it: decoded
        // lossily it would encode to other bytes than the file holds.
        for (what, field) in [("name", "dir/model.gguf"), ("version", "abc-123:10000")] {
            let mut bytes = header().encode();
            let at = bytes
                .windows(field.len())
                .position(|w| w == field.as_bytes())
                .unwrap();
            bytes[at..at + 2].copy_from_slice(&[0x80, 0x88]);
            let body = bytes.len() - 8;
            let sum = fnv1a(&bytes[..body]);
            bytes[body..].copy_from_slice(&sum.to_le_bytes());
            assert_eq!(decode(&bytes), Err(IndexError::NotUtf8(what)));
        }
    }

    #[test]
    fn a_block_size_mount_never_uses_is_refused() {
        for block in [0, 1, 2048, 4095, 6144] {
            let bytes = Header { block, ..header() }.encode();
            assert_eq!(decode(&bytes), Err(IndexError::BadBlock(block)), "{block}");
        }
    }

    #[test]
    fn a_header_claiming_a_huge_object_allocates_nothing_and_is_refused() {
        let huge = Header {
            size: u64::MAX,
            ..header()
        };
        let (decoded, _, read) = decode(&huge.encode()).unwrap();
        assert!(read.is_empty());
        assert_eq!(
            padded(&decoded, read),
            Err(IndexError::TooManyBlocks {
                blocks: u64::MAX.div_ceil(4096)
            })
        );
        let one_too_many = Header {
            size: MAX_BLOCKS * 4096 + 1,
            ..header()
        };
        assert_eq!(
            padded(&one_too_many, Vec::new()),
            Err(IndexError::TooManyBlocks {
                blocks: MAX_BLOCKS + 1
            })
        );
    }

    #[test]
    fn the_fuzzers_seeds_decode() {
        // The cache_index fuzz target starts from these: a seed refused would leave it
        // exploring error paths only.
        let three = include_bytes!("../../../fuzz/seeds/cache_index/three_blocks.idx");
        let (decoded, _, entries) = decode(three).unwrap();
        assert_eq!((decoded, entries.len()), (header(), 3));
        let cut = include_bytes!("../../../fuzz/seeds/cache_index/cut_short.idx");
        let (decoded, _, entries) = decode(cut).unwrap();
        assert_eq!((decoded.blocks(), entries.len()), (3, 1));
    }

    #[test]
    fn fnv_is_stable() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
