//! A thread that samples a run's memory every few milliseconds: its cgroup's usage, the
//! resident set of the processes in it, and where (and how much of) the model's files
//! are mapped.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::model_files::ModelFiles;
use super::proc_maps::{merge_ranges, model_ranges, model_rss_bytes, vm_rss_bytes};
use super::samples::{MappedRange, MemorySample};

/// What the sampler saw over the run.
#[derive(Debug, Default)]
pub struct SampledRun {
    pub memory: Vec<MemorySample>,
    pub model_ranges: Vec<MappedRange>,
}

pub struct Sampler {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<SampledRun>>,
}

impl Sampler {
    /// Samples the processes of the cgroup at `cgroup_dir` (its `cgroup.procs`) from
    /// `origin` on; `usage` reads the cgroup's charge.
    pub fn start(
        cgroup_dir: PathBuf,
        usage: impl Fn() -> Option<u64> + Send + 'static,
        model: ModelFiles,
        origin: Instant,
        interval: Duration,
    ) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut run = SampledRun::default();
                loop {
                    let finished = stop.load(Ordering::Acquire);
                    let pids: Vec<u32> = std::fs::read_to_string(cgroup_dir.join("cgroup.procs"))
                        .unwrap_or_default()
                        .lines()
                        .filter_map(|l| l.trim().parse().ok())
                        .collect();
                    let mut rss = None;
                    let mut model_rss = None;
                    for pid in &pids {
                        let proc = PathBuf::from(format!("/proc/{pid}"));
                        if let Ok(status) = std::fs::read_to_string(proc.join("status")) {
                            if let Some(bytes) = vm_rss_bytes(&status) {
                                *rss.get_or_insert(0) += bytes;
                            }
                        }
                        if let Ok(maps) = std::fs::read_to_string(proc.join("maps")) {
                            let ranges = model_ranges(&maps, &model);
                            if !ranges.is_empty() {
                                merge_ranges(&mut run.model_ranges, ranges);
                                if let Ok(smaps) = std::fs::read_to_string(proc.join("smaps")) {
                                    *model_rss.get_or_insert(0) += model_rss_bytes(&smaps, &model);
                                }
                            }
                        }
                    }
                    run.memory.push(MemorySample {
                        t_ns: origin.elapsed().as_nanos() as u64,
                        cgroup_bytes: usage(),
                        process_rss_bytes: rss,
                        model_rss_bytes: model_rss,
                    });
                    if finished {
                        return run;
                    }
                    std::thread::sleep(interval);
                }
            })
        };
        Sampler {
            stop,
            thread: Some(thread),
        }
    }

    pub fn finish(mut self) -> SampledRun {
        self.stop.store(true, Ordering::Release);
        self.thread
            .take()
            .and_then(|thread| thread.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
