//! Issue 7, environment limits: io_uring refused (as with sysctl
//! kernel.io_uring_disabled=2) gives an error naming the sysctl; files on filesystems
//! without O_DIRECT are served through the page cache and say so in the stats.
//!
//! io_uring is refused with a seccomp filter on one thread (io_uring_setup -> EPERM,
//! what the kernel returns when the sysctl disables it) rather than by flipping the
//! sysctl: that is system-wide, and other test runs on the same machine would fail
//! while it is set. The ramfs test mounts in a private mount namespace (`unshare`), so
//! nothing outlives the child.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use hyperoffload::ring::RingError;
use hyperoffload::{MapOptions, Pager, PagerError, Region};

fn check_every_byte(region: &Region) {
    for (offset, &byte) in region.as_slice().iter().enumerate() {
        assert_eq!(
            byte,
            pattern_byte(offset as u64),
            "wrong byte at {offset:#x}"
        );
    }
}

fn allow_skip(why: &str) -> bool {
    if std::env::var("HYPEROFFLOAD_ALLOW_SKIP").as_deref() == Ok("1") {
        eprintln!("skipped: {why}");
        true
    } else {
        false
    }
}

/// Makes io_uring_setup fail with EPERM for the calling thread (and threads it starts).
fn deny_io_uring_setup() -> std::io::Result<()> {
    #[cfg(target_arch = "x86_64")]
    const AUDIT_ARCH: u32 = 0xC000_003E;
    #[cfg(target_arch = "aarch64")]
    const AUDIT_ARCH: u32 = 0xC000_00B7;
    let stmt = |code: u32, k: u32| libc::sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    };
    let jump = |code: u32, k: u32, jt: u8, jf: u8| libc::sock_filter {
        code: code as u16,
        jt,
        jf,
        k,
    };
    let ret = libc::BPF_RET | libc::BPF_K;
    let load = libc::BPF_LD | libc::BPF_W | libc::BPF_ABS;
    let jeq = libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K;
    let mut filter = [
        // seccomp_data.arch
        stmt(load, 4),
        jump(jeq, AUDIT_ARCH, 1, 0),
        stmt(ret, libc::SECCOMP_RET_ALLOW),
        // seccomp_data.nr
        stmt(load, 0),
        jump(jeq, libc::SYS_io_uring_setup as u32, 0, 1),
        stmt(ret, libc::SECCOMP_RET_ERRNO | libc::EPERM as u32),
        stmt(ret, libc::SECCOMP_RET_ALLOW),
    ];
    let program = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_mut_ptr(),
    };
    // SAFETY: prctl with integer arguments changes only this thread's flags.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `program` points at a live, well-formed filter for the duration of the call
    // (the kernel copies it); the filter applies to this thread only (no TSYNC).
    if unsafe {
        libc::prctl(
            libc::PR_SET_SECCOMP,
            libc::SECCOMP_MODE_FILTER,
            &program as *const libc::sock_fprog,
        )
    } != 0
    {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[test]
fn io_uring_refused_is_reported_naming_the_sysctl() {
    // A thread of its own: the filter dies with it and touches no other test.
    let result = std::thread::spawn(|| {
        deny_io_uring_setup().expect("installing the seccomp filter");
        Pager::builder().budget(4 << 20).build().map(|_| ())
    })
    .join()
    .unwrap();
    let error = result.expect_err("a pager was built without io_uring");
    let message = error.to_string();
    eprintln!("{message}");
    assert!(
        matches!(
            error,
            PagerError::Ring(RingError::NotPermitted { ref source })
                if source.raw_os_error() == Some(libc::EPERM)
        ),
        "{error:?}"
    );
    assert!(message.contains("kernel.io_uring_disabled"), "{message}");
    // Other threads are unaffected.
    if let Some(pager) = pager_or_skip(Pager::builder().budget(4 << 20)) {
        drop(pager);
    }
}

#[test]
fn a_file_on_tmpfs_is_served_exactly() {
    let shm = std::path::Path::new("/dev/shm");
    if !shm.is_dir() {
        assert!(allow_skip("no /dev/shm"), "no /dev/shm to test tmpfs with");
        return;
    }
    let path = shm.join(format!("hyperoffload-tmpfs-{}", std::process::id()));
    struct Remove(std::path::PathBuf);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let _remove = Remove(path.clone());
    pattern_file(&path, (8 << 20) + 555);
    let Some(pager) = pager_or_skip(Pager::builder().budget(2 << 20)) else {
        return;
    };
    let region = pager.map_file(&path, MapOptions::default()).unwrap();
    check_every_byte(&region);
    check_every_byte(&region);
    let stats = pager.stats();
    assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
    eprintln!(
        "tmpfs: direct_io {} ({:?})",
        stats.direct_io, stats.direct_io_fallback
    );
    // tmpfs accepts O_DIRECT since Linux 6.6; either way the stats must agree.
    assert_eq!(
        stats.direct_io,
        stats.direct_io_fallback.is_none(),
        "{stats:?}"
    );
    assert_eq!(stats.read_errors, 0);
    assert!(stats.peak_resident_bytes <= 2 << 20);
}

#[test]
fn a_filesystem_refusing_o_direct_is_read_through_the_page_cache() {
    if is_child() {
        // In a private mount namespace, on a fresh ramfs (which refuses O_DIRECT).
        let dir = std::path::PathBuf::from(std::env::var("TEST_DIR").unwrap());
        let path = dir.join("f.bin");
        pattern_file(&path, (8 << 20) + 555);
        let pager = pager_or_skip(Pager::builder().budget(2 << 20)).unwrap();
        let region = pager.map_file(&path, MapOptions::default()).unwrap();
        check_every_byte(&region);
        check_every_byte(&region);
        let stats = pager.stats();
        assert_eq!(stats.invariant_breaches, 0, "{stats:?}");
        eprintln!(
            "ramfs: direct_io {} ({:?})",
            stats.direct_io, stats.direct_io_fallback
        );
        assert!(!stats.direct_io, "{stats:?}");
        let why = stats.direct_io_fallback.unwrap_or_default();
        assert!(
            why.contains("O_DIRECT refused") && why.contains("page cache"),
            "{why}"
        );
        assert_eq!(stats.read_errors, 0);
        return;
    }
    let dir = TempDir::new("ramfs");
    let mount_point = dir.path("mnt");
    std::fs::create_dir(&mount_point).unwrap();
    let exe = std::env::current_exe().unwrap();
    let test = "a_filesystem_refusing_o_direct_is_read_through_the_page_cache";
    assert_one_test_named(test);
    let spawned = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(r#"mount -t ramfs none "$TEST_DIR" && exec "$0" "$1" --exact --nocapture --test-threads=1"#)
        .arg(&exe)
        .arg(test)
        .env("HYPEROFFLOAD_CHILD", "1")
        .env("TEST_DIR", &mount_point)
        .spawn();
    let mut child = match spawned {
        Ok(child) => child,
        Err(error) => {
            assert!(
                allow_skip(&format!("cannot run unshare(1): {error}")),
                "cannot run unshare(1) for a private ramfs mount: {error}"
            );
            return;
        }
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("child test {test} hung");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "child ended with {status}");
    // The mount was private to the child: nothing is left mounted here.
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    assert!(
        !mounts.contains(mount_point.to_str().unwrap()),
        "ramfs mount leaked"
    );
}

#[test]
fn without_userfaultfd_permission_the_error_says_how_to_enable_it() {
    if is_child() {
        // SAFETY: drops this (single-purpose, child) process to nobody:nogroup; no memory
        // effects.
        unsafe {
            assert_eq!(libc::setgroups(0, std::ptr::null()), 0);
            assert_eq!(libc::setgid(65534), 0);
            assert_eq!(libc::setuid(65534), 0);
        }
        let error = Pager::builder()
            .budget(1 << 20)
            .build()
            .err()
            .expect("an unprivileged user created a kernel-mode userfaultfd");
        assert!(matches!(error, PagerError::UffdNotPermitted(_)), "{error}");
        let message = error.to_string();
        assert!(message.contains("/dev/userfaultfd"), "{message}");
        assert!(message.contains("vm.unprivileged_userfaultfd"), "{message}");
        return;
    }
    // The premise: unprivileged users may not create one here (root-only device node,
    // sysctl off). Elsewhere the test would be meaningless, not failing.
    let sysctl =
        std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd").unwrap_or_default();
    let device_open = std::fs::metadata("/dev/userfaultfd")
        .map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o006 != 0)
        .unwrap_or(false);
    if sysctl.trim() != "0" || device_open {
        assert!(
            allow_skip("unprivileged userfaultfd is allowed on this machine"),
            "unprivileged userfaultfd is allowed here (vm.unprivileged_userfaultfd={}, /dev/userfaultfd open to others: {device_open}): this test needs it denied",
            sysctl.trim()
        );
        return;
    }
    let status = run_child(
        "without_userfaultfd_permission_the_error_says_how_to_enable_it",
        &[],
        Duration::from_secs(60),
    );
    assert!(status.success(), "child ended with {status}");
}

#[test]
fn a_zero_memlock_limit_does_not_stop_the_pager() {
    if is_child() {
        let path = std::env::var("TEST_FILE").unwrap();
        let limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: sets this child's own resource limit from a live struct.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &limit) }, 0);
        // io_uring charges its rings to the memory cgroup since Linux 5.12, not to
        // RLIMIT_MEMLOCK, and the pager registers no buffers: nothing here is locked.
        let pager = pager_or_skip(Pager::builder().budget(2 << 20)).unwrap();
        let region = pager
            .map_file(path.as_ref(), MapOptions::default())
            .unwrap();
        check_every_byte(&region);
        return;
    }
    let dir = TempDir::new("memlock");
    let path = dir.path("f.bin");
    pattern_file(&path, 8 << 20);
    let status = run_child(
        "a_zero_memlock_limit_does_not_stop_the_pager",
        &[("TEST_FILE", path.display().to_string())],
        Duration::from_secs(60),
    );
    assert!(status.success(), "child ended with {status}");
}
