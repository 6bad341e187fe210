//! A server process for a test (llama-server, plainly or under `hyperoffload run`): on
//! loopback, its output in a log file, waited for with bounds, and never left running:
//! it runs in a process group of its own, which is killed whole if the test ends
//! (passes or panics) with the server still up. The launcher's program is in that group
//! too, so killing the group cannot orphan it.

use std::net::{SocketAddr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::http;

/// A loopback address with a port free when asked (the kernel's pick; another process
/// could take it before the server binds it, and the server's failure then says so).
pub fn free_loopback_addr() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("binding a loopback port");
    listener.local_addr().unwrap()
}

pub struct Server {
    child: Child,
    pub addr: SocketAddr,
    log: PathBuf,
}

impl Server {
    /// Starts `command`, which must make the server listen on `addr`, with stdout and
    /// stderr both going to `log`.
    pub fn start(mut command: Command, addr: SocketAddr, log: &Path) -> Server {
        let out = std::fs::File::create(log).expect("creating the server log");
        let child = command
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|error| panic!("starting {:?}: {error}", command.get_program()));
        Server {
            child,
            addr,
            log: log.to_path_buf(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything the server (and the launcher, if any) printed so far.
    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Panics with the server's output, saying `what` went wrong.
    fn fail(&mut self, what: &str) -> ! {
        let status = self.child.try_wait().ok().flatten();
        panic!(
            "{what} (server at {}, {})\nits output:\n{}",
            self.addr,
            status.map_or("still running".to_string(), |status| format!("{status}")),
            self.output()
        );
    }

    /// Waits until `GET /health` says `{"status": "ok"}` (the model loaded, slots
    /// ready), at most `limit`; fails at once if the server ends meanwhile.
    pub fn wait_healthy(&mut self, limit: Duration) {
        let deadline = Instant::now() + limit;
        let mut last = String::from("no answer yet");
        while Instant::now() < deadline {
            if self.child.try_wait().unwrap().is_some() {
                self.fail("the server ended before it was healthy");
            }
            match http::get(self.addr, "/health", Duration::from_secs(5)) {
                Ok(response) if response.status == 200 && health_ok(&response.body) => return,
                Ok(response) => last = format!("{}: {}", response.status, response.body),
                Err(error) => last = error.to_string(),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        self.fail(&format!(
            "not healthy within {limit:?}; last /health: {last}"
        ));
    }

    /// Fails unless `GET /health` says ok now.
    pub fn assert_healthy(&mut self) {
        match http::get(self.addr, "/health", Duration::from_secs(10)) {
            Ok(response) if response.status == 200 && health_ok(&response.body) => {}
            other => self.fail(&format!("/health: {other:?}")),
        }
    }

    /// Sends SIGTERM to the process this started (the launcher, not its program) and
    /// waits for it to end, at most `limit`; returns its status and output.
    pub fn terminate(mut self, limit: Duration) -> (ExitStatus, String) {
        // SAFETY: signals our own child, not yet reaped (it is reaped only below or in
        // drop), so its pid cannot have been reused.
        let sent = unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        assert_eq!(sent, 0, "kill: {}", std::io::Error::last_os_error());
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return (status, self.output());
            }
            if Instant::now() > deadline {
                self.fail(&format!("still running {limit:?} after SIGTERM"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn health_ok(body: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(body)
        .is_ok_and(|json| json["status"].as_str() == Some("ok"))
}

impl Drop for Server {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        // SAFETY: the group is our unreaped child's (its pid is the group id, which
        // cannot be reused while the child is unreaped); SIGKILL ends the launcher and
        // its program alike.
        unsafe { libc::killpg(self.child.id() as libc::pid_t, libc::SIGKILL) };
        let _ = self.child.wait();
    }
}
