//! The LD_PRELOAD shim: makes unmodified programs read their model files through the
//! hyperoffload pager. It interposes the memory-mapping calls (see `api`), takes over
//! read-only mappings of matching files (see `crate::map_candidate`) and hands
//! everything else to the kernel through the raw system call.
//!
//! Behaviour chosen where the kernel's cannot be kept:
//! - fork: managed regions are MADV_DONTFORK (the child has no fault service); a child
//!   made by fork (ours or libc's, which run the atfork handlers) maps the files in
//!   their place from the kernel's page cache (`fork_child`). A forked child runs with
//!   the shim in pass-through for good: the parent's pager thread does not exist there.
//!   Children made without the handlers (_Fork, raw clone, vfork) are told apart by pid
//!   (`state`); the first two lack the managed ranges (an access faults SIGSEGV, never
//!   zeros).
//! - exec: the process the launcher started keeps the shim through every exec (same
//!   pid: wrappers, `env`); children (other pids) do not, unless HYPEROFFLOAD_INHERIT=1
//!   (`process_claim`, `env_scrub`).
//! - mremap of managed memory: refused with EINVAL (and a warning once); in a served
//!   forked child, of the ranges it inherited served (`fork_child`).
//! - mlock of managed memory: pins within the budget; beyond it, ENOMEM and a warning.
//! - MAP_FIXED requests pass through; one over managed memory releases that part first.
//! - setuid/setgid (AT_SECURE) programs: the shim stays off and reads no environment.
//!
//! Modules, each using (through `crate::`) only modules listed before it, so that none
//! depends on one that depends back on it:
//! 1. Leaves, using no other module but `replace_file`: `raw` (the kernel's own calls), `heap` (the counting
//!    allocator), `registry` (the managed address ranges), `read_ahead` (how far a hint
//!    reads), `given_name` (the program's name for a file), `process_claim` (which
//!    process is served, as pure functions), `fork_plan` (what a forked child maps in
//!    place of the managed ranges), `exit_report` (the files written at exit, and the stats snapshots
//!    written while the program runs, from what it is given; uses `replace_file`), `periodic` (a thread of
//!    the shim's own, calling a function at a period), `replace_file` (a private file
//!    replaced whole), `seen` (the records of the model files the program opened or
//!    mapped, and what became of each; uses `replace_file`).
//! 2. `env_scrub` (the constructor deciding whether this image is served, and
//!    LD_PRELOAD for what it executes) uses `process_claim`.
//! 3. `managed` (the shim: what it does to each call it takes over) uses `raw`,
//!    `registry`, `read_ahead`, `given_name`, `fork_plan`, `seen`.
//! 4. `state` (the life cycle: the init state, the re-entry guard, the exit handler,
//!    the snapshots) uses `managed`, `env_scrub`, `exit_report`, `periodic`, `heap`,
//!    `raw`.
//! 5. `fork_child` (the atfork handlers) uses `state`, `fork_plan`, `raw`.
//! 6. `api` (every exported C symbol) uses `state`, `fork_child`, `managed`, `raw`.

// In unit-test builds the C entry points are not exported, so nothing calls them.
#![cfg_attr(test, allow(dead_code))]

mod api;
mod env_scrub;
mod exit_report;
mod fork_child;
mod fork_plan;
mod given_name;
mod heap;
mod managed;
mod map_candidate;
mod periodic;
mod process_claim;
mod raw;
mod read_ahead;
mod registry;
mod replace_file;
mod seen;
mod state;

/// Counts the heap this library's Rust code holds: the pager's own memory (see `heap`).
#[global_allocator]
static ALLOCATOR: heap::CountingAllocator = heap::CountingAllocator::heap();
