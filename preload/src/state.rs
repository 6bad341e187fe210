//! The shim's life cycle, one atomic state:
//!
//! ```text
//!  Uninit --first candidate mmap--> Initializing --config ok--> Ready
//!                                        |                        |
//!                                        +--bad config / setuid--> Disabled
//!  Ready --fork, in the child--> ForkedChild   (pass-through for good)
//! ```
//!
//! Every hook passes straight through unless the state is `Ready`. Configuration is
//! read on the first mapping that could be managed (not in a constructor: the
//! environment and allocator are certainly usable by then). A hook re-entered during
//! initialisation, or called by another thread meanwhile, passes through.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use hyperoffload::shim_config::{physical_ram, ShimConfig};

use crate::managed::Shim;
use crate::raw;

const UNINIT: u8 = 0;
const INITIALIZING: u8 = 1;
const READY: u8 = 2;
const DISABLED: u8 = 3;
const FORKED_CHILD: u8 = 4;

static STATE: AtomicU8 = AtomicU8::new(UNINIT);
static SHIM: OnceLock<Shim> = OnceLock::new();

/// The shim, if it is serving this process.
pub fn ready() -> Option<&'static Shim> {
    if STATE.load(Ordering::Acquire) == READY {
        SHIM.get()
    } else {
        None
    }
}

/// The shim, initialising it first if this is the first candidate mapping.
pub fn ready_or_init() -> Option<&'static Shim> {
    match STATE.compare_exchange(UNINIT, INITIALIZING, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => {
            let next = match read_config() {
                Some(config) => {
                    // Only this thread gets here, once.
                    let _ = SHIM.set(Shim::new(config));
                    READY
                }
                None => DISABLED,
            };
            STATE.store(next, Ordering::Release);
            ready()
        }
        Err(_) => ready(),
    }
}

/// In a child after fork: the managed regions were not inherited (MADV_DONTFORK) and the
/// pager's service thread does not exist here, so nothing of the parent's shim may be
/// touched; its state is leaked, never dropped.
pub fn become_forked_child() {
    STATE.store(FORKED_CHILD, Ordering::Release);
}

pub fn is_forked_child() -> bool {
    STATE.load(Ordering::Acquire) == FORKED_CHILD
}

fn read_config() -> Option<ShimConfig> {
    // SAFETY: getauxval only reads the auxiliary vector.
    if unsafe { libc::getauxval(libc::AT_SECURE) } != 0 {
        // A setuid/setgid program: its environment is the caller's, not to be trusted.
        return None;
    }
    match ShimConfig::from_lookup(getenv, physical_ram()) {
        Ok(config) => Some(config),
        Err(error) => {
            raw::write_stderr(
                format!("hyperoffload: {error}; the shim is disabled, the program runs unpaged\n")
                    .as_bytes(),
            );
            None
        }
    }
}

/// getenv(3), without Rust's environment lock (the shim may run inside any call).
fn getenv(name: &str) -> Option<String> {
    let mut key = [0u8; 64];
    if name.len() >= key.len() {
        return None;
    }
    key[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: `key` is NUL-terminated; getenv returns NULL or a NUL-terminated string
    // owned by the environment, copied out at once.
    unsafe {
        let value = libc::getenv(key.as_ptr().cast());
        if value.is_null() {
            return None;
        }
        Some(
            std::ffi::CStr::from_ptr(value)
                .to_string_lossy()
                .into_owned(),
        )
    }
}

/// The shim as configured, whatever the state now (for the exit report: the pager may
/// have run before the shim was disabled).
pub fn shim_even_if_disabled() -> Option<&'static Shim> {
    SHIM.get()
}
