//! The faults of one region of a trace (`crate::trace`), checked against that region
//! before a replay sizes anything by them: a replay keeps state for every block of the
//! region, so one line naming block 4 000 000 000 must be refused, not allocated for.
//!
//! What a record must satisfy, whatever the region's geometry (`BlockGeometry`: the
//! block-size grid, maybe cut at the experts' slices, every block page aligned and at
//! least a page long):
//! - its block size is one the pager takes (`shim_config::check_block_size`), and the
//!   same on every record of the region;
//! - block `b` starts at or after `b` pages (no block is shorter than a page) and at or
//!   before `b` blocks (cuts only add blocks);
//! - its offset in the block lies inside a block;
//! - with the file's size in the trace's header (`size=`, which the shim writes), the
//!   block starts inside the file; without it (traces from before), the region reaches
//!   at most `MAX_BLOCKS_WITHOUT_SIZE` blocks.
//!
//! So the blocks a trace can make a replay hold are bounded by the file it names (one
//! per page at most), or by `MAX_BLOCKS_WITHOUT_SIZE`, and no arithmetic on them can
//! overflow: a block's start is below 2^32 blocks of at most 1 GiB.

use std::io::BufRead;

use thiserror::Error;

use crate::geometry::{BlockGeometry, GeometryError};
use crate::shim_config::{check_block_size, BlockError};
use crate::trace::{TraceError, TraceReader};

/// The smallest page: no block of any geometry is shorter.
pub const MIN_PAGE: u64 = 4096;

/// The most blocks a region may reach in a trace that does not say its file's size:
/// 1 TiB in 64 KiB blocks.
pub const MAX_BLOCKS_WITHOUT_SIZE: u64 = 1 << 24;

/// The faults of a trace's first region, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionTrace {
    pub block_size: u64,
    /// The region's bytes: the file's size where the trace says it and its blocks lie
    /// within it, else up to the end of the last block reached.
    pub data_len: u64,
    /// Blocks faulted on, each below `data_len.div_ceil(MIN_PAGE)`.
    pub blocks: Vec<u32>,
    /// Where in its block each fault was (0 in a trace from before this was recorded:
    /// the block's start), each below `block_size`.
    pub offsets: Vec<u32>,
}

/// A trace whose region cannot be replayed, and why.
#[derive(Debug, Error)]
pub enum RegionTraceError {
    #[error(transparent)]
    Trace(#[from] TraceError),
    #[error("the trace header's size={0:?} is not a number of bytes")]
    BadSize(String),
    #[error("no faults in the trace")]
    Empty,
    #[error("trace line {line}: block_size {block_size}: {source}")]
    BlockSize {
        line: u64,
        block_size: u64,
        #[source]
        source: BlockError,
    },
    #[error(
        "trace line {line}: block_size {found}, but the region's blocks are {expected} bytes \
         (its first record)"
    )]
    MixedBlockSize {
        line: u64,
        expected: u64,
        found: u64,
    },
    #[error(
        "trace line {line}: block {block} cannot start at file offset {file_offset} in blocks \
         of {block_size} (it starts between byte {earliest} and byte {latest})"
    )]
    BlockNotAtOffset {
        line: u64,
        block: u32,
        file_offset: u64,
        block_size: u64,
        earliest: u64,
        latest: u64,
    },
    #[error(
        "trace line {line}: offset {offset} in block {block} lies past a block of \
         {block_size} bytes"
    )]
    OffsetPastBlock {
        line: u64,
        block: u32,
        offset: u32,
        block_size: u64,
    },
    #[error(
        "trace line {line}: block {block} starts at file offset {file_offset}, past the end \
         of the file the trace names (size={size})"
    )]
    PastTheFile {
        line: u64,
        block: u32,
        file_offset: u64,
        size: u64,
    },
    #[error(
        "trace line {line}: block {block} is past the {MAX_BLOCKS_WITHOUT_SIZE} blocks a trace \
         may reach without the file's size in its header (size=)"
    )]
    TooFarWithoutSize { line: u64, block: u32 },
    #[error("the trace's region of {data_len} bytes (size= in its header) in blocks of {block_size}: {source}")]
    TooLarge {
        data_len: u64,
        block_size: u64,
        #[source]
        source: GeometryError,
    },
}

