//! Which blocks of a model larger than the budget stream each pass, and which stay.
//!
//! Belady's rule alone keeps the right amount of the model resident but not the right
//! blocks for overlap: evicting the block used furthest ahead (the one just passed)
//! leaves the part that streams as one contiguous stretch, so every pass the program
//! first waits on the device through that stretch and then computes through the
//! resident rest with the device idle. Token time is then I/O plus compute, not the
//! larger of the two. Measured on a 3 GiB llama at 90 % of its size, 2 MiB blocks,
//! block-layer trace: reads came in bursts of 10 requests completing together 10-12 ms
//! after issue, then 70 ms with nothing in flight; 5.5 tok/s where I/O and compute
//! overlapped would give about 11.
//!
//! So the streamed set is chosen up front, spread evenly along the predicted order in
//! chunks of at least `STREAM_CHUNK` bytes (whole reads at the device's pace): every
//! stretch of the pass then has its share of reads, and the device works while the
//! program computes through the resident blocks between them. Eviction takes streamed
//! blocks first; prefetch reads the next few streamed blocks ahead of the program.
//!
//! The set is larger than `M - B` by the room the streamed blocks need while resident:
//! the prefetch window ahead of the program and the blocks a lagging thread may still
//! read behind it. A pass still reads about `M - B` (each read evicts one block, so as
//! many blocks are missing as ever); the room is what stays resident of the set, and
//! what is read early and evicted before use is the spread's cost over the optimum
//! (1.03x at 75 %, 1.07x at 90 % of a 3 GiB llama). So the window is a few chunks, not
//! a latency-sized guess: reads are issued in the order they are needed, a few at a
//! time (`STREAM_DEVICE_BYTES`), so the next one needed arrives first.

use crate::graph::{BlockLengths, CyclicOrder};

/// Smallest run of consecutive blocks (in the order) that streams together: a read the
/// device serves at full speed alone (2 MiB at queue depth 1 ran at 4.1 GB/s here, the
/// same as 1 MiB reads 32 deep).
pub const STREAM_CHUNK: u64 = 2 << 20;

/// Streamed chunks the prefetch keeps ahead of the program.
///
/// Each is a block held resident before its use, so one more read per pass; too few and
/// the device idles whenever the program falls behind it. At 90 % of a 3 GiB llama
/// (2 MiB blocks, llama-bench tg64, five runs each, alternating) 4 chunks decoded at
/// 8.58-9.21 tok/s (median 9.03) with 51-72 blocks read on demand per run, 8 chunks at
/// 9.17-9.37 (9.29) with 15-30, reading 0.5 % more; 6 9.14-9.29, 12 and 16 no faster
/// than 8. At 75 % 4 and 8 were the same (3.99-4.08 and 4.00-4.11, three runs each).
/// With 4, the service found nothing left to read with the device idle 2.7 % of the
/// time over whole runs and 6.7 % in steady decode (per-state timing in the service
/// loop).
pub const WINDOW_CHUNKS: u64 = 8;

/// Most bytes of prefetch reads on the device at once while a spread set streams
/// (`PrefetchPolicy::device_bytes`). More reads waiting on the device do not make it
/// faster once it is saturated, only later to deliver the block the program needs
/// first: this virtual disk serves its queue in turn and completes what it took
/// together. Measured here (fio, O_DIRECT, huge-page buffers): 2 MiB reads 1 deep
/// 3.9 GB/s, 2 deep 4.1; 1 MiB reads 1 deep 3.6, 4 deep 4.0; a batch of 10 reads of
/// 2 MiB completed within 30 us of each other, 10 ms after issue. llama-bench on a
/// 3 GiB llama (2 MiB blocks, zero copy, two runs each) at 75 % and 90 % of its size:
/// 2 MiB 3.75-3.84 and 9.07-9.40 tok/s, 4 MiB 3.94-4.01 and 8.07-9.08, no limit (the
/// queue depth) 3.37-3.48 and 7.34-7.56.
pub const STREAM_DEVICE_BYTES: u64 = 4 << 20;

/// The streamed set of one model under one budget.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamPlan {
    /// Per block: streamed (evicted first, read every pass) or kept.
    pub streamed: Vec<bool>,
    /// Bytes of the streamed blocks: the most a pass reads, less what stays resident
    /// (about `M - B` of it is read each pass).
    pub streamed_bytes: u64,
    /// Bytes of streamed blocks the prefetch keeps ahead of the program.
    pub window_bytes: u64,
}

