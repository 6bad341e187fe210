//! The RAM budget and the memory pressure it answers to: the smallest budget the pager
//! can work in (`floor`), what the machine and the memory cgroup allow
//! (`memory_limits`), what they can spare while the program runs (`memory_pressure`,
//! with the kernel's notifications in `pressure_events`), the next budget under
//! `--budget auto` (`follow`), and the budget over time as the stats report it
//! (`history`). These know nothing of the shim's configuration or of a pager, which use
//! them.
//!
//! Beside this folder: `crate::budget_check` checks a configuration's budget before the
//! program runs, and `crate::pressure_follower::PressureFollower` reads the pressure and
//! resizes a pager, on the shim's thread under `--budget auto` or on a library user's.
//! The fault service keeps resident bytes within the budget (`service/budget.rs`).

pub mod floor;
pub mod follow;
pub mod history;
pub mod memory_limits;
pub mod memory_pressure;
pub mod pressure_events;