impl RegionTrace {
    /// Reads the faults of the first region the trace names (the records of others are
    /// skipped), checking each as the module says.
    pub fn read<R: BufRead>(mut reader: TraceReader<R>) -> Result<Self, RegionTraceError> {
        let size = header_size(&reader)?;
        let mut region = None;
        let mut trace = RegionTrace {
            block_size: 0,
            data_len: 0,
            blocks: Vec::new(),
            offsets: Vec::new(),
        };
        let mut line = 0;
        while let Some(record) = next_record(&mut reader, &mut line)? {
            if *region.get_or_insert(record.region) != record.region {
                continue;
            }
            if trace.blocks.is_empty() {
                check_block_size(record.block_size).map_err(|source| {
                    RegionTraceError::BlockSize {
                        line,
                        block_size: record.block_size,
                        source,
                    }
                })?;
                trace.block_size = record.block_size;
            } else if record.block_size != trace.block_size {
                return Err(RegionTraceError::MixedBlockSize {
                    line,
                    expected: trace.block_size,
                    found: record.block_size,
                });
            }
            let (block, offset) = checked_place(&record, line, trace.block_size, size)?;
            trace.blocks.push(block);
            trace.offsets.push(offset);
        }
        let Some(&max_block) = trace.blocks.iter().max() else {
            return Err(RegionTraceError::Empty);
        };
        // In range, as above. A model's last block is short, and a graph binds only a
        // region of the model's exact length: the file's own size where there is one.
        let reached = (max_block as u64 + 1) * trace.block_size;
        trace.data_len = size.map_or(reached, |size| size.max(reached));
        // A replay keeps state per block: the region must be one a geometry can number.
        BlockGeometry::new(0, trace.data_len, trace.block_size).map_err(|source| {
            RegionTraceError::TooLarge {
                data_len: trace.data_len,
                block_size: trace.block_size,
                source,
            }
        })?;
        Ok(trace)
    }
}

/// The file's size the trace's header names (`size=`), if it names one.
fn header_size<R: BufRead>(reader: &TraceReader<R>) -> Result<Option<u64>, RegionTraceError> {
    reader
        .metadata_value("size")
        .map(|text| {
            text.parse::<u64>()
                .map_err(|_| RegionTraceError::BadSize(text.to_string()))
        })
        .transpose()
}

/// The block `record` (on trace line `line`) faulted in and the offset in it, checked
/// against the region's `block_size` and the file's `size` where the header names it.
fn checked_place(
    record: &crate::trace::TraceRecord,
    line: u64,
    block_size: u64,
    size: Option<u64>,
) -> Result<(u32, u32), RegionTraceError> {
    let (block, file_offset) = (record.block, record.file_offset);
    // In range: a u32 block times at most 1 GiB (check_block_size).
    let (earliest, latest) = (block as u64 * MIN_PAGE, block as u64 * block_size);
    if !(earliest..=latest).contains(&file_offset) {
        return Err(RegionTraceError::BlockNotAtOffset {
            line,
            block,
            file_offset,
            block_size,
            earliest,
            latest,
        });
    }
    // A trace from before faults kept their offset says only the block.
    let offset = record.offset_in_block.unwrap_or(0);
    if offset as u64 >= block_size {
        return Err(RegionTraceError::OffsetPastBlock {
            line,
            block,
            offset,
            block_size,
        });
    }
    match size {
        Some(size) if file_offset >= size => Err(RegionTraceError::PastTheFile {
            line,
            block,
            file_offset,
            size,
        }),
        None if block as u64 >= MAX_BLOCKS_WITHOUT_SIZE => {
            Err(RegionTraceError::TooFarWithoutSize { line, block })
        }
        _ => Ok((block, offset)),
    }
}

