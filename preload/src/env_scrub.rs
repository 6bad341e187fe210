//! `LD_PRELOAD` for what a process executes, and whether this image is served: the
//! constructor that carries out `process_claim`'s decision before `main`.
//!
//! Each process under the shim gets its own pager and budget, so children (other pids)
//! do not use it unless `HYPEROFFLOAD_INHERIT=1`: the budget is meant to bound one
//! process's memory, not to be multiplied by every program it starts. The process the
//! launcher started keeps it through every `exec` (same pid): a wrapper script that
//! execs the real program is the same process, and the real program is the one to serve.
//!
//! The constructor edits the environment strings in place: it claims the placeholder
//! (an identity is never longer than it), and takes the shim out of `LD_PRELOAD` where
//! the decision says so (the list only gets shorter). No allocation, no libc
//! environment functions, nothing that could run before libc is ready. Whatever exec
//! path a program takes (execve and its libc variants, fexecve, posix_spawn, vfork,
//! system, libc's internal calls), the next image decides afresh from what it was given.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

use hyperoffload::shim_config::{ENV_KEEPER, ENV_PROCESS, PROCESS_UNCLAIMED};
use hyperoffload::sys;
use libc::{c_char, c_int};

use crate::process_claim::{self, Decision, IDENTITY_MAX};

/// The shared object's file name, as the launcher puts it in LD_PRELOAD.
const SHIM_NAME: &[u8] = b"libhyperoffload_preload";

const UNDECIDED: u8 = 0;
const DECIDING: u8 = 1;
const SERVE: u8 = 2;
const INERT: u8 = 3;

// An identity and its terminator fit in the placeholder (see `carry_out`).
const _: () = assert!(IDENTITY_MAX < PROCESS_UNCLAIMED.len());

/// This image's decision, made once.
static DECIDED: AtomicU8 = AtomicU8::new(UNDECIDED);
/// Whether this image is the process the launcher started (see `launched_process`).
static LAUNCHED: AtomicBool = AtomicBool::new(false);

#[used]
#[link_section = ".init_array"]
static SCRUB_AT_LOAD: extern "C" fn(c_int, *const *const c_char, *const *mut c_char) = scrub;

extern "C" fn scrub(_argc: c_int, _argv: *const *const c_char, envp: *const *mut c_char) {
    decide_once(envp);
}

extern "C" {
    /// libc's environment: for a hook called before this library's constructor (from an
    /// earlier library's), when the decision is made from it instead.
    static environ: *const *mut c_char;
}

/// Whether the shim serves this image. Made by the constructor; a hook called before it
/// (another library's constructor mapping a file) makes it from libc's `environ`, which
/// is the same array. The caller is the shim's owner (not a vfork-like child sharing its
/// memory): the decision may edit the environment.
pub fn serves_this_process() -> bool {
    match DECIDED.load(Ordering::Acquire) {
        SERVE => true,
        INERT | DECIDING => false,
        _ => {
            // SAFETY: reads libc's `environ` pointer, set before any constructor runs.
            decide_once(unsafe { environ });
            DECIDED.load(Ordering::Acquire) == SERVE
        }
    }
}

/// Whether this image is the process the launcher started (through its execs), as
/// decided with `serves_this_process`.
pub fn launched_process() -> bool {
    serves_this_process() && LAUNCHED.load(Ordering::Acquire)
}

/// Decides (once, whoever calls first) and carries the decision out on `envp`.
fn decide_once(envp: *const *mut c_char) {
    if DECIDED
        .compare_exchange(UNDECIDED, DECIDING, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return;
    }
    // SAFETY: `envp` is libc's NULL-terminated environment (or NULL), as above.
    let serve = unsafe { decide_on(envp) };
    DECIDED.store(if serve { SERVE } else { INERT }, Ordering::Release);
}

/// The variables of `envp` the decision reads.
#[derive(Default)]
struct Found {
    preload: Option<*mut c_char>,
    marker: Option<*mut c_char>,
    inherit: bool,
    /// `HYPEROFFLOAD_KEEPER`'s descriptor number.
    keeper: Option<i32>,
}

/// Walks the environment, decides, and edits it in place as decided; returns whether
/// the image is served.
///
/// # Safety
/// `envp` must be NULL or a NULL-terminated array of writable NUL-terminated strings.
unsafe fn decide_on(envp: *const *mut c_char) -> bool {
    let mut found = Found::default();
    if !envp.is_null() {
        let mut index = 0;
        loop {
            // SAFETY: the caller guarantees a NULL-terminated array of NUL-terminated
            // strings.
            let entry = unsafe { *envp.add(index) };
            if entry.is_null() {
                break;
            }
            // SAFETY: as above.
            let bytes = unsafe { std::ffi::CStr::from_ptr(entry) }.to_bytes();
            if bytes == b"HYPEROFFLOAD_INHERIT=1" {
                found.inherit = true;
            } else if bytes.starts_with(b"LD_PRELOAD=") {
                found.preload = Some(entry);
            } else if value_of(bytes, ENV_PROCESS.as_bytes()).is_some() {
                found.marker = Some(entry);
            } else if let Some(value) = value_of(bytes, ENV_KEEPER.as_bytes()) {
                found.keeper = parse_fd(value);
            }
            index += 1;
        }
    }
    let marker_value = found.marker.map(|entry| {
        // SAFETY: `entry` is one of the environment's NUL-terminated strings (above).
        let bytes = unsafe { std::ffi::CStr::from_ptr(entry) }.to_bytes();
        &bytes[ENV_PROCESS.len() + 1..]
    });
    let marker = process_claim::marker(marker_value, PROCESS_UNCLAIMED.as_bytes());
    let mut me = [0u8; IDENTITY_MAX];
    let me_len = own_identity(&mut me);
    // SAFETY: getauxval only reads the auxiliary vector.
    let secure = unsafe { libc::getauxval(libc::AT_SECURE) } != 0;
    let decision = process_claim::decide(marker, &me[..me_len], found.inherit, secure);
    let launched = process_claim::is_launched(marker, &me[..me_len], secure);
    LAUNCHED.store(launched, Ordering::Release);
    carry_out(decision, &found, &me[..me_len]);
    if let (false, Some(fd)) = (launched, found.keeper) {
        // A child inherited the keeper's socket from the launched process: nothing here
        // uses it, and nothing it runs should hold it.
        // A number from the environment: the program may have closed it before exec.
        if sys::files::is_open(fd)
            // SAFETY: `fd` is open (checked just before), and stays so while borrowed:
            // before `main`, no other thread runs to close it.
            && sys::sockets::is_seqpacket(unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) })
        {
            // SAFETY: `fd` is open (checked just above) and is the launcher's socket,
            // which nothing in this image has taken ownership of yet (before `main`).
            drop(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) });
        }
    }
    decision.serve
}

