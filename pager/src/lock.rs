//! Locks that outlive a panic.
//!
//! A thread that panics while holding one of the pager's locks leaves data that is still
//! consistent (every critical section is a push, a pop or a copy), and the service must
//! keep serving faults regardless: so a poisoned lock is taken as it is.

use std::sync::{Mutex, MutexGuard};

/// Locks `mutex`, ignoring poisoning (see the module comment).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