impl StreamPlan {
    /// Whether anything streams (the model does not fit).
    pub fn streams(&self) -> bool {
        self.streamed_bytes > 0
    }

    pub fn is_streamed(&self, block: u32) -> bool {
        self.streamed.get(block as usize).copied().unwrap_or(false)
    }
}

/// Chooses the streamed blocks for `order` over `layout` under `budget` bytes, sparing
/// room for a window of `WINDOW_CHUNKS` chunks and for the streamed blocks within
/// `lag_guard` positions behind the program. Nothing streams when the predicted blocks
/// fit the budget.
pub fn plan_streaming(
    order: &CyclicOrder,
    layout: &impl BlockLengths,
    budget: u64,
    lag_guard: u32,
) -> StreamPlan {
    let block_count = layout.block_count() as usize;
    let mut plan = StreamPlan {
        streamed: vec![false; block_count],
        ..StreamPlan::default()
    };
    // Blocks in the order of their first use.
    let mut seen = vec![false; block_count];
    let blocks: Vec<u32> = order
        .sequence()
        .iter()
        .copied()
        .filter(|&block| !std::mem::replace(&mut seen[block as usize], true))
        .collect();
    let total: u64 = blocks.iter().map(|&block| layout.block_len(block)).sum();
    if total <= budget || blocks.is_empty() {
        return plan;
    }
    let chunk_blocks = (STREAM_CHUNK / layout.block_size()).max(1) as usize;
    let chunk_bytes = chunk_blocks as u64 * layout.block_size();
    let must = total - budget;
    if must > total / 3 {
        // Below two thirds of the model the reads dominate the token (4:1 at two
        // thirds of a 3 GiB llama here, 8:1 at a quarter): overlap can hide little, and
        // the spread read slightly more. Full bench runs at a quarter: a spread set
        // 1.25 tok/s reading 1.11x M - B, Belady's contiguous stream with a deep queue
        // 1.34 at 1.10x; at half 1.89 against 1.98.
        return plan;
    }
    // Streamed bytes within one step's span (`lag_guard`): threads sharing a step work
    // that far apart, so the window reaches that much further past the cursor (which
    // follows whichever thread faulted last), and as much behind it stays resident for
    // the thread behind.
    let step_share = (lag_guard as u64 * layout.block_size()).saturating_mul(must) / total;
    let window_bytes = WINDOW_CHUNKS * chunk_bytes + step_share;
    let target = (must + window_bytes + step_share + chunk_bytes).min(total);

    let chunks = blocks.chunks(chunk_blocks).collect::<Vec<_>>();
    let wanted = target.div_ceil(chunk_bytes).min(chunks.len() as u64) as usize;
    // Spread `wanted` of the chunks evenly: chunk i streams when the running share
    // i * wanted / n crosses an integer.
    for (i, chunk) in chunks.iter().enumerate() {
        let before = i * wanted / chunks.len();
        let after = (i + 1) * wanted / chunks.len();
        if after > before {
            for &block in *chunk {
                plan.streamed[block as usize] = true;
                plan.streamed_bytes += layout.block_len(block);
            }
        }
    }
    plan.window_bytes = window_bytes;
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::BlockGeometry;

    const MIB: u64 = 1 << 20;

    fn layout(blocks: u64, block_size: u64) -> BlockGeometry {
        BlockGeometry::new(0, blocks * block_size, block_size).unwrap()
    }

    fn linear(blocks: u32) -> CyclicOrder {
        CyclicOrder::from_sequence(0..blocks, blocks)
    }

    #[test]
    fn nothing_streams_when_the_model_fits() {
        let plan = plan_streaming(&linear(100), &layout(100, 2 * MIB), 200 * MIB, 0);
        assert!(!plan.streams());
        assert!(plan.streamed.iter().all(|&s| !s));
    }

    #[test]
    fn the_stream_is_what_does_not_fit_plus_its_room_spread_evenly() {
        // 1000 blocks of 2 MiB, budget 900 blocks: 100 must stream, plus a window of 8
        // and a guard share of one chunk.
        assert_eq!(WINDOW_CHUNKS, 8);
        let plan = plan_streaming(&linear(1000), &layout(1000, 2 * MIB), 900 * 2 * MIB, 0);
        let streamed: Vec<u32> = (0..1000).filter(|&b| plan.is_streamed(b)).collect();
        assert_eq!(streamed.len(), 109);
        assert_eq!(plan.streamed_bytes, 109 * 2 * MIB);
        assert_eq!(plan.window_bytes, 8 * 2 * MIB);
        // Evenly: gaps of 9 or 10 blocks, never a run.
        for pair in streamed.windows(2) {
            let gap = pair[1] - pair[0];
            assert!((9..=10).contains(&gap), "gap {gap} in {streamed:?}");
        }
        // What stays fits the budget with the room to spare.
        let kept = 1000 - streamed.len() as u64;
        assert!(kept * 2 * MIB + plan.window_bytes <= 900 * 2 * MIB);
    }

    #[test]
    fn small_blocks_stream_in_whole_chunks() {
        // 4 KiB blocks: chunks of 512 consecutive blocks in the order.
        let blocks = 64 * 512;
        let plan = plan_streaming(&linear(blocks), &layout(blocks as u64, 4096), 96 * MIB, 0);
        let mut runs = Vec::new();
        let mut run = 0u32;
        for b in 0..blocks {
            if plan.is_streamed(b) {
                run += 1;
            } else if run > 0 {
                runs.push(run);
                run = 0;
            }
        }
        if run > 0 {
            runs.push(run);
        }
        assert!(runs.iter().all(|&r| r % 512 == 0), "{runs:?}");
        // 128 MiB model, 96 MiB budget: 32 MiB + 16 MiB window + 2 MiB guard.
        assert_eq!(plan.streamed_bytes, 50 * MIB);
    }

    #[test]
    fn the_order_not_the_file_decides_the_spread() {
        // The pass runs the blocks backwards: chunks follow it.
        let order = CyclicOrder::from_sequence((0..100).rev(), 100);
        let plan = plan_streaming(&order, &layout(100, 2 * MIB), 75 * 2 * MIB, 0);
        let streamed: Vec<u32> = (0..100).filter(|&b| plan.is_streamed(b)).collect();
        // 25 must stream, 8 window, 1 behind.
        assert_eq!(streamed.len(), 34);
        assert!(plan.is_streamed(0), "the last chunk of the pass streams");
    }

    #[test]
    fn threads_sharing_a_step_get_its_share_ahead_and_behind() {
        let without = plan_streaming(&linear(1000), &layout(1000, 2 * MIB), 750 * 2 * MIB, 0);
        let with = plan_streaming(&linear(1000), &layout(1000, 2 * MIB), 750 * 2 * MIB, 100);
        // A quarter of the model must stream, so a quarter of a 100-block step: 25
        // blocks more window ahead, 25 more held behind.
        assert_eq!(with.window_bytes - without.window_bytes, 25 * 2 * MIB);
        assert_eq!(with.streamed_bytes - without.streamed_bytes, 50 * 2 * MIB);
    }

    #[test]
    fn below_two_thirds_of_the_model_nothing_is_spread() {
        // Belady's contiguous stream then, with a deep queue.
        let plan = plan_streaming(&linear(30), &layout(30, 2 * MIB), 19 * 2 * MIB, 0);
        assert!(!plan.streams());
        assert_eq!(plan.window_bytes, 0);
        let two_thirds = plan_streaming(&linear(30), &layout(30, 2 * MIB), 20 * 2 * MIB, 0);
        assert!(two_thirds.streams());
    }

    #[test]
    fn everything_streams_when_the_room_needs_it() {
        // 20 blocks, budget 16: 4 must stream, 8 window, 1 behind.
        let plan = plan_streaming(&linear(20), &layout(20, 2 * MIB), 16 * 2 * MIB, 0);
        assert_eq!(plan.streamed_bytes, 13 * 2 * MIB);
        let plan = plan_streaming(&linear(10), &layout(10, 2 * MIB), 7 * 2 * MIB, 10);
        assert!((0..10).all(|b| plan.is_streamed(b)), "capped at the model");
        assert_eq!(plan.streamed_bytes, 10 * 2 * MIB);
    }
}
