//! Policies by the names users give them (`hyperoffload run --policy`, the shim's
//! `HYPEROFFLOAD_POLICY`). One table, so a new policy is added in one place.

use thiserror::Error;

use crate::policy::{
    EvictionKind, EvictionPolicy, PrefetchKind, PrefetchPolicy, SequentialReadahead,
};

/// A prefetch and an eviction policy chosen together.
pub struct PolicyPair {
    pub prefetch: Box<dyn PrefetchPolicy>,
    pub eviction: Box<dyn EvictionPolicy>,
}

/// The names accepted, the default first, with what each means.
pub const POLICY_NAMES: &[(&str, &str)] = &[
    (
        "readahead",
        "sequential readahead on faults, FIFO eviction (the default)",
    ),
    ("demand", "read only what faults, FIFO eviction"),
];

pub const DEFAULT_POLICY: &str = "readahead";

#[derive(Debug, Error, PartialEq, Eq)]
#[error("unknown policy `{name}` (known: {known})")]
pub struct UnknownPolicy {
    pub name: String,
    pub known: String,
}

/// Whether `name` names a policy.
pub fn check_policy_name(name: &str) -> Result<(), UnknownPolicy> {
    kinds(name).map(|_| ())
}

/// Builds the policies `name` stands for, sized for a pager with `budget` bytes.
///
/// Readahead windows are capped at a quarter of the budget (the first at an eighth): a
/// window near the budget evicts, first in first out, the very blocks woken threads are
/// about to touch, and a small budget then livelocks (measured: llama.cpp at a 1 MiB
/// budget read 300 GB without finishing a 24-token run; with the cap it takes seconds).
pub fn policies_by_name(name: &str, budget: u64) -> Result<PolicyPair, UnknownPolicy> {
    let (prefetch, eviction) = kinds(name)?;
    let prefetch: Box<dyn PrefetchPolicy> = match prefetch {
        PrefetchKind::Readahead => {
            let mut readahead = SequentialReadahead::default();
            readahead.max_window_bytes = readahead.max_window_bytes.min(budget / 4);
            readahead.initial_window_bytes = readahead.initial_window_bytes.min(budget / 8);
            Box::new(readahead)
        }
        other => other.build(),
    };
    Ok(PolicyPair {
        prefetch,
        eviction: eviction.build(),
    })
}

fn kinds(name: &str) -> Result<(PrefetchKind, EvictionKind), UnknownPolicy> {
    match name {
        "readahead" => Ok((PrefetchKind::Readahead, EvictionKind::Fifo)),
        "demand" => Ok((PrefetchKind::None, EvictionKind::Fifo)),
        _ => Err(UnknownPolicy {
            name: name.to_string(),
            known: POLICY_NAMES
                .iter()
                .map(|(name, _)| *name)
                .collect::<Vec<_>>()
                .join(", "),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_name_builds() {
        for (name, _) in POLICY_NAMES {
            let pair = policies_by_name(name, 1 << 30).unwrap();
            assert!(!pair.prefetch.name().is_empty());
        }
        assert_eq!(POLICY_NAMES[0].0, DEFAULT_POLICY);
    }

    #[test]
    fn unknown_names_list_the_known_ones() {
        let error = check_policy_name("belady").unwrap_err();
        assert!(error.to_string().contains("readahead"), "{error}");
    }
}
