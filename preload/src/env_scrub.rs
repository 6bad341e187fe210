//! Child processes do not inherit the shim unless `HYPEROFFLOAD_INHERIT=1`: each process
//! under the shim gets its own pager and budget, so a program that starts others would
//! otherwise multiply the memory the budget is meant to bound.
//!
//! A constructor removes this library from `LD_PRELOAD` in the process's own
//! environment before `main` runs, so that whatever the program executes starts without
//! it. It edits the string in place (it only gets shorter): no allocation, no libc
//! environment functions, nothing that could run before libc is ready.

use libc::{c_char, c_int};

/// The shared object's file name, as the launcher puts it in LD_PRELOAD.
const SHIM_NAME: &[u8] = b"libhyperoffload_preload";

#[used]
#[link_section = ".init_array"]
static SCRUB_AT_LOAD: extern "C" fn(c_int, *const *const c_char, *const *mut c_char) = scrub;

extern "C" fn scrub(_argc: c_int, _argv: *const *const c_char, envp: *const *mut c_char) {
    if envp.is_null() {
        return;
    }
    let mut preload: Option<*mut c_char> = None;
    let mut index = 0;
    loop {
        // SAFETY: glibc passes the NULL-terminated environment array to constructors;
        // each entry is a NUL-terminated string in writable memory.
        let entry = unsafe { *envp.add(index) };
        if entry.is_null() {
            break;
        }
        // SAFETY: as above.
        let bytes = unsafe { std::ffi::CStr::from_ptr(entry) }.to_bytes();
        if bytes == b"HYPEROFFLOAD_INHERIT=1" {
            return;
        }
        if bytes.starts_with(b"LD_PRELOAD=") {
            preload = Some(entry);
        }
        index += 1;
    }
    if let Some(entry) = preload {
        // SAFETY: `entry` is a writable NUL-terminated string (above); the value starts
        // after the 11-byte "LD_PRELOAD=" prefix.
        unsafe { remove_shim(entry.add(11)) };
    }
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
