//! The experts of a mixture-of-experts model: which blocks hold which expert.
//!
//! A token runs only a few experts per layer (the router picks them), so an expert's
//! bytes are not part of the predicted cyclic order: a pass reads them only when the
//! expert is chosen. An expert of a layer is one *group*: its slice of each of the
//! layer's expert tensors (GGUF's merged `ffn_{gate,up,down}_exps`, whose outermost
//! dimension is the expert; or one tensor per expert in Hugging Face checkpoints,
//! `...layers.N.mlp.experts.E.*`). A token that chooses the expert reads all its slices
//! one after the other, so a fault in one predicts the rest.
//!
//! Pure lookup tables over block indices; no policy lives here.

use std::ops::Range;

use crate::geometry::BlockGeometry;
use crate::model::TensorInfo;

/// `expert_block_cuts` for a model file, or none for a part of a split GGUF: its graph
/// spans all the parts in uniform blocks (`ModelGraph::from_parts`), and a region cut
/// otherwise would not be the one the graph describes.
pub fn model_block_cuts(model: &crate::model::ModelFile, page: u64) -> Vec<u64> {
    match crate::model::split::split_parts(model) {
        Ok(None) => expert_block_cuts(&model.tensors, page),
        Ok(Some(_)) | Err(_) => Vec::new(),
    }
}

/// File offsets where blocks should start so that each routed expert's slice of a
/// tensor is blocks of its own (`BlockGeometry::with_file_cuts`): a token that runs the
/// expert then reads its bytes, not the neighbouring experts' that share a block with
/// them. Every slice boundary, rounded out to pages (multiples of `page`, a power of
/// two): a page two slices share becomes a block of its own, read by either, so a slice
/// costs at most its bytes plus two pages. Sorted, without repeats.
pub fn expert_block_cuts(tensors: &[TensorInfo], page: u64) -> Vec<u64> {
    debug_assert!(page.is_power_of_two());
    let mut cuts: Vec<u64> = tensors
        .iter()
        .filter_map(crate::graph::arch::expert_slices)
        .flat_map(|experts| experts.shares.into_iter().map(|(_, range)| range))
        .flat_map(|range| {
            let (start, end) = (range.start, range.end);
            [
                start & !(page - 1),
                start.next_multiple_of(page),
                end & !(page - 1),
                end.next_multiple_of(page),
            ]
        })
        .collect();
    cuts.sort_unstable();
    cuts.dedup();
    cuts
}

/// One expert of one layer: the blocks of each of its slices, in execution order.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ExpertGroup {
    pub layer: u32,
    pub expert: u32,
    /// One range of blocks per slice (gate, up, down ...), in execution order.
    pub slices: Vec<Range<u32>>,
    /// The same slices in bytes, counted from the region's start as blocks are.
    pub bytes: Vec<Range<u64>>,
    /// The position in the predicted order where the layer's experts run: the program
    /// is there when it reads one of them.
    pub anchor: u32,
}

impl ExpertGroup {
    /// Every block of the group, slice by slice (a block two slices share appears twice).
    pub fn blocks(&self) -> impl Iterator<Item = u32> + '_ {
        self.slices.iter().flat_map(|slice| slice.clone())
    }
}

/// A slice of one expert, as the graph builder finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertSlice {
    pub layer: u32,
    pub expert: u32,
    pub file_range: Range<u64>,
    /// Where the layer's experts run in the pass (see `ExpertGroup::anchor`).
    pub anchor: u32,
}

/// The experts of a model over its blocks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExpertMap {
    groups: Vec<ExpertGroup>,
    /// `group_ids[offsets[b]..offsets[b + 1]]`: the groups block `b` holds bytes of.
    offsets: Vec<u32>,
    group_ids: Vec<u32>,
    /// Experts per layer (the largest seen).
    experts_per_layer: u32,
    /// Experts a token runs per layer, from the model's metadata; `None` when unknown.
    used_per_token: Option<u32>,
}

