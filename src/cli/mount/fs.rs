//! The FUSE side of `hyperoffload mount`: a read-only tree of the remote objects, each
//! read served from the cache tier, missing blocks fetched (once, however many readers
//! wait for them) and the next ones read ahead.
//!
//! A read whose blocks are all cached is answered on the FUSE thread; any other goes to
//! the tokio runtime and is answered from there (fuser replies may be sent from any
//! thread), so many reads wait for the remote at once.
//!
//! An object wholly cached (every block present and CRC-checked in this mount) is
//! opened with FUSE passthrough where the kernel allows it: the kernel then reads the
//! cache tier's data file itself, `O_DIRECT` reads included, and no read of that handle
//! reaches the mount (`hyperoffload::remote::passthrough` decides; `Cache::hold` keeps
//! the file's bytes for the rest of the mount). Its version is the one seen at mount,
//! as for every cached byte: a change on the remote is never seen through it, and never
//! mixes versions.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use fuser::{
    BackingId, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    InitFlags, KernelConfig, LockOwner, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory,
    ReplyEmpty, ReplyEntry, ReplyOpen, Request,
};
use hyperoffload::remote::block_plan::BlockGrid;
use hyperoffload::remote::cache_store::{Cache, ObjectId};
use hyperoffload::remote::graph_eviction::GraphOrder;
use hyperoffload::remote::passthrough::{open_mode, Completeness, OpenMode, Opens, Why};
use hyperoffload::remote::tree::{Kind, Tree};
use tokio::sync::{OnceCell, Semaphore};

use super::remote::{FetchError, ObjectInfo, Remote};

/// How long the kernel may keep names and attributes: they never change in a mount.
const TTL: Duration = Duration::from_secs(3600);

/// How long a block whose fetch failed for good fails again at once: the kernel reads a
/// page again when its read-ahead of it failed, and that second read must not wait a
/// whole deadline more.
const FAILED_RECENTLY: Duration = Duration::from_secs(1);

/// The handle of an open answered with passthrough, and of one through the read path
/// (told apart at release).
const PASSTHROUGH_FH: FileHandle = FileHandle(1);
const FUSE_FH: FileHandle = FileHandle(2);

/// How deep the cache directory's filesystem may be stacked for passthrough: 2 lets
/// it be an overlayfs (a container's root); the kernel refuses more. The price: the
/// mount itself cannot be a layer of an overlayfs (nobody stacks a model mount).
const MAX_STACK_DEPTH: u32 = 2;

/// The open handles of one object, and the kernel's reference to its cache file once
/// one was opened with passthrough (kept for the mount: every passthrough open of an
/// inode must name the same backing file).
#[derive(Default)]
pub struct OpenState {
    opens: Opens,
    backing: Option<BackingId>,
}

/// One object of the mount.
pub struct Served {
    pub info: ObjectInfo,
    pub grid: BlockGrid,
    pub cache: ObjectId,
    /// Set when the remote said the object changed: its missing blocks fail at once.
    pub changed: AtomicBool,
    /// Blocks whose cached bytes the kernel was asked to read ahead (once a mount).
    pub advised: Vec<AtomicBool>,
    /// Its open handles; taken before the cache's lock, never after.
    pub opens: Mutex<OpenState>,
    /// Held while its cached blocks are CRC-checked, so that one check runs at a time
    /// and later ones find the blocks checked.
    pub checking: tokio::sync::Mutex<()>,
}

type Inflight = Arc<OnceCell<Result<Bytes, FetchError>>>;

/// What the FUSE thread and the runtime's tasks share.
pub struct Shared {
    pub objects: Vec<Served>,
    pub cache: Cache,
    pub remote: Remote,
    pub runtime: tokio::runtime::Handle,
    /// The cache's eviction order when it is the graph's: told every read, and asked
    /// what a model object's pass reads next.
    pub graph: Option<Arc<GraphOrder>>,
    /// Blocks being fetched, by (object, block): later readers wait on the same fetch.
    inflight: Mutex<HashMap<(usize, u64), Inflight>>,
    /// Ranged GETs in flight at most.
    gets: Semaphore,
    max_inflight: usize,
    readahead: u64,
    /// The longest a read waits before it fails (the remote's deadline and a margin).
    read_deadline: Duration,
    pub reads: AtomicU64,
    pub read_bytes: AtomicU64,
    pub read_errors: AtomicU64,
    /// Errors already said, so a dead remote is reported once per object and kind.
    said: Mutex<std::collections::HashSet<(usize, bool)>>,
    /// Blocks whose last fetch failed for good, and when.
    failed: Mutex<HashMap<(usize, u64), (Instant, FetchError)>>,
    /// Why passthrough is off in this mount; None while it is on.
    passthrough_off: Mutex<Option<String>>,
    /// Opens answered with passthrough.
    pub passthrough_opens: AtomicU64,
    /// Opens answered through the read path, by `Why` (`why_index`).
    pub fuse_opens: [AtomicU64; 4],
}

