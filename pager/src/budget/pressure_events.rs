//! The kernel's memory pressure notifications, waited for together (the thin layer
//! under `budget::follow`):
//! - a PSI trigger (Linux 5.2+): `some STALL WINDOW` written to the v2 cgroup's
//!   `memory.pressure` or the machine's /proc/pressure/memory, then the descriptor
//!   polls with POLLPRI when tasks stalled on memory for `PSI_STALL_US` within a
//!   `PSI_WINDOW_US` (the machine's stalls only hold growth back:
//!   `memory_pressure::psi_pressure`);
//! - cgroup v1 `memory.pressure_level` events: an eventfd registered through
//!   `cgroup.event_control` for the `low` and the `medium` level each.
//!
//! Each source that cannot be set up (no PSI in this kernel, no v1 memory cgroup, not
//! permitted) is left out; `sources` says which are watched. With none, the follower
//! still reads what is spare every time `wait` returns.

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Duration;

use crate::budget::follow::Pressure;
use crate::budget::memory_pressure::{psi_pressure, CgroupFiles};
use crate::sys;
use crate::sys::files::{PollFd, PollFlags};

/// A PSI trigger fires after this much stall...
pub const PSI_STALL_US: u64 = 100_000;
/// ... within this window.
pub const PSI_WINDOW_US: u64 = 1_000_000;
/// Without CAP_SYS_RESOURCE (an unprivileged process, or root in a container or
/// sandbox without it) the kernel takes only windows in whole multiples of 2 s and
/// refuses a 1 s one with EINVAL: then the trigger is the same rate over 2 s.
const PSI_UNPRIVILEGED_WINDOW_US: u64 = 2_000_000;

struct Source {
    fd: OwnedFd,
    /// What an event on it means.
    pressure: Pressure,
    /// An eventfd, whose counter is read after an event (PSI triggers are not read).
    counter: bool,
    /// Kept open while registered (the v1 `memory.pressure_level` file).
    _level: Option<OwnedFd>,
    name: &'static str,
}

/// The notifications this process can have.
pub struct PressureEvents {
    sources: Vec<Source>,
}

fn c_path(path: &Path) -> std::io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(std::io::Error::other)
}

/// A PSI trigger on `path`, at `PSI_STALL_US` per `PSI_WINDOW_US`, or at the same rate
/// over the unprivileged window where the kernel refuses the shorter one.
fn psi_trigger(path: &Path) -> std::io::Result<OwnedFd> {
    let path = c_path(path)?;
    let mut refused = None;
    for window in [PSI_WINDOW_US, PSI_UNPRIVILEGED_WINDOW_US] {
        // A descriptor takes one trigger: a refused write leaves it unusable for another.
        let fd = sys::files::open_read_write_nonblock(&path)?;
        let stall = PSI_STALL_US * window / PSI_WINDOW_US;
        let trigger = format!("some {stall} {window}\0");
        match sys::files::write(fd.as_fd(), trigger.as_bytes()) {
            Ok(_) => return Ok(fd),
            Err(error) => refused = Some(error),
        }
    }
    Err(refused.expect("at least one window was tried"))
}

fn v1_level(dir: &Path, level: &str) -> std::io::Result<(OwnedFd, OwnedFd)> {
    let events = sys::files::eventfd()?;
    let level_file = sys::files::open_read(&c_path(&dir.join("memory.pressure_level"))?)?;
    let control = sys::files::open_write(&c_path(&dir.join("cgroup.event_control"))?)?;
    let line = format!("{} {} {level}", events.as_raw_fd(), level_file.as_raw_fd());
    sys::files::write(control.as_fd(), line.as_bytes())?;
    Ok((events, level_file))
}

impl PressureEvents {
    /// Sets up every source this process can have.
    pub fn open(files: &CgroupFiles) -> Self {
        let mut sources = Vec::new();
        let psi = files.psi_path();
        if let Ok(fd) = psi_trigger(&psi) {
            let name = if psi.starts_with("/proc") {
                "PSI (machine)"
            } else {
                "PSI (cgroup)"
            };
            sources.push(Source {
                fd,
                pressure: psi_pressure(&psi),
                counter: false,
                _level: None,
                name,
            });
        }
        if let Some(dir) = files.v1_dir() {
            for (level, pressure, name) in [
                ("low", Pressure::Low, "cgroup v1 pressure_level low"),
                ("medium", Pressure::High, "cgroup v1 pressure_level medium"),
            ] {
                if let Ok((fd, level)) = v1_level(dir, level) {
                    sources.push(Source {
                        fd,
                        pressure,
                        counter: true,
                        _level: Some(level),
                        name,
                    });
                }
            }
        }
        Self { sources }
    }

    /// What is watched.
    pub fn sources(&self) -> Vec<&'static str> {
        self.sources.iter().map(|source| source.name).collect()
    }

    /// Whether a PSI trigger is among them.
    pub fn has_psi(&self) -> bool {
        self.sources.iter().any(|source| !source.counter)
    }

    /// Waits up to `timeout` for an event and returns the most pressure any source
    /// reported (`None` at the timeout). A source that reports an error (its cgroup
    /// went away) is dropped.
    pub fn wait(&mut self, timeout: Duration) -> Pressure {
        if self.sources.is_empty() {
            std::thread::sleep(timeout);
            return Pressure::None;
        }
        let mut fds: Vec<PollFd<'_>> = (self.sources.iter())
            .map(|source| {
                let flags = if source.counter {
                    PollFlags::IN
                } else {
                    PollFlags::PRI
                };
                PollFd::new(&source.fd, flags)
            })
            .collect();
        if sys::files::poll(&mut fds, timeout).unwrap_or(0) == 0 {
            return Pressure::None;
        }
        let revents: Vec<PollFlags> = fds.iter().map(PollFd::revents).collect();
        drop(fds);
        let mut pressure = Pressure::None;
        let mut broken = Vec::new();
        for (index, (source, events)) in self.sources.iter().zip(&revents).enumerate() {
            if events.intersects(PollFlags::ERR | PollFlags::NVAL | PollFlags::HUP) {
                broken.push(index);
                continue;
            }
            if events.intersects(PollFlags::IN | PollFlags::PRI) {
                if source.counter {
                    let mut counter = [0u8; 8];
                    let _ = sys::files::read(source.fd.as_fd(), &mut counter);
                }
                pressure = pressure.max(source.pressure);
            }
        }
        for index in broken.into_iter().rev() {
            self.sources.remove(index);
        }
        pressure
    }
}
