//! hyperoffload: a user-space pager that serves model weights into a reserved virtual
//! region through userfaultfd, reads them with io_uring, and keeps the resident set
//! within a RAM budget, with prefetch and eviction driven by a dependency graph of the
//! model.

pub mod cli;
pub mod graph;
pub mod model;
pub mod policy;
pub mod sim;
pub mod size;
pub mod trace;