impl ExpertMap {
    /// Groups `slices` by (layer, expert) and indexes their blocks. Slices outside the
    /// region are left out; `blocks` counts the region's blocks.
    pub fn new(slices: &[ExpertSlice], layout: &BlockGeometry) -> Self {
        let mut keyed: Vec<(&ExpertSlice, Range<u32>, Range<u64>)> = slices
            .iter()
            .filter_map(|slice| {
                let bytes = layout.region_offsets(&slice.file_range)?;
                let blocks = layout.blocks_overlapping(bytes.clone());
                Some((slice, blocks, bytes))
            })
            .collect();
        // Stable: slices of one expert stay in the order given (execution order).
        keyed.sort_by_key(|(slice, _, _)| (slice.layer, slice.expert));
        let mut groups: Vec<ExpertGroup> = Vec::new();
        for (slice, blocks, bytes) in keyed {
            match groups.last_mut() {
                Some(group) if group.layer == slice.layer && group.expert == slice.expert => {
                    group.slices.push(blocks);
                    group.bytes.push(bytes);
                }
                _ => groups.push(ExpertGroup {
                    layer: slice.layer,
                    expert: slice.expert,
                    slices: vec![blocks],
                    bytes: vec![bytes],
                    anchor: slice.anchor,
                }),
            }
        }
        let block_count = layout.block_count() as usize;
        let mut counts = vec![0u32; block_count + 1];
        let mut members: Vec<(u32, u32)> = Vec::new();
        for (id, group) in groups.iter().enumerate() {
            let mut blocks: Vec<u32> = group.blocks().collect();
            blocks.sort_unstable();
            blocks.dedup();
            for block in blocks {
                counts[block as usize + 1] += 1;
                members.push((block, id as u32));
            }
        }
        for i in 1..counts.len() {
            counts[i] += counts[i - 1];
        }
        members.sort_unstable();
        let experts_per_layer = groups.iter().map(|g| g.expert + 1).max().unwrap_or(0);
        Self {
            groups,
            offsets: counts,
            group_ids: members.into_iter().map(|(_, id)| id).collect(),
            experts_per_layer,
            used_per_token: None,
        }
    }

    /// Sets how many experts a token runs per layer (the model's `expert_used_count`).
    pub fn with_used_per_token(mut self, used: Option<u32>) -> Self {
        self.used_per_token = used.filter(|&used| used > 0);
        self
    }

    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    pub fn groups(&self) -> &[ExpertGroup] {
        &self.groups
    }

    pub fn group(&self, id: u32) -> &ExpertGroup {
        &self.groups[id as usize]
    }

    /// The groups block `block` holds bytes of (several where slices share a block).
    pub fn groups_of(&self, block: u32) -> &[u32] {
        let Some(&start) = self.offsets.get(block as usize) else {
            return &[];
        };
        let end = self
            .offsets
            .get(block as usize + 1)
            .copied()
            .unwrap_or(start);
        &self.group_ids[start as usize..end as usize]
    }

    /// The groups a fault in `block` (region offsets `block_range`) shows in use. With
    /// the faulting byte's offset in its block (`offset`), the one group whose slice holds
    /// it. Without, every group that has its slice's start or middle in the block: a
    /// block that holds only the tail of a slice is reached by a token that uses the
    /// expert only after the expert's first block, so a fault there more likely belongs
    /// to the slice that starts in it.
    pub fn groups_in_use(
        &self,
        block: u32,
        offset: Option<u32>,
        block_range: Range<u64>,
    ) -> Vec<u32> {
        let groups = self.groups_of(block);
        let Range {
            start: block_start,
            end: block_end,
        } = block_range;
        match offset {
            Some(offset) => {
                let at = block_start + offset as u64;
                groups
                    .iter()
                    .copied()
                    .filter(|&g| self.group(g).bytes.iter().any(|r| r.contains(&at)))
                    .take(1)
                    .collect()
            }
            None => {
                let not_tail = |g: &u32| {
                    self.group(*g)
                        .bytes
                        .iter()
                        .filter(|r| r.start < block_end && r.end > block_start)
                        .any(|r| r.end > block_end || r.start >= block_start)
                };
                let chosen: Vec<u32> = groups.iter().copied().filter(not_tail).collect();
                if chosen.is_empty() {
                    groups.to_vec()
                } else {
                    chosen
                }
            }
        }
    }

    /// Experts a token runs per layer, from the model's metadata.
    pub fn used_per_token(&self) -> Option<u32> {
        self.used_per_token
    }

    pub fn experts_per_layer(&self) -> u32 {
        self.experts_per_layer
    }

    /// The share of a layer's experts a token runs: `expert_used_count / expert_count`
    /// when the metadata says, else a quarter (a guess that learning soon replaces).
    pub fn prior_use(&self) -> f64 {
        match (self.used_per_token, self.experts_per_layer) {
            (Some(used), experts) if experts > 0 => (used as f64 / experts as f64).min(1.0),
            _ => 0.25,
        }
    }

