//! Whether the shim takes over an `mmap` request or leaves it to the kernel: a pure
//! decision over the request's arguments and a few facts about the file, so every case
//! is unit-tested without a kernel.
//!
//! Taken over: read-only (`PROT_READ`, optionally `PROT_EXEC`) `MAP_SHARED` or
//! `MAP_PRIVATE` mappings of regular files whose name matches the configured patterns,
//! at least the minimum size, at a page-aligned offset inside the file, at an address
//! the kernel chooses. `MAP_POPULATE`, `MAP_NORESERVE` and `MAP_NONBLOCK` are allowed
//! (the shim turns `MAP_POPULATE` into a bounded prefetch). Everything else passes
//! through, in particular `MAP_FIXED`/`MAP_FIXED_NOREPLACE` requests: placing a region
//! at a caller-chosen address would replace whatever is there with memory the pager
//! serves, and no known client asks for it.

use hyperoffload::shim_config::ShimConfig;

/// The arguments of an `mmap` call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapRequest {
    pub addr: usize,
    pub len: usize,
    pub prot: i32,
    pub flags: i32,
    pub fd: i32,
    pub offset: i64,
}

/// What the shim found out about the descriptor's file (`fstat`, `/proc/self/fd`).
#[derive(Debug, Clone, Copy)]
pub struct FileFacts<'a> {
    pub is_regular: bool,
    pub size: u64,
    /// Bytes of the model the file holds: `size`, or all the parts of the split GGUF
    /// it belongs to (`model::split::model_len`). A part below the minimum size of a
    /// model above it (the last part often is) is served with the rest.
    pub model_len: u64,
    /// The file's path as the kernel reports it, or the program's name for it where
    /// that does not match the patterns and an argument of the program's leads to it
    /// through symlinks.
    pub path: &'a [u8],
    /// Whether the file starts as a model does (`model::has_model_header`): served
    /// whatever its name (Ollama keeps models as blobs named `sha256-<hash>`).
    pub model_header: bool,
}

/// Why a request is left to the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PassReason {
    Anonymous,
    ZeroLength,
    /// Writable, or not readable: a write to an evictable page would be lost.
    Protection,
    FixedAddress,
    /// Flags the shim does not emulate (MAP_LOCKED, MAP_HUGETLB, MAP_32BIT, ...).
    UnsupportedFlags(i32),
    /// Neither MAP_SHARED nor MAP_PRIVATE (nor MAP_SHARED_VALIDATE).
    NoSharingType,
    UnalignedOffset,
    /// fstat failed: not a file descriptor the shim can inspect.
    UnknownFile,
    NotRegularFile,
    NameNotMatched,
    TooSmall,
    /// The offset is at or past the end of the file: no data to serve.
    OffsetPastEnd,
}

impl PassReason {
    pub fn describe(self) -> &'static str {
        match self {
            PassReason::Anonymous => "anonymous mapping",
            PassReason::ZeroLength => "zero length",
            PassReason::Protection => "writable or unreadable protection",
            PassReason::FixedAddress => "MAP_FIXED or MAP_FIXED_NOREPLACE",
            PassReason::UnsupportedFlags(_) => "flags the shim does not emulate",
            PassReason::NoSharingType => "neither MAP_SHARED nor MAP_PRIVATE",
            PassReason::UnalignedOffset => "offset not page aligned",
            PassReason::UnknownFile => "the descriptor cannot be inspected",
            PassReason::NotRegularFile => "not a regular file",
            PassReason::NameNotMatched => "file name matches no pattern",
            PassReason::TooSmall => "model smaller than the minimum size",
            PassReason::OffsetPastEnd => "offset at or past the end of the file",
        }
    }
}

/// Flags a managed mapping may carry.
const ALLOWED_FLAGS: i32 = libc::MAP_SHARED
    | libc::MAP_PRIVATE
    | libc::MAP_SHARED_VALIDATE
    | libc::MAP_POPULATE
    | libc::MAP_NORESERVE
    | libc::MAP_NONBLOCK
    | libc::MAP_DENYWRITE
    | libc::MAP_EXECUTABLE;

/// The checks that need only the arguments: cheap, no system calls, so the shim runs
/// them first on every `mmap`.
pub fn screen_request(request: &MapRequest, page_size: u64) -> Result<(), PassReason> {
    if request.flags & libc::MAP_ANONYMOUS != 0 || request.fd < 0 {
        return Err(PassReason::Anonymous);
    }
    if request.len == 0 {
        return Err(PassReason::ZeroLength);
    }
    let prot = request.prot;
    if prot & libc::PROT_READ == 0 || prot & !(libc::PROT_READ | libc::PROT_EXEC) != 0 {
        return Err(PassReason::Protection);
    }
    if request.flags & (libc::MAP_FIXED | libc::MAP_FIXED_NOREPLACE) != 0 {
        return Err(PassReason::FixedAddress);
    }
    let unsupported = request.flags & !ALLOWED_FLAGS;
    if unsupported != 0 {
        return Err(PassReason::UnsupportedFlags(unsupported));
    }
    if request.flags & (libc::MAP_SHARED | libc::MAP_PRIVATE) == 0 {
        return Err(PassReason::NoSharingType);
    }
    if request.offset < 0 || request.offset as u64 % page_size != 0 {
        return Err(PassReason::UnalignedOffset);
    }
    Ok(())
}

