//! How the mount answers a read: from the cache tier where it holds the blocks (on the
//! FUSE thread when it holds them all), else from the remote on the runtime, each
//! missing block fetched once however many readers wait for it and stored in the cache;
//! and the blocks read ahead of each read.

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use fuser::{Errno, ReplyData};
use hyperoffload::remote::block_plan::ReadPlan;

use super::super::remote::FetchError;
use super::{hyperoffload_lock, Shared};

/// How long a block whose fetch failed for good fails again at once: the kernel reads a
/// page again when its read-ahead of it failed, and that second read must not wait a
/// whole deadline more.
const FAILED_RECENTLY: Duration = Duration::from_secs(1);

impl Shared {
    /// Answers the kernel's read of `size` bytes at `offset` of `object`: on this
    /// thread when the cache holds every block, else from the runtime; the blocks after
    /// it are read ahead either way.
    pub fn serve_read(self: &Arc<Self>, object: usize, offset: u64, size: u32, reply: ReplyData) {
        self.reads.fetch_add(1, Ordering::Relaxed);
        let grid = self.objects[object].grid;
        let plan = grid.plan(offset, u64::from(size), self.readahead);
        if plan.bytes.is_empty() {
            reply.data(&[]);
            return;
        }
        let ahead = self.note_read(object, plan.needed.clone(), plan.ahead.clone());
        self.read_ahead(object, ahead);
        match self.all_cached(object, &plan) {
            Some(out) => {
                self.read_bytes
                    .fetch_add(out.len() as u64, Ordering::Relaxed);
                reply.data(&out);
            }
            None => self.answer_from_runtime(object, plan.bytes, reply),
        }
    }

    /// The bytes of `plan` when the cache holds every block it needs, read on this
    /// thread; `None` when it lacks one (or one fails to read).
    fn all_cached(&self, object: usize, plan: &ReadPlan) -> Option<Vec<u8>> {
        let id = self.objects[object].cache;
        if !plan
            .needed
            .clone()
            .all(|block| self.cache.contains(id, block))
        {
            return None;
        }
        let grid = self.objects[object].grid;
        let mut out = vec![0u8; (plan.bytes.end - plan.bytes.start) as usize];
        for block in plan.needed.clone() {
            let span = grid.bytes_of(block);
            let from = span.start.max(plan.bytes.start);
            let to = span.end.min(plan.bytes.end);
            let dest =
                &mut out[(from - plan.bytes.start) as usize..(to - plan.bytes.start) as usize];
            if !self.cached(object, block, from - span.start, dest) {
                return None;
            }
        }
        Some(out)
    }

    /// Reads `bytes` of `object` on the runtime and answers from there: EIO when the
    /// read fails or has no answer within the read deadline.
    fn answer_from_runtime(self: &Arc<Self>, object: usize, bytes: Range<u64>, reply: ReplyData) {
        let shared = Arc::clone(self);
        self.runtime.spawn(async move {
            let deadline = shared.read_deadline;
            let result = tokio::time::timeout(deadline, shared.read(object, bytes.clone())).await;
            match result {
                Ok(Ok(data)) => {
                    shared
                        .read_bytes
                        .fetch_add(data.len() as u64, Ordering::Relaxed);
                    reply.data(&data);
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
                        bytes.start,
                        bytes.end,
                        deadline.as_secs_f64()
                    );
                    reply.error(Errno::EIO);
                }
            }
        });
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
