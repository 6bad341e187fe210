//! The FUSE side of `hyperoffload mount`: a read-only tree of the remote objects, each
//! read served from the cache tier, missing blocks fetched (once, however many readers
//! wait for them) and the next ones read ahead.
//!
//! A read whose blocks are all cached is answered on the FUSE thread; any other goes to
//! the tokio runtime and is answered from there (fuser replies may be sent from any
//! thread), so many reads wait for the remote at once.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    KernelConfig, LockOwner, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEntry,
    ReplyOpen, Request,
};
use hyperoffload::remote::block_plan::BlockGrid;
use hyperoffload::remote::cache_store::{Cache, ObjectId};
use hyperoffload::remote::graph_eviction::GraphOrder;
use hyperoffload::remote::tree::{Kind, Tree};
use tokio::sync::{OnceCell, Semaphore};

use super::remote::{FetchError, ObjectInfo, Remote};

/// How long the kernel may keep names and attributes: they never change in a mount.
const TTL: Duration = Duration::from_secs(3600);

/// How long a block whose fetch failed for good fails again at once: the kernel reads a
/// page again when its read-ahead of it failed, and that second read must not wait a
/// whole deadline more.
const FAILED_RECENTLY: Duration = Duration::from_secs(1);

/// One object of the mount.
pub struct Served {
    pub info: ObjectInfo,
    pub grid: BlockGrid,
    pub cache: ObjectId,
    /// Set when the remote said the object changed: its missing blocks fail at once.
    pub changed: AtomicBool,
    /// Blocks whose cached bytes the kernel was asked to read ahead (once a mount).
    pub advised: Vec<AtomicBool>,
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
        }
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
            Some(Kind::File(_)) => {
                if flags.0 & libc::O_ACCMODE != libc::O_RDONLY {
                    reply.error(Errno::EROFS);
                } else {
                    // The object's version is fixed for the mount: the kernel may keep
                    // its pages across opens.
                    reply.opened(FileHandle(0), FopenFlags::FOPEN_KEEP_CACHE);
                }
            }
            Some(Kind::Dir(_)) => reply.error(Errno::EISDIR),
            None => reply.error(Errno::ENOENT),
        }
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
