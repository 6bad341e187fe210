//! Which cached blocks to drop when the cache tier is over its size.
//!
//! The order is a trait, so the cache knows nothing of models: an order ranks
//! candidates, the lowest rank goes first. `Lru` here; the graph's order for model
//! objects is `graph_eviction::GraphOrder`. Pure.

use std::sync::Arc;

/// A cached block that may be dropped (not being read at the moment).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// The object's number in the cache.
    pub object: usize,
    /// The block's number in the object.
    pub block: u64,
    /// Its last use (a cache-wide counter, larger is later).
    pub tick: u64,
    /// Its size in bytes.
    pub bytes: u64,
}

/// An eviction order: lower ranks are evicted first.
pub trait EvictionOrder: Send + Sync {
    fn rank(&self, candidate: &Candidate) -> u64;

    /// The blocks to drop to free at least `need` bytes, in the order to drop them;
    /// fewer (all candidates) when they do not hold that much.
    fn victims(&self, candidates: &[Candidate], need: u64) -> Vec<Candidate> {
        if need == 0 {
            return Vec::new();
        }
        let mut sorted = candidates.to_vec();
        sorted.sort_by_cached_key(|c| (self.rank(c), c.object, c.block));
        take_victims(sorted, need)
    }
}

/// The first of `sorted` (in eviction order) that free at least `need` bytes; all of
/// them when they hold less.
pub fn take_victims(sorted: impl IntoIterator<Item = Candidate>, need: u64) -> Vec<Candidate> {
    let mut freed = 0u64;
    let mut out = Vec::new();
    for candidate in sorted {
        if freed >= need {
            break;
        }
        freed += candidate.bytes;
        out.push(candidate);
    }
    out
}

/// An order shared with whoever feeds it (the mount tells a `GraphOrder` what is read).
impl<T: EvictionOrder + ?Sized> EvictionOrder for Arc<T> {
    fn rank(&self, candidate: &Candidate) -> u64 {
        (**self).rank(candidate)
    }

    fn victims(&self, candidates: &[Candidate], need: u64) -> Vec<Candidate> {
        (**self).victims(candidates, need)
    }
}

/// Least recently used first.
#[derive(Debug, Clone, Copy, Default)]
pub struct Lru;

impl EvictionOrder for Lru {
    fn rank(&self, candidate: &Candidate) -> u64 {
        candidate.tick
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(object: usize, block: u64, tick: u64) -> Candidate {
        Candidate {
            object,
            block,
            tick,
            bytes: 100,
        }
    }

    #[test]
    fn lru_drops_the_oldest_until_enough_is_free() {
        let candidates = [c(0, 0, 5), c(0, 1, 2), c(1, 0, 9), c(1, 1, 1)];
        let victims = Lru.victims(&candidates, 150);
        assert_eq!(victims, [c(1, 1, 1), c(0, 1, 2)]);
        assert_eq!(Lru.victims(&candidates, 0), []);
        assert_eq!(Lru.victims(&candidates, 10_000).len(), 4);
    }

    #[test]
    fn another_order_plugs_in() {
        struct NewestFirst;
        impl EvictionOrder for NewestFirst {
            fn rank(&self, candidate: &Candidate) -> u64 {
                u64::MAX - candidate.tick
            }
        }
        let candidates = [c(0, 0, 5), c(0, 1, 2)];
        assert_eq!(NewestFirst.victims(&candidates, 1), [c(0, 0, 5)]);
    }
}
