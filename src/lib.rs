//! hyperoffload: a user-space pager that serves model weights into a reserved virtual
//! region through userfaultfd, reads them with io_uring, and keeps the resident set
//! within a RAM budget, with prefetch and eviction driven by a dependency graph of the
//! model.

mod event;
pub mod file;
pub mod glob;
pub mod graph;
mod installer;
pub mod layout;
pub mod map_candidate;
pub mod map_count;
pub mod model;
pub mod pager;
pub mod policy;
pub mod policy_name;
mod recent_faults;
pub mod ring;
mod service;
pub mod shared_store;
pub mod shim_config;
pub mod size;
mod stash;
pub mod stats;
pub mod sys;
pub mod trace;
mod uffd_ext;

pub use pager::{MapError, MapOptions, Pager, PagerBuilder, PagerError, Region};
pub use stats::Stats;

// The graph policy's tests (src/policy/graph/tests.rs) build their mixture of experts
// from the simulator's synthetic model shapes, `crate::sim::moe::MoeShape`. The
// simulator belongs to the binary (src/cli/sim); its shape files are compiled here for
// this crate's tests only, and name this crate `hyperoffload` as the binary does.
#[cfg(test)]
extern crate self as hyperoffload;

#[cfg(test)]
#[allow(dead_code)]
#[path = "cli/sim"]
mod sim {
    pub mod llama;
    pub mod moe;
    mod workload;

    pub use workload::Workload;
}