/// The checks on the file, after `screen_request` passed.
pub fn screen_file(
    request: &MapRequest,
    file: &FileFacts<'_>,
    config: &ShimConfig,
) -> Result<(), PassReason> {
    if !file.is_regular {
        return Err(PassReason::NotRegularFile);
    }
    if !config.matches(file.path) && !file.model_header {
        return Err(PassReason::NameNotMatched);
    }
    if file.model_len < config.min_size {
        return Err(PassReason::TooSmall);
    }
    if request.offset as u64 >= file.size {
        return Err(PassReason::OffsetPastEnd);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: u64 = 4096;

    fn model_request() -> MapRequest {
        MapRequest {
            addr: 0,
            len: 100 << 20,
            prot: libc::PROT_READ,
            flags: libc::MAP_SHARED | libc::MAP_POPULATE,
            fd: 3,
            offset: 0,
        }
    }

    fn model_file() -> FileFacts<'static> {
        FileFacts {
            is_regular: true,
            size: 100 << 20,
            model_len: 100 << 20,
            path: b"/models/m.gguf",
            model_header: false,
        }
    }

    fn decide(request: MapRequest, file: FileFacts<'_>) -> Result<(), PassReason> {
        let config = ShimConfig::defaults();
        screen_request(&request, PAGE)?;
        screen_file(&request, &file, &config)
    }

    #[test]
    fn takes_over_read_only_model_mappings() {
        assert_eq!(decide(model_request(), model_file()), Ok(()));
        let private_exec = MapRequest {
            prot: libc::PROT_READ | libc::PROT_EXEC,
            flags: libc::MAP_PRIVATE,
            offset: 8192,
            ..model_request()
        };
        assert_eq!(decide(private_exec, model_file()), Ok(()));
    }

    #[test]
    fn leaves_everything_else_to_the_kernel() {
        let cases = [
            (
                MapRequest {
                    flags: libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    fd: -1,
                    ..model_request()
                },
                PassReason::Anonymous,
            ),
            (
                MapRequest {
                    prot: libc::PROT_READ | libc::PROT_WRITE,
                    ..model_request()
                },
                PassReason::Protection,
            ),
            (
                MapRequest {
                    prot: libc::PROT_READ | libc::PROT_WRITE,
                    flags: libc::MAP_PRIVATE,
                    ..model_request()
                },
                PassReason::Protection,
            ),
            (
                MapRequest {
                    prot: libc::PROT_NONE,
                    ..model_request()
                },
                PassReason::Protection,
            ),
            (
                MapRequest {
                    flags: libc::MAP_SHARED | libc::MAP_FIXED,
                    addr: 1 << 30,
                    ..model_request()
                },
                PassReason::FixedAddress,
            ),
            (
                MapRequest {
                    flags: libc::MAP_SHARED | libc::MAP_LOCKED,
                    ..model_request()
                },
                PassReason::UnsupportedFlags(libc::MAP_LOCKED),
            ),
            (
                MapRequest {
                    offset: 100,
                    ..model_request()
                },
                PassReason::UnalignedOffset,
            ),
            (
                MapRequest {
                    len: 0,
                    ..model_request()
                },
                PassReason::ZeroLength,
            ),
        ];
        for (request, reason) in cases {
            assert_eq!(decide(request, model_file()), Err(reason), "{request:?}");
        }
    }

    #[test]
    fn looks_at_the_file_only_after_the_request() {
        let not_regular = FileFacts {
            is_regular: false,
            ..model_file()
        };
        assert_eq!(
            decide(model_request(), not_regular),
            Err(PassReason::NotRegularFile)
        );
        let other_name = FileFacts {
            path: b"/models/m.bin",
            ..model_file()
        };
        assert_eq!(
            decide(model_request(), other_name),
            Err(PassReason::NameNotMatched)
        );
        // A blob that starts as a model does is one, whatever its name.
        let blob = FileFacts {
            path: b"/ollama/blobs/sha256-3f2a",
            model_header: true,
            ..model_file()
        };
        assert_eq!(decide(model_request(), blob), Ok(()));
        let small = FileFacts {
            size: 1 << 20,
            model_len: 1 << 20,
            ..model_file()
        };
        assert_eq!(decide(model_request(), small), Err(PassReason::TooSmall));
        let small_part_of_a_large_model = FileFacts {
            size: 1 << 20,
            ..model_file()
        };
        let request = MapRequest {
            len: 1 << 20,
            ..model_request()
        };
        assert_eq!(decide(request, small_part_of_a_large_model), Ok(()));
        let past_end = MapRequest {
            offset: 100 << 20,
            ..model_request()
        };
        assert_eq!(
            decide(past_end, model_file()),
            Err(PassReason::OffsetPastEnd)
        );
    }
}
