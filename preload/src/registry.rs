//! The managed mappings of the process: which address ranges the shim serves, down to
//! the pages still mapped after the program unmapped pieces. A hole the program unmapped
//! may be reused by the kernel for an unrelated mapping, so lookups go by the live parts,
//! never by the original extent.
//!
//! Generic over what each mapping carries, so the range logic is unit-tested without a
//! pager.

use std::ops::Range;

/// One managed mapping.
pub struct Managed<T> {
    /// Page-aligned address ranges still mapped, sorted and disjoint.
    live: Vec<Range<usize>>,
    pub base: usize,
    pub value: T,
}

impl<T> Managed<T> {
    pub fn is_fully_unmapped(&self) -> bool {
        self.live.is_empty()
    }

    /// Whether any live page of the mapping lies in `range`.
    fn overlaps(&self, range: &Range<usize>) -> bool {
        self.live
            .iter()
            .any(|part| part.start < range.end && range.start < part.end)
    }
}

/// A piece of an address range, as the registry divides it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece<T> {
    /// Inside a live part of a managed mapping: `range` is absolute, `base` is the
    /// mapping's start (subtract it for region offsets).
    Managed {
        value: T,
        base: usize,
        range: Range<usize>,
    },
    /// Not managed: the kernel's business.
    Kernel(Range<usize>),
}

pub struct Registry<T> {
    mappings: Vec<Managed<T>>,
}

impl<T> Default for Registry<T> {
    fn default() -> Self {
        Self {
            mappings: Vec::new(),
        }
    }
}

impl<T: Clone> Registry<T> {
    pub fn insert(&mut self, base: usize, len: usize, value: T) {
        let mut live = Vec::with_capacity(2);
        live.push(base..base + len);
        self.mappings.push(Managed { live, base, value });
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.mappings.is_empty()
    }

    /// Divides `range` into managed and kernel pieces, in address order. A range touching
    /// no managed mapping comes back as one kernel piece.
    pub fn split(&self, range: Range<usize>) -> Vec<Piece<T>> {
        let mut managed: Vec<(Range<usize>, usize, &T)> = Vec::new();
        for mapping in &self.mappings {
            for part in &mapping.live {
                let start = part.start.max(range.start);
                let end = part.end.min(range.end);
                if start < end {
                    managed.push((start..end, mapping.base, &mapping.value));
                }
            }
        }
        managed.sort_by_key(|(part, _, _)| part.start);
        let mut pieces = Vec::new();
        let mut at = range.start;
        for (part, base, value) in managed {
            if part.start > at {
                pieces.push(Piece::Kernel(at..part.start));
            }
            at = at.max(part.end);
            pieces.push(Piece::Managed {
                value: value.clone(),
                base,
                range: part,
            });
        }
        if at < range.end {
            pieces.push(Piece::Kernel(at..range.end));
        }
        pieces
    }

    /// Every live part of every mapping: (the mapping's base, the part, its value).
    pub fn live_parts(&self) -> impl Iterator<Item = (usize, Range<usize>, &T)> {
        self.mappings.iter().flat_map(|mapping| {
            mapping
                .live
                .iter()
                .map(move |part| (mapping.base, part.clone(), &mapping.value))
        })
    }

    /// Whether any live managed page lies in `range`.
    pub fn overlaps(&self, range: Range<usize>) -> bool {
        self.mappings.iter().any(|mapping| mapping.overlaps(&range))
    }