/// Where an open through the read path is counted, and its name in the stats.
pub fn why_index(why: Why) -> (usize, &'static str) {
    match why {
        Why::Off => (0, "off"),
        Why::NotCached => (1, "not_cached"),
        Why::NotChecked => (2, "not_checked"),
        Why::OpenThroughFuse => (3, "open_through_fuse"),
    }
}

impl Shared {
    pub fn new(
        objects: Vec<Served>,
        cache: Cache,
        remote: Remote,
        runtime: tokio::runtime::Handle,
        graph: Option<Arc<GraphOrder>>,
        max_inflight: usize,
        readahead: u64,
    ) -> Self {
        let read_deadline = remote.policy.deadline + Duration::from_secs(2);
        Self {
            objects,
            cache,
            remote,
            runtime,
            graph,
            inflight: Mutex::new(HashMap::new()),
            gets: Semaphore::new(max_inflight),
            max_inflight,
            readahead,
            read_deadline,
            reads: AtomicU64::new(0),
            read_bytes: AtomicU64::new(0),
            read_errors: AtomicU64::new(0),
            said: Mutex::new(Default::default()),
            failed: Mutex::new(HashMap::new()),
            passthrough_off: Mutex::new(None),
            passthrough_opens: AtomicU64::new(0),
            fuse_opens: Default::default(),
        }
    }

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

    /// The bytes `bytes` of object `object`, from the cache where it has them, else
    /// fetched (whole blocks, written to the cache).
    pub async fn read(
        self: &Arc<Self>,
        object: usize,
        bytes: Range<u64>,
    ) -> Result<Vec<u8>, FetchError> {
        let grid = self.objects[object].grid;
        let plan = grid.plan(bytes.start, bytes.end - bytes.start, 0);
        let mut out = vec![0u8; (plan.bytes.end - plan.bytes.start) as usize];
        for block in plan.needed {
            let span = grid.bytes_of(block);
            let from = span.start.max(plan.bytes.start);
            let to = span.end.min(plan.bytes.end);
            let dest =
                &mut out[(from - plan.bytes.start) as usize..(to - plan.bytes.start) as usize];
            if self.cached(object, block, from - span.start, dest) {
                continue;
            }
            let data = self.block(object, block).await?;
            dest.copy_from_slice(&data[(from - span.start) as usize..(to - span.start) as usize]);
        }
        Ok(out)
    }

    /// Reads from the cache; false when the block is not there (or the cache failed,
    /// which is said: the remote is asked instead).
    fn cached(&self, object: usize, block: u64, offset: u64, dest: &mut [u8]) -> bool {
        match self
            .cache
            .read(self.objects[object].cache, block, offset, dest)
        {
            Ok(hit) => hit,
            Err(error) => {
                eprintln!(
                    "hyperoffload: mount: cache read of {} block {block}: {error}; reading the remote",
                    self.objects[object].info.name
                );
                false
            }
        }
    }

    /// Block `block` of `object` from the remote, fetched once for all who ask while
    /// it is on its way, and stored in the cache.
    async fn block(self: &Arc<Self>, object: usize, block: u64) -> Result<Bytes, FetchError> {
        let served = &self.objects[object];
        if served.changed.load(Ordering::Relaxed) {
            return Err(FetchError::Changed {
                name: served.info.name.clone(),
                opened: served.info.etag.clone(),
                now: None,
            });
        }
        if let Some((when, error)) = hyperoffload_lock(&self.failed).get(&(object, block)) {
            if when.elapsed() < FAILED_RECENTLY {
                return Err(error.clone());
            }
        }
        let cell = hyperoffload_lock(&self.inflight)
            .entry((object, block))
            .or_default()
            .clone();
        let result = cell
            .get_or_init(|| async {
                let span = self.objects[object].grid.bytes_of(block);
                let len = (span.end - span.start) as usize;
                // Stored by a fetch that just ended?
                let mut buf = vec![0u8; len];
                if self.cached(object, block, 0, &mut buf) {
                    return Ok(Bytes::from(buf));
                }
                drop(buf);
                let _permit = self.gets.acquire().await.expect("semaphore closed");
                let fetched = self.remote.get(&self.objects[object].info, span).await;
                match &fetched {
                    Ok(bytes) => {
                        let this = Arc::clone(self);
                        let bytes = bytes.clone();
                        let id = self.objects[object].cache;
                        let stored = tokio::task::spawn_blocking(move || {
                            this.cache.store(id, block, &bytes)
                        })
                        .await;
                        if let Ok(Err(error)) = stored {
                            eprintln!(
                                "hyperoffload: mount: caching {} block {block}: {error}",
                                self.objects[object].info.name
                            );
                        }
                    }
                    Err(FetchError::Changed { .. }) => {
                        self.objects[object].changed.store(true, Ordering::Relaxed);
                    }
                    Err(error @ FetchError::Failed { .. }) => {
                        hyperoffload_lock(&self.failed)
                            .insert((object, block), (Instant::now(), error.clone()));
                    }
                }
                if fetched.is_ok() {
                    hyperoffload_lock(&self.failed).remove(&(object, block));
                }
                fetched
            })
            .await
            .clone();
        let mut inflight = hyperoffload_lock(&self.inflight);
        if inflight
            .get(&(object, block))
            .is_some_and(|c| Arc::ptr_eq(c, &cell))
        {
            inflight.remove(&(object, block));
        }
        result
    }

