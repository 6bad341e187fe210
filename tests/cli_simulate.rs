//! `hyperoffload simulate --trace` on traces it must refuse: a block number no region of
//! the file could have is an error naming its line and the problem, given at once and
//! within a small address space (a replay sized by the block number would need
//! gigabytes).

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::{Duration, Instant};

use hyperoffload::trace::HEADER;

/// Address space the refusing runs get: the program with its threads, not a replay of
/// billions of blocks.
const ADDRESS_SPACE: u64 = 1 << 30;

/// `simulate --trace` on a trace of `text`, in an address space of `ADDRESS_SPACE`:
/// its success, stderr and how long it took.
fn simulate(name: &str, text: &str) -> (bool, String, Duration) {
    let path = std::env::temp_dir().join(format!("simulate-{name}-{}.csv", std::process::id()));
    std::fs::File::create(&path)
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_hyperoffload"));
    command
        .args(["simulate", "--budget", "50%", "--policy", "lru", "--trace"])
        .arg(&path);
    // SAFETY: setrlimit(2) is async-signal-safe and touches no state of the parent.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: ADDRESS_SPACE,
                rlim_max: ADDRESS_SPACE,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    };
    let started = Instant::now();
    let output = command.output().unwrap();
    let took = started.elapsed();
    std::fs::remove_file(&path).unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    (output.status.success(), stderr, took)
}

#[test]
fn a_one_line_trace_with_a_huge_block_number_is_refused_at_once() {
    // No size in the header, the block at offset 0: refused by its offset.
    let (ok, stderr, took) = simulate(
        "no-size",
        &format!("{HEADER}\n1,2,0,0,4000000000,65536,missing,9,0\n"),
    );
    assert!(!ok, "accepted: {stderr}");
    assert!(
        stderr.contains("trace line 2: block 4000000000 cannot start at file offset 0"),
        "{stderr}"
    );
    assert!(took < Duration::from_secs(5), "took {took:?}");
    // A block where its offset says, past the file the header names.
    let (ok, stderr, took) = simulate(
        "past-file",
        &format!(
            "# size=1048576 block_size=65536\n{HEADER}\n\
             1,2,0,281474976645120,4294967295,65536,missing,9,0\n"
        ),
    );
    assert!(!ok, "accepted: {stderr}");
    assert!(
        stderr.contains("trace line 3: block 4294967295 starts at file offset 281474976645120, past the end of the file"),
        "{stderr}"
    );
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

/// The same limits let a sound one-line trace through: the refusals above are the
/// checks', not the address space's.
#[test]
fn a_sound_one_line_trace_replays_in_the_same_address_space() {
    let (ok, stderr, _) = simulate(
        "sound",
        &format!("# size=1048576 block_size=65536\n{HEADER}\n1,2,0,983040,15,65536,missing,9,0\n"),
    );
    assert!(ok, "{stderr}");
}