    /// Moves every anchor through `remap` (positions change when the order is built).
    pub(crate) fn remap_anchors(&mut self, remap: impl Fn(u32) -> u32) {
        for group in &mut self.groups {
            group.anchor = remap(group.anchor);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_isolate_each_experts_slice_and_the_pages_slices_share() {
        // Four experts of 10_000 bytes from offset 8192 (outermost dimension first, as
        // the tensor table gives shapes), then a dense tensor.
        let tensors = [
            TensorInfo {
                name: "blk.0.ffn_up_exps.weight".into(),
                dtype: "F32".into(),
                shape: vec![4, 50, 50],
                file_range: 8192..48_192,
            },
            TensorInfo {
                name: "blk.0.ffn_norm.weight".into(),
                dtype: "F32".into(),
                shape: vec![50],
                file_range: 48_192..48_392,
            },
        ];
        let cuts = expert_block_cuts(&tensors, 4096);
        // Boundaries 8192 (aligned), 18_192, 28_192, 38_192, 48_192, each rounded out.
        assert_eq!(
            cuts,
            [8192, 16_384, 20_480, 24_576, 28_672, 36_864, 40_960, 45_056, 49_152]
        );
        let geometry = BlockGeometry::new(0, 60_000, 1 << 20)
            .unwrap()
            .with_file_cuts(cuts)
            .unwrap();
        // Expert 1 (18_192..28_192) reads the page it shares with expert 0, its own
        // pages, and the page it shares with expert 2: its bytes and less than 2 pages.
        let blocks = geometry.blocks_of_file_range(&(18_192..28_192)).unwrap();
        let read = geometry.data_range(blocks);
        assert_eq!(read, 16_384..28_672);
        assert!(read.end - read.start < 10_000 + 2 * 4096);
        assert!(
            expert_block_cuts(&tensors[1..], 4096).is_empty(),
            "dense: no cut"
        );
    }

    fn slice(layer: u32, expert: u32, range: Range<u64>) -> ExpertSlice {
        ExpertSlice {
            layer,
            expert,
            file_range: range,
            anchor: layer * 10,
        }
    }

    #[test]
    fn slices_of_one_expert_form_a_group_and_blocks_know_their_groups() {
        let layout = BlockGeometry::new(0, 16 * 100, 100).unwrap();
        // Layer 0, two experts; gate slices 0..150 and 150..300, up 300..450, 450..600.
        let slices = [
            slice(0, 0, 0..150),
            slice(0, 1, 150..300),
            slice(0, 0, 300..450),
            slice(0, 1, 450..600),
            slice(1, 0, 800..900),
        ];
        let map = ExpertMap::new(&slices, &layout).with_used_per_token(Some(1));
        assert_eq!(map.groups().len(), 3);
        assert_eq!(map.group(0).slices, vec![0..2, 3..5]);
        assert_eq!(map.group(1).slices, vec![1..3, 4..6]);
        assert_eq!(map.group(2).layer, 1);
        assert_eq!(map.group(2).anchor, 10);
        // Block 1 holds the end of expert 0's gate and the start of expert 1's.
        assert_eq!(map.groups_of(1), &[0, 1]);
        assert_eq!(map.groups_of(5), &[1]);
        assert_eq!(map.groups_of(7), &[] as &[u32]);
        assert_eq!(map.groups_of(99), &[] as &[u32]);
        assert_eq!(map.experts_per_layer(), 2);
        assert!((map.prior_use() - 0.5).abs() < 1e-9);
        assert_eq!(map.group(0).blocks().collect::<Vec<_>>(), [0, 1, 3, 4]);
        // Block 1 holds bytes 100..150 of expert 0 and 150..200 of expert 1.
        assert_eq!(map.groups_in_use(1, Some(20), 100..200), [0]);
        assert_eq!(map.groups_in_use(1, Some(60), 100..200), [1]);
        // Without the offset: expert 1's slice starts there, expert 0's only ends.
        assert_eq!(map.groups_in_use(1, None, 100..200), [1]);
        assert_eq!(map.groups_in_use(0, None, 0..100), [0]);
    }

    #[test]
    fn slices_outside_the_region_are_left_out() {
        let layout = BlockGeometry::new(1000, 500, 100).unwrap();
        let map = ExpertMap::new(&[slice(0, 0, 0..900), slice(0, 1, 1000..1100)], &layout);
        assert_eq!(map.groups().len(), 1);
        assert_eq!(map.group(0).expert, 1);
        assert!((map.prior_use() - 0.25).abs() < 1e-9);
    }
}
