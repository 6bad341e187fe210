//! The LD_PRELOAD shim: makes unmodified programs read their model files through the
//! hyperoffload pager. It interposes the memory-mapping calls (see `api`), takes over
//! read-only mappings of matching files (see `hyperoffload::map_candidate`) and hands
//! everything else to the kernel through the raw system call.
//!
//! Behaviour chosen where the kernel's cannot be kept:
//! - fork: managed regions are MADV_DONTFORK, so a child does not have them (an access
//!   faults SIGSEGV; it never reads zeros). A forked child runs with the shim in
//!   pass-through for good: the parent's pager thread does not exist there. Children made
//!   without our `fork` (daemon, _Fork, raw clone, vfork) are told apart by pid (`state`).
//! - exec: children do not inherit the shim unless HYPEROFFLOAD_INHERIT=1 (`env_scrub`).
//! - mremap of managed memory: refused with EINVAL (and a warning once).
//! - mlock of managed memory: pins within the budget; beyond it, ENOMEM and a warning.
//! - MAP_FIXED requests pass through; one over managed memory releases that part first.
//! - setuid/setgid (AT_SECURE) programs: the shim stays off and reads no environment.

// In unit-test builds the C entry points are not exported, so nothing calls them.
#![cfg_attr(test, allow(dead_code))]

mod api;
mod env_scrub;
mod exit_report;
mod given_name;
mod heap;
mod managed;
mod raw;
mod read_ahead;
mod registry;
mod state;

/// Counts the heap this library's Rust code holds: the pager's own memory (see `heap`).
#[global_allocator]
static ALLOCATOR: heap::CountingAllocator = heap::CountingAllocator;
