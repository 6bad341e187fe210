//! Which process the shim serves, decided once per program image, as pure functions over
//! bytes (the constructor in `env_scrub` feeds them the environment and the kernel's
//! facts, and carries the decision out).
//!
//! The launcher starts its program with `HYPEROFFLOAD_PROCESS` set to a fixed-width
//! placeholder. The first image that loads the shim (the launched process, before
//! `main`) overwrites it in place with its own identity; every image after an `exec` in
//! that same process (a `#!/bin/sh` wrapper, pyenv's shim, `env`) finds its own
//! identity there and keeps the pager and `LD_PRELOAD`. Any other process that loads the
//! shim with that environment is a child: it takes the shim out of its own
//! `LD_PRELOAD` and stays inert, unless inheritance is on (then it is served with a
//! pager of its own, as before).
//!
//! An identity is the pid and the process's start time (clock ticks since boot, from
//! `/proc/self/stat`): a pid alone could be reused by a descendant after the launched
//! process died; with the start time it cannot (an `exec` keeps both). Where `/proc`
//! cannot be read, the start time is 0 and the pid alone decides.

/// What `HYPEROFFLOAD_PROCESS` says in this image's environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Marker<'a> {
    /// Not set: the shim was preloaded by hand, not by the launcher.
    Absent,
    /// The launcher's placeholder: no image has claimed the process yet.
    Unclaimed,
    /// An identity written by an image that claimed it (or anything else: a value the
    /// shim did not write is nobody's identity, so never this process's).
    Claimed(&'a [u8]),
}

/// The marker's value as found in the environment.
pub fn marker<'a>(value: Option<&'a [u8]>, unclaimed: &[u8]) -> Marker<'a> {
    match value {
        None => Marker::Absent,
        Some(value) if value == unclaimed => Marker::Unclaimed,
        Some(value) => Marker::Claimed(value),
    }
}

/// What this image does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// The shim serves this image (else every hook passes through, for good).
    pub serve: bool,
    /// Write this process's identity over the placeholder.
    pub claim: bool,
    /// Leave the shim in `LD_PRELOAD`, for what this process executes (else it is taken
    /// out, so no descendant of a child loads it at all).
    pub keep_preload: bool,
}

/// The decision for an image with `marker`, whose own identity is `me`.
///
/// `secure`: the image runs setuid/setgid (AT_SECURE); its environment is its caller's,
/// not to be trusted, and it is never served. `inherit`: `HYPEROFFLOAD_INHERIT=1`.
pub fn decide(marker: Marker<'_>, me: &[u8], inherit: bool, secure: bool) -> Decision {
    if secure {
        return Decision {
            serve: false,
            claim: false,
            keep_preload: false,
        };
    }
    match marker {
        // Preloaded by hand: this process is served, its children only with inherit
        // (the rule before the launcher marked its process).
        Marker::Absent => Decision {
            serve: true,
            claim: false,
            keep_preload: inherit,
        },
        Marker::Unclaimed => Decision {
            serve: true,
            claim: true,
            keep_preload: true,
        },
        Marker::Claimed(owner) if owner == me => Decision {
            serve: true,
            claim: false,
            keep_preload: true,
        },
        Marker::Claimed(_) => Decision {
            serve: inherit,
            claim: false,
            keep_preload: inherit,
        },
    }
}

/// Whether an image with `marker` and identity `me` is the process the launcher
/// started (the first image, or a later one after an exec in it), not a child.
pub fn is_launched(marker: Marker<'_>, me: &[u8], secure: bool) -> bool {
    !secure
        && match marker {
            Marker::Unclaimed => true,
            Marker::Claimed(owner) => owner == me,
            Marker::Absent => false,
        }
}

/// Room for an identity: a pid (at most 10 digits), a dot, a start time (at most 20).
pub const IDENTITY_MAX: usize = 31;

/// Writes `pid.start` into `out`, returning its length (no allocation).
pub fn format_identity(pid: u32, start: u64, out: &mut [u8; IDENTITY_MAX]) -> usize {
    let mut at = write_decimal(u64::from(pid), out, 0);
    out[at] = b'.';
    at += 1;
    write_decimal(start, out, at)
}

fn write_decimal(mut value: u64, out: &mut [u8], at: usize) -> usize {
    let mut digits = [0u8; 20];
    let mut count = 0;
    loop {
        digits[count] = b'0' + (value % 10) as u8;
        count += 1;
        value /= 10;
        if value == 0 {
            break;
        }
    }
    for i in 0..count {
        out[at + i] = digits[count - 1 - i];
    }
    at + count
}