    /// A program reads blocks `needed` of `object`: tells the graph's order, and
    /// returns the blocks to read ahead: the next ones of a model's pass, else those
    /// after `needed` in the file (`file_ahead`).
    fn note_read(&self, object: usize, needed: Range<u64>, file_ahead: Range<u64>) -> Vec<u64> {
        if let Some(graph) = &self.graph {
            let id = self.objects[object].cache.index();
            for block in needed {
                graph.used(id, block);
            }
            if let Some(ahead) = graph.ahead(id, self.readahead as usize) {
                return ahead;
            }
        }
        file_ahead.collect()
    }

    /// Starts fetching the blocks of `ahead` not cached nor on their way, while fewer
    /// than the GETs allowed are in flight (read-ahead never queues behind itself).
    fn read_ahead(self: &Arc<Self>, object: usize, ahead: Vec<u64>) {
        if self.objects[object].changed.load(Ordering::Relaxed) {
            return;
        }
        let id = self.objects[object].cache;
        for block in ahead {
            {
                let inflight = hyperoffload_lock(&self.inflight);
                if inflight.len() >= self.max_inflight {
                    return;
                }
                if inflight.contains_key(&(object, block)) {
                    continue;
                }
            }
            let advised = &self.objects[object].advised[block as usize];
            if advised.load(Ordering::Relaxed) {
                continue;
            }
            if self.cache.prefetch(id, block) {
                advised.store(true, Ordering::Relaxed);
                continue;
            }
            let this = Arc::clone(self);
            self.runtime.spawn(async move {
                if let Err(error) = this.block(object, block).await {
                    this.say(object, &error);
                }
            });
        }
    }

    fn say(&self, object: usize, error: &FetchError) {
        let kind = matches!(error, FetchError::Changed { .. });
        if hyperoffload_lock(&self.said).insert((object, kind)) {
            eprintln!("hyperoffload: mount: {error}");
        }
    }
}

fn hyperoffload_lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The filesystem fuser runs.
pub struct MountFs {
    pub tree: Tree,
    pub shared: Arc<Shared>,
    pub uid: u32,
    pub gid: u32,
    pub mounted_at: SystemTime,
}

impl MountFs {
    fn attr(&self, ino: u64) -> Option<FileAttr> {
        let node = self.tree.node(ino)?;
        let (kind, size, perm, mtime) = match node.kind {
            Kind::Dir(_) => (FileType::Directory, 0, 0o555, self.mounted_at),
            Kind::File(object) => {
                let info = &self.shared.objects[object].info;
                (FileType::RegularFile, info.size, 0o444, info.modified)
            }
        };
        Some(FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: mtime,
            mtime,
            ctime: mtime,
            crtime: mtime,
            kind,
            perm,
            nlink: if kind == FileType::Directory { 2 } else { 1 },
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: 1 << 20,
            flags: 0,
        })
    }
}

