//! hyperoffload: a user-space pager that serves model weights into a reserved virtual
//! region through userfaultfd, reads them with io_uring, and keeps the resident set
//! within a RAM budget, with prefetch and eviction driven by a dependency graph of the
//! model.

pub mod budget;
pub mod budget_check;
mod command;
mod event;
pub mod file;
pub mod geometry;
pub mod glob;
pub mod graph;
pub mod hole_fill;
pub mod keeper;
pub mod layout;
mod lock;
pub mod map_count;
pub mod model;
pub mod pager;
pub mod policy;
pub mod policy_name;
pub mod pressure_follower;
mod recent_faults;
pub mod remote;
pub mod ring;
pub mod served_files;
mod service;
pub mod shaped_region;
pub mod share;
pub mod shared_store;
pub mod shim_config;
pub mod size;
mod stash;
pub mod stats;
pub mod sys;
pub mod trace;
pub mod trace_region;
mod uffd_ext;
mod wire;

pub use pager::{BudgetError, MapError, MapOptions, Pager, PagerBuilder, PagerError, Region};
pub use stats::Stats;
