//! The pressure notifications against the kernel: a process in a small memory cgroup
//! sets them up (`PressureEvents::open`), fills the cgroup with page cache until the
//! kernel reclaims, and hears of it; its readings see the cgroup's room.

mod common;

#[allow(dead_code)]
#[path = "../src/cli/compare/cgroup.rs"]
mod cgroup;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::*;
use hyperoffload::budget::follow::Pressure;
use hyperoffload::budget::memory_pressure::CgroupFiles;
use hyperoffload::budget::pressure_events::PressureEvents;

const MIB: u64 = 1 << 20;
const LIMIT: u64 = 64 * MIB;
const ENV_CGROUP: &str = "HYPEROFFLOAD_TEST_CGROUP";
const ENV_FILE: &str = "HYPEROFFLOAD_TEST_FILE";

#[test]
fn reclaim_in_the_cgroup_is_heard_of() {
    if !is_child() {
        let name = format!("hyperoffload-test-events-{}", std::process::id());
        let cgroup = match cgroup::MemoryCgroup::create(&name, Some(LIMIT)) {
            Ok(cgroup) => cgroup,
            Err(error) if std::env::var("HYPEROFFLOAD_ALLOW_SKIP").as_deref() == Ok("1") => {
                eprintln!("skipped: {error}");
                return;
            }
            Err(error) => panic!("{error} (HYPEROFFLOAD_ALLOW_SKIP=1 skips this test)"),
        };
        let dir = TempDir::new("pressure-events");
        let file = dir.path("cache");
        pattern_file(&file, 4 * LIMIT);
        let env = [
            (ENV_CGROUP, cgroup.dir().display().to_string()),
            (ENV_FILE, file.display().to_string()),
        ];
        let status = run_child(
            "reclaim_in_the_cgroup_is_heard_of",
            &env,
            Duration::from_secs(120),
        );
        assert!(status.success(), "the child failed: {status}");
        drop(cgroup);
        return;
    }
    let dir = std::env::var(ENV_CGROUP).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(format!("{dir}/cgroup.procs"))
        .unwrap()
        .write_all(b"0")
        .unwrap();
    let files = CgroupFiles::find();
    let own = files.v1_dir().or(files.v2_dir()).unwrap();
    assert_eq!(own, std::path::Path::new(&dir), "{files:?}");
    let spare = files.spare().unwrap();
    assert!(spare <= LIMIT, "spare {spare} in a cgroup of {LIMIT}");
    let mut events = PressureEvents::open(&files);
    let sources = events.sources();
    assert!(!sources.is_empty(), "no pressure source in {dir}");
    if files.v1_dir().is_some() {
        assert!(
            sources.contains(&"cgroup v1 pressure_level low"),
            "{sources:?}"
        );
    }
    // Where the kernel keeps PSI (its file reads), a trigger is set, with a 2 s window
    // where the kernel refuses a 1 s one (no CAP_SYS_RESOURCE, as in a container).
    if std::fs::read_to_string(files.psi_path()).is_ok() {
        assert!(
            events.has_psi(),
            "PSI at {} but no trigger: {sources:?}",
            files.psi_path().display()
        );
    }
    // Page cache charged to the cgroup, four times its limit, read until the kernel
    // says it reclaims.
    let path = std::env::var(ENV_FILE).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut heard = Pressure::None;
    let mut buffer = vec![0u8; MIB as usize];
    while heard == Pressure::None {
        assert!(
            Instant::now() < deadline,
            "no pressure heard of from {sources:?}"
        );
        let mut file = std::fs::File::open(&path).unwrap();
        while file.read(&mut buffer).unwrap() > 0 {
            heard = heard.max(events.wait(Duration::ZERO));
        }
        // Dropped from the cache, to be read (and charged) again.
        let fd = std::os::fd::AsFd::as_fd(&file);
        hyperoffload::sys::files::fadvise(fd, 0, 0, libc::POSIX_FADV_DONTNEED).unwrap();
        heard = heard.max(events.wait(Duration::from_millis(10)));
    }
}
