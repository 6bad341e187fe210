//! `simulate --trace`'s reading of a trace's region (`RegionTrace`) on arbitrary bytes:
//! it must return, never panic or overflow, and what it accepts must size a replay by
//! the file it names, not by the numbers in its lines.
#![no_main]

use hyperoffload::geometry::BlockGeometry;
use hyperoffload::trace::TraceReader;
use hyperoffload::trace_region::{RegionTrace, MAX_BLOCKS_WITHOUT_SIZE, MIN_PAGE};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(reader) = TraceReader::new(data) else {
        return;
    };
    let size: Option<u64> = reader.metadata_value("size").and_then(|s| s.parse().ok());
    let Ok(trace) = RegionTrace::read(reader) else {
        return;
    };
    assert!(!trace.blocks.is_empty());
    assert_eq!(trace.blocks.len(), trace.offsets.len());
    // The replay's geometry, as `simulate` builds it: every block reached lies in it.
    let layout = BlockGeometry::new(0, trace.data_len, trace.block_size)
        .expect("an accepted trace gives a geometry");
    for (&block, &offset) in trace.blocks.iter().zip(&trace.offsets) {
        assert!(block < layout.block_count());
        assert!((offset as u64) < trace.block_size);
    }
    // Bounded by the file the trace names (a block per page at most), or by the limit
    // for traces that name none.
    let max_block = *trace.blocks.iter().max().unwrap() as u64;
    match size {
        Some(size) => {
            assert!(max_block < size.div_ceil(MIN_PAGE));
            assert!(trace.data_len >= size);
        }
        None => assert!(max_block < MAX_BLOCKS_WITHOUT_SIZE),
    }
});
