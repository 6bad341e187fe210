//! How the mount answers an open: with FUSE passthrough to the object's cache file when
//! the object is held whole and checked (`hyperoffload::remote::passthrough` decides),
//! else through the read path; the CRC check of objects an earlier mount cached; and
//! the count of open handles each object has.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use fuser::{BackingId, FileHandle, FopenFlags, ReplyOpen};
use hyperoffload::remote::passthrough::{open_mode, Completeness, OpenMode, Opens, Why};

use super::{hyperoffload_lock, why_index, Shared};

/// The handle of an open answered with passthrough, and of one through the read path
/// (told apart at release).
pub(super) const PASSTHROUGH_FH: FileHandle = FileHandle(1);
pub(super) const FUSE_FH: FileHandle = FileHandle(2);

/// The open handles of one object, and the kernel's reference to its cache file once
/// one was opened with passthrough (kept for the mount: every passthrough open of an
/// inode must name the same backing file).
#[derive(Default)]
pub struct OpenState {
    opens: Opens,
    backing: Option<BackingId>,
}

impl Shared {
    /// Why passthrough is off in this mount, if it is.
    pub fn passthrough_off(&self) -> Option<String> {
        hyperoffload_lock(&self.passthrough_off).clone()
    }

    /// Turns passthrough off for the rest of the mount (opens answered with it stay),
    /// saying why once.
    pub fn turn_passthrough_off(&self, why: String) {
        let mut off = hyperoffload_lock(&self.passthrough_off);
        if off.is_none() {
            eprintln!(
                "hyperoffload: mount: no FUSE passthrough: {why}; files are read through the mount"
            );
            *off = Some(why);
        }
    }

    /// Starts checking the cached blocks of every object cached whole by an earlier
    /// mount, so that its first open can pass through without waiting long.
    pub fn check_cached(self: &Arc<Self>) {
        if self.passthrough_off().is_some() {
            return;
        }
        for (object, served) in self.objects.iter().enumerate() {
            if self.cache.completeness(served.cache) == Completeness::Unchecked {
                let this = Arc::clone(self);
                self.runtime.spawn(async move { this.check(object).await });
            }
        }
    }

    /// CRC-checks the blocks of `object` not checked yet in this mount (on a blocking
    /// thread: it reads the whole object).
    async fn check(self: &Arc<Self>, object: usize) {
        let served = &self.objects[object];
        let _one = served.checking.lock().await;
        if self.cache.completeness(served.cache) != Completeness::Unchecked {
            return;
        }
        let this = Arc::clone(self);
        let id = served.cache;
        let started = Instant::now();
        let checked = tokio::task::spawn_blocking(move || this.cache.check_all(id)).await;
        let name = &served.info.name;
        match checked {
            Ok(Ok(Completeness::Whole)) => eprintln!(
                "hyperoffload: mount: {name}: every block cached, checked in {:.1} s: opens pass through to the cache file",
                started.elapsed().as_secs_f64()
            ),
            Ok(Ok(_)) => eprintln!(
                "hyperoffload: mount: {name}: a cached block failed its check (it is fetched again when read)"
            ),
            Ok(Err(error)) => {
                eprintln!("hyperoffload: mount: {name}: checking its cached blocks: {error}")
            }
            Err(error) => {
                eprintln!("hyperoffload: mount: {name}: checking its cached blocks: {error}")
            }
        }
    }

    /// Answers a read-only open of `object`: with passthrough to its cache file where
    /// `open_mode` says so, else through the read path. Blocks cached but not checked
    /// are checked first, on the runtime (so the FUSE thread goes on), the answer
    /// waiting for it at most the read deadline (`may_check`: false once waited).
    pub fn open(self: &Arc<Self>, object: usize, reply: ReplyOpen, may_check: bool) {
        let served = &self.objects[object];
        let mut guard = hyperoffload_lock(&served.opens);
        let state: &mut OpenState = &mut guard;
        let held = if state.opens.passthrough > 0 {
            Completeness::Whole // held since its first passthrough open
        } else {
            self.cache.completeness(served.cache)
        };
        let available = self.passthrough_off().is_none();
        let mut mode = open_mode(available, held, state.opens, may_check);
        if mode == OpenMode::CheckFirst {
            drop(guard);
            let this = Arc::clone(self);
            self.runtime.spawn(async move {
                let deadline = this.read_deadline;
                if tokio::time::timeout(deadline, this.check(object)).await.is_err() {
                    eprintln!(
                        "hyperoffload: mount: {}: its cached blocks are not checked after {:.1} s: this open is read through the mount",
                        this.objects[object].info.name,
                        deadline.as_secs_f64()
                    );
                }
                this.open(object, reply, false);
            });
            return;
        }
        if mode == OpenMode::Passthrough {
            if state.backing.is_none() {
                let file = self.cache.data_file(served.cache);
                match reply.open_backing(&*file) {
                    Ok(backing) => state.backing = Some(backing),
                    Err(error) => self.turn_passthrough_off(format!(
                        "the kernel refused the cache file of {} as a backing file (FUSE_DEV_IOC_BACKING_OPEN: {error})",
                        served.info.name
                    )),
                }
            }
            mode = match &state.backing {
                // Held whole from the first passthrough open on: the kernel reads the
                // file from then on, outside any read the cache could pin.
                Some(backing) if state.opens.passthrough > 0 || self.cache.hold(served.cache) => {
                    state.opens.passthrough += 1;
                    self.passthrough_opens.fetch_add(1, Ordering::Relaxed);
                    reply.opened_passthrough(PASSTHROUGH_FH, FopenFlags::empty(), backing);
                    return;
                }
                // A block was evicted since it was looked at.
                Some(_) => OpenMode::Fuse(Why::NotCached),
                None => OpenMode::Fuse(Why::Off),
            };
        }
        let OpenMode::Fuse(why) = mode else {
            unreachable!("{mode:?} answered above");
        };
        state.opens.fuse += 1;
        self.fuse_opens[why_index(why).0].fetch_add(1, Ordering::Relaxed);
        // The object's version is fixed for the mount: the kernel may keep its pages
        // across opens.
        reply.opened(FUSE_FH, FopenFlags::FOPEN_KEEP_CACHE);
    }

    /// The kernel released a handle of `object`.
    pub fn release(&self, object: usize, fh: FileHandle) {
        let mut state = hyperoffload_lock(&self.objects[object].opens);
        let count = match fh {
            PASSTHROUGH_FH => &mut state.opens.passthrough,
            FUSE_FH => &mut state.opens.fuse,
            _ => return,
        };
        *count = count.saturating_sub(1);
    }
}
