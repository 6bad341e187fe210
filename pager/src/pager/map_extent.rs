//! Where a region's bytes lie, checked before anything is reserved: the file range it
//! presents and the length of its mapping, from the `MapOptions` a caller gave and the
//! length of the file. Pure: no system calls.

use std::path::Path;

use super::{MapError, MapOptions};

/// A region's extent in its file and in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct MapExtent {
    /// Bytes of the file it presents, from `MapOptions::offset`.
    pub(super) len: u64,
    /// Those bytes in whole pages.
    pub(super) needed: u64,
    /// Bytes of the mapping, in whole pages: `needed`, or the longer length asked for.
    pub(super) map_len: u64,
}

impl MapExtent {
    /// The extent `options` ask for in `path`, a file of `file_len` bytes, with pages of
    /// `page` bytes; refused if its offset or a block cut is not on a page, if it is
    /// empty or reaches past the file, or if the mapping asked for cannot hold it.
    pub(super) fn check(
        options: &MapOptions,
        path: &Path,
        file_len: u64,
        page: u64,
    ) -> Result<Self, MapError> {
        let name = || path.display().to_string();
        if options.offset % page != 0 {
            return Err(MapError::UnalignedOffset {
                path: name(),
                offset: options.offset,
            });
        }
        let len = match options.len {
            Some(0) => return Err(MapError::ZeroLength { path: name() }),
            Some(len) => len,
            None => file_len.saturating_sub(options.offset),
        };
        if options.offset >= file_len || len > file_len - options.offset {
            return Err(MapError::OutOfRange {
                path: name(),
                offset: options.offset,
                len,
                file_len,
            });
        }
        let needed = len.next_multiple_of(page);
        let map_len = options.map_len.unwrap_or(needed).next_multiple_of(page);
        if map_len < needed {
            return Err(MapError::MapTooShort { map_len, needed });
        }
        if let Some(&offset) = options.block_cuts.iter().find(|&&cut| cut % page != 0) {
            return Err(MapError::UnalignedCut {
                path: name(),
                offset,
            });
        }
        Ok(Self {
            len,
            needed,
            map_len,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: u64 = 4096;

    fn check(options: MapOptions, file_len: u64) -> Result<MapExtent, MapError> {
        MapExtent::check(&options, Path::new("model.gguf"), file_len, PAGE)
    }

    #[test]
    fn the_rest_of_the_file_in_whole_pages_by_default() {
        let extent = check(
            MapOptions {
                offset: PAGE,
                ..MapOptions::default()
            },
            3 * PAGE + 10,
        )
        .unwrap();
        assert_eq!(
            extent,
            MapExtent {
                len: 2 * PAGE + 10,
                needed: 3 * PAGE,
                map_len: 3 * PAGE,
            }
        );
    }

    #[test]
    fn a_longer_mapping_is_whole_pages_and_a_shorter_one_is_refused() {
        let longer = MapOptions {
            map_len: Some(5 * PAGE + 1),
            ..MapOptions::default()
        };
        assert_eq!(check(longer, 2 * PAGE).unwrap().map_len, 6 * PAGE);
        let shorter = MapOptions {
            map_len: Some(PAGE),
            ..MapOptions::default()
        };
        assert!(matches!(
            check(shorter, 2 * PAGE),
            Err(MapError::MapTooShort { .. })
        ));
    }

    #[test]
    fn offsets_cuts_and_lengths_that_do_not_fit_are_refused() {
        let unaligned = MapOptions {
            offset: 1,
            ..MapOptions::default()
        };
        assert!(matches!(
            check(unaligned, PAGE),
            Err(MapError::UnalignedOffset { .. })
        ));
        let empty = MapOptions {
            len: Some(0),
            ..MapOptions::default()
        };
        assert!(matches!(
            check(empty, PAGE),
            Err(MapError::ZeroLength { .. })
        ));
        let past_end = MapOptions {
            len: Some(PAGE + 1),
            ..MapOptions::default()
        };
        assert!(matches!(
            check(past_end, PAGE),
            Err(MapError::OutOfRange { .. })
        ));
        let cut = MapOptions {
            block_cuts: vec![PAGE + 1],
            ..MapOptions::default()
        };
        assert!(matches!(
            check(cut, 2 * PAGE),
            Err(MapError::UnalignedCut { .. })
        ));
    }
}