/// The start time (field 22) of a `/proc/<pid>/stat` line. The command name (field 2)
/// may hold spaces and parentheses, so fields are counted after its last `)`.
pub fn start_time(stat: &[u8]) -> Option<u64> {
    let close = stat.iter().rposition(|&b| b == b')')?;
    // Fields 3.. follow the name; the start time is the 20th of them.
    let field = stat[close + 1..]
        .split(|&b| b == b' ')
        .filter(|field| !field.is_empty())
        .nth(22 - 3)?;
    let mut value: u64 = 0;
    for &byte in field {
        if !byte.is_ascii_digit() {
            return None;
        }
        value = value.checked_mul(10)?.checked_add(u64::from(byte - b'0'))?;
    }
    Some(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    const UNCLAIMED: &[u8] = b"unclaimed-process-id-placeholder";

    #[test]
    fn the_first_image_claims_and_later_images_of_the_same_process_are_served() {
        let me = b"4242.9001";
        let first = decide(marker(Some(UNCLAIMED), UNCLAIMED), me, false, false);
        assert_eq!(
            first,
            Decision {
                serve: true,
                claim: true,
                keep_preload: true
            }
        );
        let after_exec = decide(marker(Some(me), UNCLAIMED), me, false, false);
        assert!(after_exec.serve && after_exec.keep_preload && !after_exec.claim);
    }

    #[test]
    fn another_process_is_inert_unless_inheritance_is_on() {
        let child = decide(Marker::Claimed(b"4242.9001"), b"4243.9050", false, false);
        assert_eq!(
            child,
            Decision {
                serve: false,
                claim: false,
                keep_preload: false
            }
        );
        let inherited = decide(Marker::Claimed(b"4242.9001"), b"4243.9050", true, false);
        assert!(inherited.serve && inherited.keep_preload && !inherited.claim);
        // The same pid reused later by a descendant: another start time, a child.
        let reused = decide(Marker::Claimed(b"4242.9001"), b"4242.777777", false, false);
        assert!(!reused.serve && !reused.keep_preload);
        // Not an identity the shim wrote: nobody's.
        assert!(!decide(Marker::Claimed(b""), b"1.0", false, false).serve);
    }

    #[test]
    fn preloaded_by_hand_the_process_is_served_and_children_only_with_inherit() {
        let alone = decide(marker(None, UNCLAIMED), b"7.7", false, false);
        assert!(alone.serve && !alone.claim && !alone.keep_preload);
        assert!(decide(Marker::Absent, b"7.7", true, false).keep_preload);
    }

    #[test]
    fn only_the_launched_process_through_its_execs_is_the_launched_one() {
        assert!(is_launched(Marker::Unclaimed, b"7.1", false));
        assert!(is_launched(Marker::Claimed(b"7.1"), b"7.1", false));
        assert!(
            !is_launched(Marker::Claimed(b"7.1"), b"8.2", false),
            "a child"
        );
        assert!(
            !is_launched(Marker::Absent, b"7.1", false),
            "preloaded by hand"
        );
        assert!(!is_launched(Marker::Unclaimed, b"7.1", true), "setuid");
    }

    #[test]
    fn a_setuid_image_is_never_served_and_claims_nothing() {
        for marker in [Marker::Absent, Marker::Unclaimed, Marker::Claimed(b"7.7")] {
            let decision = decide(marker, b"7.7", true, true);
            assert!(!decision.serve && !decision.claim && !decision.keep_preload);
        }
    }

    #[test]
    fn identities_fit_the_placeholder() {
        let mut out = [0u8; IDENTITY_MAX];
        let len = format_identity(u32::MAX, u64::MAX, &mut out);
        assert_eq!(&out[..len], b"4294967295.18446744073709551615");
        assert!(len <= UNCLAIMED.len());
        let len = format_identity(12, 0, &mut out);
        assert_eq!(&out[..len], b"12.0");
    }

    #[test]
    fn the_start_time_is_read_past_a_name_with_spaces_and_parentheses() {
        let line = b"4242 (we ird) (x) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 \
                     98765 1000000 200 18446744073709551615\n";
        assert_eq!(start_time(line), Some(98765));
        assert_eq!(start_time(b"4242 (short) S 1"), None);
        assert_eq!(start_time(b"no name"), None);
    }
}
