//! A private tracefs instance (`/sys/kernel/tracing/instances/NAME`): its own event
//! selection, filters, pid filter and ring buffer, so tracing here does not disturb
//! anyone else's. Removed on drop. See Documentation/trace/events.rst in the kernel.

use std::fs::{File, OpenOptions};
use std::io::{self, ErrorKind, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use thiserror::Error;

pub const TRACEFS: &str = "/sys/kernel/tracing";

#[derive(Debug, Error)]
pub enum TracefsError {
    #[error("mounting tracefs at {TRACEFS}: {0} (root is required)")]
    Mount(#[source] io::Error),
    #[error("{path}: {source}")]
    File {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("event {0} does not exist on this kernel")]
    NoSuchEvent(String),
}

fn file_error(path: &Path) -> impl FnOnce(io::Error) -> TracefsError + '_ {
    move |source| TracefsError::File {
        path: path.to_path_buf(),
        source,
    }
}

/// Whether tracefs is mounted at its usual place.
fn mounted() -> Result<bool, TracefsError> {
    let mounts = std::fs::read_to_string("/proc/mounts").map_err(TracefsError::Mount)?;
    Ok(mounts.lines().any(|line| {
        let mut fields = line.split_whitespace().skip(1);
        fields.next() == Some(TRACEFS) && fields.next() == Some("tracefs")
    }))
}

/// Mounts tracefs at its usual place unless it is already mounted there.
pub fn ensure_mounted() -> Result<(), TracefsError> {
    if mounted()? {
        return Ok(());
    }
    let target = std::ffi::CString::new(TRACEFS).expect("no NUL in a constant path");
    // SAFETY: all pointers are NUL-terminated strings that outlive the call; no data
    // argument is passed.
    let rc = unsafe {
        libc::mount(
            c"nodev".as_ptr(),
            target.as_ptr(),
            c"tracefs".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        let error = io::Error::last_os_error();
        // Another process (a second compare, a test beside this one) may have mounted it
        // between the check and the mount: the kernel then answers EBUSY.
        if mounted()? {
            return Ok(());
        }
        return Err(TracefsError::Mount(error));
    }
    Ok(())
}

/// A tracefs instance this process created.
#[derive(Debug)]
pub struct TraceInstance {
    dir: PathBuf,
}

impl TraceInstance {
    /// Creates `instances/NAME` (tracefs mounted first if needed). A leftover instance
    /// of the same name, from a run that was killed, is removed first.
    pub fn create(name: &str) -> Result<Self, TracefsError> {
        ensure_mounted()?;
        let dir = Path::new(TRACEFS).join("instances").join(name);
        if dir.exists() {
            let _ = std::fs::remove_dir(&dir);
        }
        std::fs::create_dir(&dir).map_err(file_error(&dir))?;
        let instance = Self { dir };
        instance.write("tracing_on", "0")?;
        // The monotonic clock, so events line up with CLOCK_MONOTONIC in this process.
        instance.write("trace_clock", "mono")?;
        Ok(instance)
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    /// Writes a control file (truncating).
    pub fn write(&self, file: &str, value: &str) -> Result<(), TracefsError> {
        let path = self.path(file);
        std::fs::write(&path, value).map_err(file_error(&path))
    }

    /// Opens a control file for writing later (from a child before exec, say).
    pub fn open_for_write(&self, file: &str) -> Result<File, TracefsError> {
        let path = self.path(file);
        OpenOptions::new()
            .write(true)
            .open(&path)
            .map_err(file_error(&path))
    }

    /// Enables `group/event`, with an optional filter expression.
    pub fn enable_event(&self, event: &str, filter: Option<&str>) -> Result<(), TracefsError> {
        let dir = format!("events/{event}");
        if !self.path(&dir).exists() {
            return Err(TracefsError::NoSuchEvent(event.to_string()));
        }
        if let Some(filter) = filter {
            self.write(&format!("{dir}/filter"), filter)?;
        }
        self.write(&format!("{dir}/enable"), "1")
    }

    /// Per-CPU ring buffer size.
    pub fn set_buffer_kb(&self, kb: u64) -> Result<(), TracefsError> {
        self.write("buffer_size_kb", &kb.to_string())
    }

    /// Streams `trace_pipe` into `out` on a thread until [`Capture::finish`].
    pub fn capture(&self, out: &Path) -> Result<Capture, TracefsError> {
        let pipe_path = self.path("trace_pipe");
        // Non-blocking: an empty pipe returns EAGAIN instead of waiting, so the thread
        // can notice it is asked to stop.
        let pipe = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&pipe_path)
            .map_err(file_error(&pipe_path))?;
        let file = File::create(out).map_err(file_error(out))?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("trace-capture".into())
                .spawn(move || pump(pipe, file, &stop))
                .map_err(file_error(&pipe_path))?
        };
        Ok(Capture {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for TraceInstance {
    fn drop(&mut self) {
        let _ = self.write("tracing_on", "0");
        // Disabling every event first: an instance with enabled events can refuse rmdir.
        let _ = self.write("events/enable", "0");
        if let Err(error) = std::fs::remove_dir(&self.dir) {
            eprintln!(
                "warning: could not remove trace instance {}: {error}",
                self.dir.display()
            );
        }
    }
}

fn pump(mut pipe: File, out: File, stop: &AtomicBool) -> io::Result<u64> {
    let mut out = io::BufWriter::with_capacity(1 << 20, out);
    let mut buffer = vec![0u8; 1 << 16];
    let mut total = 0u64;
    loop {
        match pipe.read(&mut buffer) {
            Ok(0) => {}
            Ok(n) => {
                out.write_all(&buffer[..n])?;
                total += n as u64;
                continue;
            }
            Err(error) if error.kind() == ErrorKind::WouldBlock => {}
            Err(error) if error.kind() == ErrorKind::Interrupted => continue,
            Err(error) => return Err(error),
        }
        // Empty: stop if asked (everything before the request has been drained).
        if stop.load(Ordering::Acquire) {
            out.flush()?;
            return Ok(total);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A thread copying an instance's trace pipe to a file.
pub struct Capture {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<io::Result<u64>>>,
}

impl Capture {
    /// Drains what is buffered, stops, and returns the bytes written. Stop tracing
    /// first, or the pipe may never be empty.
    pub fn finish(mut self) -> io::Result<u64> {
        self.stop.store(true, Ordering::Release);
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(result)) => result,
            Some(Err(_)) => Err(io::Error::other("trace capture thread panicked")),
            None => Ok(0),
        }
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