    /// Records that `range` (a managed piece from `split`) of the mapping starting at
    /// `base` was unmapped. Returns the mapping if nothing of it is left (it is removed
    /// from the registry).
    ///
    /// The base alone does not name a mapping: one placed in a hole at the head of
    /// another has the same base. Live parts never overlap (the kernel only places a
    /// mapping where nothing is mapped), so the one with live pages in `range` is it.
    pub fn unmapped(&mut self, base: usize, range: Range<usize>) -> Option<Managed<T>> {
        let index = self
            .mappings
            .iter()
            .position(|m| m.base == base && m.overlaps(&range))?;
        let mapping = &mut self.mappings[index];
        let mut live = Vec::with_capacity(mapping.live.len() + 1);
        for part in mapping.live.drain(..) {
            if part.end <= range.start || range.end <= part.start {
                live.push(part);
                continue;
            }
            if part.start < range.start {
                live.push(part.start..range.start);
            }
            if range.end < part.end {
                live.push(range.end..part.end);
            }
        }
        mapping.live = live;
        if mapping.is_fully_unmapped() {
            Some(self.mappings.swap_remove(index))
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn managed(value: u32, base: usize, range: Range<usize>) -> Piece<u32> {
        Piece::Managed { value, base, range }
    }

    #[test]
    fn live_parts_are_what_is_still_mapped() {
        let mut registry = Registry::default();
        registry.insert(0x10000, 0x4000, 1);
        registry.insert(0x20000, 0x2000, 2);
        assert!(registry.unmapped(0x10000, 0x11000..0x12000).is_none());
        let parts: Vec<_> = registry
            .live_parts()
            .map(|(base, part, value)| (base, part, *value))
            .collect();
        assert_eq!(
            parts,
            vec![
                (0x10000, 0x10000..0x11000, 1),
                (0x10000, 0x12000..0x14000, 1),
                (0x20000, 0x20000..0x22000, 2),
            ]
        );
    }

    #[test]
    fn splits_a_range_into_managed_and_kernel_pieces() {
        let mut registry = Registry::default();
        registry.insert(0x10000, 0x4000, 1);
        registry.insert(0x20000, 0x2000, 2);
        assert_eq!(
            registry.split(0x0..0x1000),
            vec![Piece::Kernel(0x0..0x1000)]
        );
        assert_eq!(
            registry.split(0xf000..0x21000),
            vec![
                Piece::Kernel(0xf000..0x10000),
                managed(1, 0x10000, 0x10000..0x14000),
                Piece::Kernel(0x14000..0x20000),
                managed(2, 0x20000, 0x20000..0x21000),
            ]
        );
        assert!(registry.overlaps(0x13000..0x13001));
        assert!(!registry.overlaps(0x14000..0x20000));
    }

    #[test]
    fn partial_unmaps_leave_holes_that_are_no_longer_managed() {
        let mut registry = Registry::default();
        registry.insert(0x10000, 0x10000, 7);
        // The head, as llama.cpp unmaps the GGUF metadata.
        assert!(registry.unmapped(0x10000, 0x10000..0x12000).is_none());
        // A hole in the middle.
        assert!(registry.unmapped(0x10000, 0x14000..0x15000).is_none());
        assert!(!registry.overlaps(0x10000..0x12000));
        assert_eq!(
            registry.split(0x11000..0x16000),
            vec![
                Piece::Kernel(0x11000..0x12000),
                managed(7, 0x10000, 0x12000..0x14000),
                Piece::Kernel(0x14000..0x15000),
                managed(7, 0x10000, 0x15000..0x16000),
            ]
        );
        // The rest, in one call that also covers the hole again.
        let gone = registry.unmapped(0x10000, 0x12000..0x20000).unwrap();
        assert_eq!(gone.value, 7);
        assert!(registry.is_empty());
        assert!(registry.unmapped(0x10000, 0x10000..0x20000).is_none());
    }

    #[test]
    fn a_mapping_in_a_hole_of_another_is_split_and_unmapped_on_its_own() {
        let mut registry = Registry::default();
        registry.insert(0x10000, 0x8000, 1);
        assert!(registry.unmapped(0x10000, 0x13000..0x14000).is_none());
        registry.insert(0x13000, 0x1000, 2);
        assert_eq!(
            registry.split(0x12000..0x15000),
            vec![
                managed(1, 0x10000, 0x12000..0x13000),
                managed(2, 0x13000, 0x13000..0x14000),
                managed(1, 0x10000, 0x14000..0x15000),
            ]
        );
        let inner = registry.unmapped(0x13000, 0x13000..0x14000).unwrap();
        assert_eq!(inner.value, 2);
        assert!(!registry.overlaps(0x13000..0x14000));
        assert!(registry.overlaps(0x14000..0x14001));
    }

    #[test]
    fn mappings_sharing_a_base_are_told_apart_by_their_live_pages() {
        // The head of mapping 1 unmapped (as llama.cpp does), mapping 2 placed there.
        let mut registry = Registry::default();
        registry.insert(0x10000, 0x8000, 1);
        assert!(registry.unmapped(0x10000, 0x10000..0x12000).is_none());
        registry.insert(0x10000, 0x2000, 2);
        assert_eq!(
            registry.split(0x11000..0x13000),
            vec![
                managed(2, 0x10000, 0x11000..0x12000),
                managed(1, 0x10000, 0x12000..0x13000),
            ]
        );
        // Part of mapping 2: mapping 1 is untouched.
        assert!(registry.unmapped(0x10000, 0x10000..0x11000).is_none());
        assert_eq!(
            registry.split(0x10000..0x13000),
            vec![
                Piece::Kernel(0x10000..0x11000),
                managed(2, 0x10000, 0x11000..0x12000),
                managed(1, 0x10000, 0x12000..0x13000),
            ]
        );
        // The rest of mapping 2, then all of mapping 1.
        assert_eq!(
            registry.unmapped(0x10000, 0x11000..0x12000).unwrap().value,
            2
        );
        assert_eq!(
            registry.unmapped(0x10000, 0x12000..0x18000).unwrap().value,
            1
        );
        assert!(registry.is_empty());
    }
}