impl Filesystem for MountFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // The kernel's own read-ahead in large steps; ours (whole blocks) runs beside it.
        let mut want = 8u32 << 20;
        while config.set_max_readahead(want).is_err() && want > 128 << 10 {
            want /= 2;
        }
        if self.shared.passthrough_off().is_none() {
            let offered = config
                .add_capabilities(InitFlags::FUSE_PASSTHROUGH)
                .map_err(|_| {
                    "the kernel does not offer it (Linux 6.9 or newer, CONFIG_FUSE_PASSTHROUGH)"
                        .to_string()
                })
                .and_then(|()| {
                    config
                        .set_max_stack_depth(MAX_STACK_DEPTH)
                        .map(drop)
                        .map_err(|most| {
                            format!("the kernel allows a stacking depth of {most} at most")
                        })
                });
            if let Err(why) = offered {
                self.shared.turn_passthrough_off(why);
            }
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let found = name
            .to_str()
            .and_then(|name| self.tree.lookup(parent.0, name))
            .and_then(|ino| self.attr(ino));
        match found {
            Some(attr) => reply.entry(&TTL, &attr, Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.attr(ino.0) {
            Some(attr) => reply.attr(&TTL, &attr),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        match self.tree.node(ino.0).map(|n| &n.kind) {
            Some(Kind::File(object)) => {
                if flags.0 & libc::O_ACCMODE != libc::O_RDONLY {
                    reply.error(Errno::EROFS);
                } else {
                    self.shared.open(*object, reply, true);
                }
            }
            Some(Kind::Dir(_)) => reply.error(Errno::EISDIR),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        if let Some(Kind::File(object)) = self.tree.node(ino.0).map(|n| &n.kind) {
            self.shared.release(*object, fh);
        }
        reply.ok();
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let Some(Kind::File(object)) = self.tree.node(ino.0).map(|n| &n.kind) else {
            reply.error(Errno::ENOENT);
            return;
        };
        let object = *object;
        let shared = &self.shared;
        shared.reads.fetch_add(1, Ordering::Relaxed);
        let grid = shared.objects[object].grid;
        let plan = grid.plan(offset, u64::from(size), shared.readahead);
        if plan.bytes.is_empty() {
            reply.data(&[]);
            return;
        }
        let ahead = shared.note_read(object, plan.needed.clone(), plan.ahead.clone());
        shared.read_ahead(object, ahead);
        // All cached: answer here.
        let id = shared.objects[object].cache;
        if plan
            .needed
            .clone()
            .all(|block| shared.cache.contains(id, block))
        {
            let mut out = vec![0u8; (plan.bytes.end - plan.bytes.start) as usize];
            let mut all = true;
            for block in plan.needed.clone() {
                let span = grid.bytes_of(block);
                let from = span.start.max(plan.bytes.start);
                let to = span.end.min(plan.bytes.end);
                let dest =
                    &mut out[(from - plan.bytes.start) as usize..(to - plan.bytes.start) as usize];
                if !shared.cached(object, block, from - span.start, dest) {
                    all = false;
                    break;
                }
            }
            if all {
                shared
                    .read_bytes
                    .fetch_add(out.len() as u64, Ordering::Relaxed);
                reply.data(&out);
                return;
            }
        }
        let shared = Arc::clone(shared);
        let runtime = shared.runtime.clone();
        runtime.spawn(async move {
            let deadline = shared.read_deadline;
            let result =
                tokio::time::timeout(deadline, shared.read(object, plan.bytes.clone())).await;
            match result {
                Ok(Ok(bytes)) => {
                    shared
                        .read_bytes
                        .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                    reply.data(&bytes);
                }
                Ok(Err(error)) => {
                    shared.read_errors.fetch_add(1, Ordering::Relaxed);
                    shared.say(object, &error);
                    reply.error(Errno::EIO);
                }
                Err(_) => {
                    shared.read_errors.fetch_add(1, Ordering::Relaxed);
                    eprintln!(
                        "hyperoffload: mount: {}: bytes {}..{}: no answer in {:.1} s: EIO",
                        shared.objects[object].info.name,
                        plan.bytes.start,
                        plan.bytes.end,
                        deadline.as_secs_f64()
                    );
                    reply.error(Errno::EIO);
                }
            }
        });
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let Some(node) = self.tree.node(ino.0) else {
            reply.error(Errno::ENOENT);
            return;
        };
        let Kind::Dir(entries) = &node.kind else {
            reply.error(Errno::ENOTDIR);
            return;
        };
        let mut all = vec![
            (ino.0, FileType::Directory, ".".to_string()),
            (node.parent, FileType::Directory, "..".to_string()),
        ];
        for (name, &child) in entries {
            let kind = match self.tree.node(child).map(|n| &n.kind) {
                Some(Kind::Dir(_)) => FileType::Directory,
                _ => FileType::RegularFile,
            };
            all.push((child, kind, name.clone()));
        }
        for (index, (child, kind, name)) in all.into_iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(child), index as u64 + 1, kind, name) {
                break;
            }
        }
        reply.ok();
    }
}
