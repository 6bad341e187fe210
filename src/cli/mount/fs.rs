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
//!
//! Here: the filesystem fuser runs and the state it shares with the runtime's tasks.
//! How an open is answered is `opens`'; how a read is, `reads`'.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyOpen, Request,
};
use hyperoffload::remote::block_plan::BlockGrid;
use hyperoffload::remote::cache_store::{Cache, ObjectId};
use hyperoffload::remote::graph_eviction::GraphOrder;
use hyperoffload::remote::passthrough::Why;
use hyperoffload::remote::tree::{Kind, Tree};
use tokio::sync::{OnceCell, Semaphore};

use super::remote::{FetchError, ObjectInfo, Remote};
pub use opens::OpenState;

mod opens;
mod reads;

/// How long the kernel may keep names and attributes: they never change in a mount.
const TTL: Duration = Duration::from_secs(3600);

/// How deep the cache directory's filesystem may be stacked for passthrough: 2 lets
/// it be an overlayfs (a container's root); the kernel refuses more. The price: the
/// mount itself cannot be a layer of an overlayfs (nobody stacks a model mount).
const MAX_STACK_DEPTH: u32 = 2;

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
        self.shared.serve_read(*object, offset, size, reply);
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