/// The next record, and its line in `line`; blank lines are skipped, as the reader does.
fn next_record<R: BufRead>(
    reader: &mut TraceReader<R>,
    line: &mut u64,
) -> Result<Option<crate::trace::TraceRecord>, TraceError> {
    match reader.next() {
        None => Ok(None),
        Some(record) => {
            *line = reader.line();
            record.map(Some)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::HEADER;

    fn read(text: &str) -> Result<RegionTrace, RegionTraceError> {
        RegionTrace::read(TraceReader::new(text.as_bytes()).unwrap())
    }

    #[test]
    fn the_first_region_s_faults_in_a_file_of_the_size_the_trace_names() {
        let trace = read(&format!(
            "# size=200000 block_size=65536\n{HEADER}\n\
             1,2,0,65536,1,65536,missing,9,4096\n\
             1,2,7,0,0,65536,missing,9,0\n\
             1,2,0,0,0,65536,resident,9,8192\n"
        ))
        .unwrap();
        assert_eq!(trace.blocks, [1, 0]);
        assert_eq!(trace.offsets, [4096, 8192]);
        assert_eq!((trace.block_size, trace.data_len), (65536, 200_000));
        // Without the size: up to the end of the last block reached.
        let trace = read(&format!("{HEADER}\n1,2,0,131072,2,65536,missing,9,0\n")).unwrap();
        assert_eq!(trace.data_len, 3 * 65536);
        // Blocks cut at experts' slices start before the grid's: block 3 at 8 KiB.
        let trace = read(&format!("{HEADER}\n1,2,0,12288,3,65536,missing,9,0\n")).unwrap();
        assert_eq!(trace.blocks, [3]);
    }

    #[test]
    fn a_huge_block_number_is_refused_naming_its_line() {
        let error = read(&format!(
            "# size=1048576\n{HEADER}\n1,2,0,0,0,65536,missing,9,0\n\
             1,2,0,0,4000000000,65536,missing,9,0\n"
        ))
        .unwrap_err();
        assert!(
            matches!(
                error,
                RegionTraceError::BlockNotAtOffset {
                    line: 4,
                    block: 4_000_000_000,
                    ..
                }
            ),
            "{error:?}"
        );
        assert!(error
            .to_string()
            .starts_with("trace line 4: block 4000000000"));
        // Consistent with its offset, but past the file.
        let error = read(&format!(
            "# size=1048576\n{HEADER}\n1,2,0,274877906944,4194304,65536,missing,9,0\n"
        ))
        .unwrap_err();
        assert!(
            matches!(error, RegionTraceError::PastTheFile { line: 3, .. }),
            "{error:?}"
        );
        // And without a size, past the limit.
        let error = read(&format!(
            "{HEADER}\n1,2,0,1099511627776,16777216,65536,missing,9,0\n"
        ))
        .unwrap_err();
        assert!(
            matches!(
                error,
                RegionTraceError::TooFarWithoutSize {
                    line: 2,
                    block: 16_777_216
                }
            ),
            "{error:?}"
        );
    }

    #[test]
    fn a_size_with_more_blocks_than_a_region_can_number_is_refused() {
        // Found by the trace_region fuzzer: a size near 2^63 in blocks of 2 MiB is
        // 3 * 10^12 blocks, past the u32 block numbers a replay keeps state by.
        let text = format!(
            "# block_size=2097152 size=6211111111111191456\n{HEADER}\n\
             18227519,786,0,2097152,1,2097152,resident,2000,0\n"
        );
        let error = read(&text).unwrap_err();
        assert!(
            matches!(
                error,
                RegionTraceError::TooLarge {
                    data_len: 6_211_111_111_111_191_456,
                    block_size: 2_097_152,
                    source: GeometryError::TooManyBlocks { .. },
                }
            ),
            "{error:?}"
        );
        assert!(error.to_string().contains("size="), "{error}");
    }

    #[test]
    fn block_sizes_offsets_and_sizes_are_checked() {
        let one =
            |block_size: &str| read(&format!("{HEADER}\n1,2,0,0,0,{block_size},missing,9,0\n"));
        for bad in ["0", "100", "3000000", "18446744073709551615"] {
            assert!(
                matches!(one(bad), Err(RegionTraceError::BlockSize { line: 2, .. })),
                "{bad}"
            );
        }
        assert!(matches!(
            read(&format!(
                "{HEADER}\n1,2,0,0,0,65536,missing,9,0\n1,2,0,0,0,4096,missing,9,0\n"
            )),
            Err(RegionTraceError::MixedBlockSize {
                line: 3,
                expected: 65536,
                found: 4096
            })
        ));
        assert!(matches!(
            read(&format!("{HEADER}\n1,2,0,0,0,65536,missing,9,65536\n")),
            Err(RegionTraceError::OffsetPastBlock { line: 2, .. })
        ));
        assert!(matches!(
            read(&format!(
                "# size=lots\n{HEADER}\n1,2,0,0,0,65536,missing,9,0\n"
            )),
            Err(RegionTraceError::BadSize(_))
        ));
        assert!(matches!(
            read(&format!("{HEADER}\n\n")),
            Err(RegionTraceError::Empty)
        ));
        assert!(matches!(
            read(&format!("{HEADER}\n1,2,0,0,x,65536,missing,9,0\n")),
            Err(RegionTraceError::Trace(TraceError::BadField {
                line: 2,
                ..
            }))
        ));
    }
}
