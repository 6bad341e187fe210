//! One instruction can need two blocks at once: a load that straddles a block boundary
//! faults on the first block, then (retried once it is served) on the second. Were the
//! first evicted to make room for the second, the retry would fault on the first again,
//! for good. Here the graph policies evict blocks they do not predict (another file's)
//! first: the one such block resident was the one just served, and the load never
//! completed (the program hung; found with a split model whose later parts the graph
//! did not cover).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use hyperoffload::geometry::BlockGeometry;
use hyperoffload::graph::ModelGraph;
use hyperoffload::policy::graph::GraphPrediction;
use hyperoffload::policy::{EvictionKind, PrefetchKind};
use hyperoffload::{MapOptions, Pager};

const BLOCK: u64 = 4 << 10;
const MODEL_BLOCKS: u64 = 64;

/// Eight bytes at `address` in one load instruction, whatever the alignment.
fn load_u64(address: *const u8) -> u64 {
    let value: u64;
    // SAFETY: reads eight readable bytes at `address` (the caller's region), nothing
    // else; no stack, no flags.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::asm!("mov {v}, qword ptr [{a}]", v = out(reg) value, a = in(reg) address,
            options(nostack, readonly, preserves_flags));
    }
    // SAFETY: as above.
    #[cfg(target_arch = "aarch64")]
    unsafe {
        std::arch::asm!("ldr {v}, [{a}]", v = out(reg) value, a = in(reg) address,
            options(nostack, readonly, preserves_flags));
    }
    value
}

#[test]
fn a_load_straddling_two_blocks_completes() {
    let test = "a_load_straddling_two_blocks_completes";
    if !in_child_process(test, Duration::from_secs(60)) {
        return;
    }
    let dir = TempDir::new("straddle");
    let (model, other) = (dir.path("model.bin"), dir.path("other.bin"));
    pattern_file(&model, MODEL_BLOCKS * BLOCK);
    pattern_file(&other, 8 * BLOCK);
    // The graph predicts the model file, read in order; the other file is not its.
    let pass: Vec<u32> = (0..MODEL_BLOCKS as u32).collect();
    let layout = BlockGeometry::new(0, MODEL_BLOCKS * BLOCK, BLOCK).unwrap();
    let prediction = GraphPrediction::new(Arc::new(ModelGraph::from_pass(layout, &pass)));
    let Some(pager) = pager_or_skip(
        Pager::builder()
            .budget(16 * BLOCK)
            .block_size(BLOCK)
            .prefetch(PrefetchKind::Graph.build_with(Some(&prediction)))
            .eviction(EvictionKind::Graph.build_with(Some(&prediction))),
    ) else {
        return;
    };
    let model = pager.map_file(&model, MapOptions::default()).unwrap();
    let other = pager.map_file(&other, MapOptions::default()).unwrap();
    // A pass over the model fills the budget with its blocks.
    let bytes = model.as_slice();
    for offset in (0..MODEL_BLOCKS * BLOCK).step_by(1024) {
        assert_eq!(bytes[offset as usize], pattern_byte(offset));
    }
    for block in [2u64, 5] {
        let at = block * BLOCK - 4;
        let value = load_u64(other.as_slice()[at as usize..].as_ptr());
        let expected = u64::from_le_bytes(std::array::from_fn(|i| pattern_byte(at + i as u64)));
        assert_eq!(value, expected, "eight bytes at {at}");
    }
}