/// A descriptor number above 2 written in decimal, without allocating.
fn parse_fd(value: &[u8]) -> Option<i32> {
    if value.is_empty() || value.len() > 9 || !value.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let fd = value
        .iter()
        .fold(0i32, |fd, &digit| fd * 10 + i32::from(digit - b'0'));
    (fd > 2).then_some(fd)
}

/// Edits the environment as `decision` says.
fn carry_out(decision: Decision, found: &Found, me: &[u8]) {
    if let (true, Some(entry)) = (decision.claim, found.marker) {
        // SAFETY: the entry is `HYPEROFFLOAD_PROCESS=` and the placeholder, writable;
        // the identity and its terminator fit in the placeholder's bytes (IDENTITY_MAX
        // is less than its length), so nothing is written past the string's end.
        unsafe {
            let value = entry.add(ENV_PROCESS.len() + 1).cast::<u8>();
            std::ptr::copy_nonoverlapping(me.as_ptr(), value, me.len());
            *value.add(me.len()) = 0;
        }
    }
    if let (false, Some(entry)) = (decision.keep_preload, found.preload) {
        // SAFETY: `entry` is a writable NUL-terminated string (above); the value starts
        // after the 11-byte "LD_PRELOAD=" prefix.
        unsafe { remove_shim(entry.add(11)) };
    }
}

/// `NAME=value`'s value if `entry` is that variable.
fn value_of<'a>(entry: &'a [u8], name: &[u8]) -> Option<&'a [u8]> {
    entry
        .strip_prefix(name)
        .and_then(|rest| rest.strip_prefix(b"="))
}

/// This process's identity (see `process_claim`) into `out`; its length.
fn own_identity(out: &mut [u8; IDENTITY_MAX]) -> usize {
    let mut stat = [0u8; 1024];
    let start = sys::files::open_read(c"/proc/self/stat")
        .and_then(|file| {
            use std::os::fd::AsFd;
            sys::files::read(file.as_fd(), &mut stat)
        })
        .ok()
        .and_then(|len| process_claim::start_time(&stat[..len]))
        .unwrap_or(0);
    process_claim::format_identity(sys::processes::getpid() as u32, start, out)
}

/// Removes the shim's entries from a `:`/space separated list, in place.
///
/// # Safety
/// `list` must be a writable NUL-terminated string.
unsafe fn remove_shim(list: *mut c_char) {
    // SAFETY: the caller guarantees a NUL-terminated string.
    let len = unsafe { std::ffi::CStr::from_ptr(list) }.to_bytes().len();
    // SAFETY: `len` bytes are part of the string and writable.
    let bytes = unsafe { std::slice::from_raw_parts_mut(list.cast::<u8>(), len) };
    let kept = filter_list(bytes);
    // SAFETY: kept <= len, so the terminator lands inside the original string.
    unsafe { *list.add(kept) = 0 };
}

/// Compacts `list` to its entries that are not the shim, joined by `:`. Returns the new
/// length.
fn filter_list(list: &mut [u8]) -> usize {
    let mut write = 0;
    let mut read = 0;
    while read < list.len() {
        while read < list.len() && (list[read] == b':' || list[read] == b' ') {
            read += 1;
        }
        let start = read;
        while read < list.len() && list[read] != b':' && list[read] != b' ' {
            read += 1;
        }
        if start == read {
            break;
        }
        let entry = start..read;
        let name_start = list[entry.clone()]
            .iter()
            .rposition(|&b| b == b'/')
            .map_or(start, |slash| start + slash + 1);
        if list[name_start..read].starts_with(SHIM_NAME) {
            continue;
        }
        if write > 0 {
            list[write] = b':';
            write += 1;
        }
        list.copy_within(entry.clone(), write);
        write += entry.len();
    }
    write
}

#[cfg(test)]
mod tests {
    use super::filter_list;

    fn filtered(list: &str) -> String {
        let mut bytes = list.as_bytes().to_vec();
        let len = filter_list(&mut bytes);
        String::from_utf8(bytes[..len].to_vec()).unwrap()
    }

    #[test]
    fn removes_only_the_shim() {
        assert_eq!(filtered("/opt/h/libhyperoffload_preload.so"), "");
        assert_eq!(
            filtered("/a/libx.so:/opt/h/libhyperoffload_preload.so /b/liby.so"),
            "/a/libx.so:/b/liby.so"
        );
        assert_eq!(
            filtered("libhyperoffload_preload.so:/a/libx.so"),
            "/a/libx.so"
        );
        assert_eq!(filtered("/a/libx.so"), "/a/libx.so");
    }
}
