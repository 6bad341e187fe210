//! The LD_PRELOAD shim's configuration: the `HYPEROFFLOAD_*` environment variables the
//! launcher (`hyperoffload run`) sets and the shim reads. Both sides use this type, so
//! the names and formats live in one place.
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `HYPEROFFLOAD_BUDGET` | RAM for all managed mappings together: a size (`48M`; a number without a unit only from 1 MiB) or `N%` of the size of the model of the first file the shim manages (all its parts for a split GGUF); or `auto`; raised to what the pager needs to make progress (`budget::floor`) | `auto`: what the process can have less a headroom (`budget::memory_limits::auto_budget`) |
//! | `HYPEROFFLOAD_BUDGET_MIN`, `HYPEROFFLOAD_BUDGET_MAX` | with `auto`: the least and the most the budget follows memory pressure to (sizes) | the pager's floor (`budget::floor`); the RAM less a quarter (`budget::memory_limits::auto_ceiling`) |
//! | `HYPEROFFLOAD_MATCH` | comma-separated globs on the file name (on the whole path if the glob has a `/`) | `*.gguf,*.safetensors` |
//! | `HYPEROFFLOAD_MIN_SIZE` | smaller files are left to the kernel | `64M` |
//! | `HYPEROFFLOAD_POLICY` | a name from [`crate::policy_name::POLICY_NAMES`] | `graph` |
//! | `HYPEROFFLOAD_BLOCK` | block size, a power of two from 4K to 1G | 2M with zero copy and a budget of at least 16M, else the pager's default (4K) |
//! | `HYPEROFFLOAD_INSTALL_THREADS` | threads installing prefetched reads beside the fault service thread (0-16) | the pager's default (2) |
//! | `HYPEROFFLOAD_ZERO_COPY` | `1`: map blocks from a huge-page store instead of copying them in, where the blocks are whole 2M pages and the process may (see `PagerBuilder::zero_copy`); `0`: always copy | `1` |
//! | `HYPEROFFLOAD_SERVE_FORKS` | `fork`: zero copy until the program first forks, which makes the regions file-shaped so that every child of `fork` is served by the pager, sharing its resident blocks and budget (`PagerBuilder::serve_forks_at_fork`); `1`: file-shaped from the start (`PagerBuilder::serve_forks`); `0`: a forked child maps the files from the page cache | `fork` |
//! | `HYPEROFFLOAD_EXPERT_BLOCKS` | `1`: each routed expert's slice of a mixture-of-experts model's tensors is blocks of its own (`graph::experts::expert_block_cuts`), so a token reads the experts it runs and not their neighbours; `0`: blocks follow the block-size grid alone | `1` |
//! | `HYPEROFFLOAD_SAVED_EXPERTS` | `1`: the graph policy starts from the expert use an earlier run saved beside the model (`graph::expert_store`) and saves what this run learned; `0`: it learns from this run alone and saves nothing (a cold measurement, or a run on text unlike the usual) | `1` |
//! | `HYPEROFFLOAD_STATS` | where to write the stats JSON at exit (created, never overwritten) | none |
//! | `HYPEROFFLOAD_SNAPSHOTS` | a directory where, while the pager runs, its stats JSON is written every half second as `snapshot-<pid>.json` (replaced atomically each time), so that a program killed by a signal, which runs no exit handlers, still leaves what it did | none |
//! | `HYPEROFFLOAD_TRACE` | where to write the shim's mapping events (JSON lines) at exit | none |
//! | `HYPEROFFLOAD_VERBOSE` | `1`: say on stderr what is taken over and why not | `0` |
//! | `HYPEROFFLOAD_INHERIT` | `1`: programs this one executes keep the shim | `0` |
//! | `HYPEROFFLOAD_KEEPER` | set by the launcher, not configuration: the descriptor number of its keeper's socket (`crate::keeper`), which the launched process inherits; with `SERVE_FORKS`, its pagers hand the keeper their regions and forked children, so that those children read the files' bytes when the process ends by `_exit`, a signal or an exec. Other processes close it | none |
//! | `HYPEROFFLOAD_SHARE_DIR` | set by the launcher under `--inherit`, not configuration: a directory private to the run where the pagers of its processes meet (`crate::share`). Every pager then uses file-shaped regions (as with `SERVE_FORKS`) and lets the other processes of the run attach to them; a process about to map a file another one serves maps that pager's region instead of starting a pager of its own, sharing its resident blocks and budget | none |
//! | `HYPEROFFLOAD_PROCESS` | which process the launcher started: the launcher sets it to [`PROCESS_UNCLAIMED`], the first program image that loads the shim overwrites it in place with its own identity, and every later image in that same process (exec through a wrapper) finds its own there and keeps the pager; any other process is a child (see the shim's `process_claim`) | unset: the process that loads the shim is served, its children are not |

use std::path::PathBuf;

use thiserror::Error;

use crate::budget::floor::{self, Raise};
use crate::policy_name::DEFAULT_POLICY;
use crate::size::{format_size, parse_size, SizeError};

mod from_env;

pub const ENV_BUDGET: &str = "HYPEROFFLOAD_BUDGET";
pub const ENV_BUDGET_MIN: &str = "HYPEROFFLOAD_BUDGET_MIN";
pub const ENV_BUDGET_MAX: &str = "HYPEROFFLOAD_BUDGET_MAX";
pub const ENV_MATCH: &str = "HYPEROFFLOAD_MATCH";
pub const ENV_MIN_SIZE: &str = "HYPEROFFLOAD_MIN_SIZE";
pub const ENV_POLICY: &str = "HYPEROFFLOAD_POLICY";
pub const ENV_BLOCK: &str = "HYPEROFFLOAD_BLOCK";
pub const ENV_INSTALL_THREADS: &str = "HYPEROFFLOAD_INSTALL_THREADS";
pub const ENV_ZERO_COPY: &str = "HYPEROFFLOAD_ZERO_COPY";
pub const ENV_SERVE_FORKS: &str = "HYPEROFFLOAD_SERVE_FORKS";
pub const ENV_EXPERT_BLOCKS: &str = "HYPEROFFLOAD_EXPERT_BLOCKS";
pub const ENV_SAVED_EXPERTS: &str = "HYPEROFFLOAD_SAVED_EXPERTS";
pub const ENV_STATS: &str = "HYPEROFFLOAD_STATS";
pub const ENV_SNAPSHOTS: &str = "HYPEROFFLOAD_SNAPSHOTS";
pub const ENV_TRACE: &str = "HYPEROFFLOAD_TRACE";
pub const ENV_VERBOSE: &str = "HYPEROFFLOAD_VERBOSE";
pub const ENV_INHERIT: &str = "HYPEROFFLOAD_INHERIT";
pub const ENV_PROCESS: &str = "HYPEROFFLOAD_PROCESS";
pub const ENV_KEEPER: &str = "HYPEROFFLOAD_KEEPER";
pub const ENV_SHARE_DIR: &str = "HYPEROFFLOAD_SHARE_DIR";

/// `HYPEROFFLOAD_PROCESS` as the launcher sets it: a placeholder as wide as any identity
/// the shim writes over it (environment strings can be edited in place, never grown).
pub const PROCESS_UNCLAIMED: &str = "unclaimed-process-id-placeholder";

/// Every variable the shim reads, for launchers that clear them.
pub const ALL_VARS: &[&str] = &[
    ENV_BUDGET,
    ENV_BUDGET_MIN,
    ENV_BUDGET_MAX,
    ENV_MATCH,
    ENV_MIN_SIZE,
    ENV_POLICY,
    ENV_BLOCK,
    ENV_INSTALL_THREADS,
    ENV_ZERO_COPY,
    ENV_SERVE_FORKS,
    ENV_EXPERT_BLOCKS,
    ENV_SAVED_EXPERTS,
    ENV_STATS,
    ENV_SNAPSHOTS,
    ENV_TRACE,
    ENV_VERBOSE,
    ENV_INHERIT,
    ENV_PROCESS,
    ENV_KEEPER,
    ENV_SHARE_DIR,
];

pub const DEFAULT_PATTERNS: &[&str] = &["*.gguf", "*.safetensors"];
pub const DEFAULT_MIN_SIZE: u64 = 64 << 20;
/// More install threads than this only contend for the same locks.
pub const MAX_INSTALL_THREADS: usize = 16;

/// A configuration variable with a value that cannot be used.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("{var}={value:?}: {reason}")]
pub struct ConfigError {
    pub var: &'static str,
    pub value: String,
    pub reason: String,
}

/// A budget that could not be understood.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum BudgetError {
    #[error("`{0}` is not a whole percentage (e.g. 50%)")]
    Percentage(String),
    #[error("percentage {0} is not within 1..=100")]
    PercentageRange(u32),
    #[error("the budget must be more than zero")]
    Zero,
    /// A number with no unit, too small to be meant as bytes: most likely a percentage.
    #[error(
        "`{0}` has no unit, so it would be {0} bytes, too little to serve anything: give a \
         percentage of the model (`{0}%`) or a size with a unit (`{0}M`, `{0}G`)"
    )]
    NoUnit(u64),
    #[error("{0}; give a size (48M, 2G) or a percentage of the model (50%)")]
    Size(#[from] SizeError),
}

/// Block sizes the pager takes: powers of two from one page to a gigabyte (the largest
/// huge page; larger blocks buy nothing, since reads merge neighbouring blocks anyway,
/// and cost a read buffer of one block for every slot of the ring).
pub const MIN_BLOCK: u64 = 4 << 10;
pub const MAX_BLOCK: u64 = 1 << 30;

/// A block size the pager cannot take.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum BlockError {
    #[error("{0}; {BLOCK_FORMS}")]
    Size(#[from] SizeError),
    #[error("a block of {bytes} bytes is smaller than a page{}; {BLOCK_FORMS}",
        if *.meant_kib { format!(" (did you mean {bytes}K?)") } else { String::new() })]
    TooSmall { bytes: u64, meant_kib: bool },
    #[error("a block of {} is not a power of two; {BLOCK_FORMS}", format_size(*.0))]
    NotPowerOfTwo(u64),
    #[error("a block of {} is larger than 1 GiB; {BLOCK_FORMS}", format_size(*.0))]
    TooLarge(u64),
}

const BLOCK_FORMS: &str = "a block size is a power of two from 4K to 1G (4K, 64K, 2M, 16M)";

/// Checks a block size in bytes.
pub fn check_block_size(bytes: u64) -> Result<u64, BlockError> {
    if bytes < MIN_BLOCK {
        Err(BlockError::TooSmall {
            bytes,
            meant_kib: false,
        })
    } else if !bytes.is_power_of_two() {
        Err(BlockError::NotPowerOfTwo(bytes))
    } else if bytes > MAX_BLOCK {
        Err(BlockError::TooLarge(bytes))
    } else {
        Ok(bytes)
    }
}

/// Parses and checks a block size as users write it (`64K`, `2M`); a plain number too
/// small for a block is answered with the unit it probably lacks.
pub fn parse_block_size(text: &str) -> Result<u64, BlockError> {
    let bytes = parse_size(text)?;
    // `--block 64` meant 64K: said so where that would be a block size.
    let meant_kib = text.trim().bytes().all(|b| b.is_ascii_digit())
        && bytes
            .checked_mul(1 << 10)
            .is_some_and(|kib| check_block_size(kib).is_ok());
    check_block_size(bytes).map_err(|error| match error {
        BlockError::TooSmall { bytes, .. } => BlockError::TooSmall { bytes, meant_kib },
        other => other,
    })
}

/// Plain numbers (no unit) below this are refused as budgets (see `BudgetError::NoUnit`).
pub const MIN_PLAIN_BUDGET: u64 = 1 << 20;

/// How much RAM the managed mappings may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BudgetSpec {
    /// What the process can have when the pager starts (the machine's available memory
    /// and its memory cgroup's room) less a headroom (`budget::memory_limits::auto_budget`).
    /// The default.
    Auto,
    Bytes(u64),
    /// Percent (1..=100) of the size of the model: the first file the shim manages, with
    /// all its parts when it is part of a split GGUF (`model::split::model_len`). Known
    /// only once the program maps it.
    ModelPercent(u32),
}

impl BudgetSpec {
    /// Parses `48M`, `1.5G`, `16384B`, `1073741824` or `50%`. A number with no unit must
    /// be at least `MIN_PLAIN_BUDGET`: `--budget 50` means 50 %, not 50 bytes, far more
    /// often than not.
    pub fn parse(text: &str) -> Result<Self, BudgetError> {
        let text = text.trim();
        if text == "auto" {
            return Ok(BudgetSpec::Auto);
        }
        if let Some(percent) = text.strip_suffix('%') {
            let value: u32 = percent
                .trim()
                .parse()
                .map_err(|_| BudgetError::Percentage(text.to_string()))?;
            if !(1..=100).contains(&value) {
                return Err(BudgetError::PercentageRange(value));
            }
            return Ok(BudgetSpec::ModelPercent(value));
        }
        let plain = !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit());
        match parse_size(text)? {
            0 => Err(BudgetError::Zero),
            bytes if plain && bytes < MIN_PLAIN_BUDGET => Err(BudgetError::NoUnit(bytes)),
            bytes => Ok(BudgetSpec::Bytes(bytes)),
        }
    }

    /// The budget in bytes, given the size of the model (see `ModelPercent`) and, for
    /// `Auto`, what the process can have (`auto`: `memory_limits::auto_budget`, or a
    /// fallback when nothing is known).
    pub fn resolve(self, model_len: u64, auto: impl FnOnce() -> u64) -> u64 {
        match self {
            BudgetSpec::Auto => auto(),
            BudgetSpec::Bytes(bytes) => bytes,
            BudgetSpec::ModelPercent(percent) => (model_len as u128 * percent as u128 / 100) as u64,
        }
    }

    /// The form `parse` reads back (bytes with their unit: a plain number that small
    /// would be refused).
    pub fn to_env_value(self) -> String {
        match self {
            BudgetSpec::Auto => "auto".to_string(),
            BudgetSpec::Bytes(bytes) => format!("{bytes}B"),
            BudgetSpec::ModelPercent(percent) => format!("{percent}%"),
        }
    }
}

impl std::fmt::Display for BudgetSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BudgetSpec::Auto => write!(f, "what this process can spare"),
            BudgetSpec::Bytes(bytes) => write!(f, "{}", format_size(*bytes)),
            BudgetSpec::ModelPercent(percent) => write!(f, "{percent}% of the model"),
        }
    }
}

/// Smallest budget for which the launcher picks huge-page blocks by itself: 8 of them,
/// so that the eviction policy still has choices. Measured: SmolLM2-135M (94 MiB) at
/// half its size, 23 blocks of 2 MiB, decodes at 30-38 tok/s with them against 12 with
/// 4 KiB blocks (`hyperoffload run --block 2M|4K`, llama-bench tg16).
pub const HUGE_BLOCK_MIN_BUDGET: u64 = 8 * HUGE_BLOCK;
const HUGE_BLOCK: u64 = crate::sys::memory::HUGE_PAGE;
/// Most blocks of a file the launcher's block size gives (see `block_size_for`).
pub const MAX_MAPPED_BLOCKS: u64 = 16 << 10;

/// What a pager starts with (`ShimConfig::sizing`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizing {
    pub block_size: u64,
    pub budget: u64,
    /// The budget asked for was below the pager's floor, and raised to it.
    pub raised: Option<Raise>,
}

/// What the shim does, as configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShimConfig {
    pub budget: BudgetSpec,
    /// With `BudgetSpec::Auto`: the least and the most the budget follows pressure to.
    pub budget_min: Option<u64>,
    pub budget_max: Option<u64>,
    pub patterns: Vec<String>,
    pub min_size: u64,
    pub policy: String,
    pub block_size: Option<u64>,
    pub install_threads: Option<usize>,
    pub zero_copy: bool,
    /// Whether children of `fork` are served by the pager from the start (see
    /// `ENV_SERVE_FORKS`).
    pub serve_forks: bool,
    /// Whether they are served from the program's first fork on.
    pub serve_forks_at_fork: bool,
    /// Whether routed experts' slices are blocks of their own (see `ENV_EXPERT_BLOCKS`).
    pub expert_blocks: bool,
    /// Whether expert use saved by earlier runs seeds this one, and this one's is saved
    /// (see `ENV_SAVED_EXPERTS`).
    pub saved_experts: bool,
    pub stats_path: Option<PathBuf>,
    /// Where the stats are written while the pager runs (see `ENV_SNAPSHOTS`).
    pub snapshot_dir: Option<PathBuf>,
    pub trace_path: Option<PathBuf>,
    pub verbose: bool,
    pub inherit: bool,
    /// The keeper's socket, by descriptor number (see `ENV_KEEPER`; set by the launcher
    /// beside this configuration, never by `to_env`).
    pub keeper_fd: Option<i32>,
    /// The run's share directory (see `ENV_SHARE_DIR`; set by the launcher under
    /// `--inherit`).
    pub share_dir: Option<PathBuf>,
}

impl ShimConfig {
    /// The block size for a pager of `budget` bytes whose model is `file_len` bytes (its
    /// first file, with all its parts for a split GGUF): the one configured, else
    /// huge-page blocks when zero copy is on and the budget holds at least 8 of them
    /// (zero copy needs whole huge pages; measured in docs/measurements.md), else the pager's
    /// default. Huge-page blocks are 2 MiB, or larger for models of more than
    /// `MAX_MAPPED_BLOCKS` of them: with zero copy each resident
    /// block is a mapping of its own, and a process may have only so many
    /// (`vm.max_map_count`, 65530 by default).
    pub fn block_size_for(&self, budget: u64, file_len: u64) -> u64 {
        self.block_size
            .unwrap_or_else(|| default_block_size(self.zero_copy, budget, file_len))
    }

    /// The block size and budget a pager of `budget` bytes starts with, for a model of
    /// `model_len` bytes (see `block_size_for`) and `threads` threads faulting at once:
    /// the budget is raised to what the pager needs to make progress (see
    /// `budget::floor`), and huge-page blocks the configuration did not ask for give way
    /// to the default ones where the budget would have to be raised for them.
    pub fn sizing(&self, budget: u64, model_len: u64, threads: usize) -> Sizing {
        let mut block_size = self.block_size_for(budget, model_len);
        if self.block_size.is_none() && budget < floor::floor(block_size, threads) {
            block_size = crate::pager::DEFAULT_BLOCK_SIZE;
        }
        let (budget, raised) = floor::raise_to_floor(budget, block_size, threads);
        Sizing {
            block_size,
            budget,
            raised,
        }
    }

    /// With `BudgetSpec::Auto`, the budget to start from when the process can have
    /// `auto` now: within `--min` and `--max`.
    pub fn bounded_auto(&self, auto: u64) -> u64 {
        let auto = self.budget_max.map_or(auto, |max| auto.min(max));
        self.budget_min.map_or(auto, |min| auto.max(min))
    }

    /// With `BudgetSpec::Auto`, the most the budget may follow pressure up to, for a
    /// pager starting at `budget` on a machine of `ram` bytes: `--max`, else the RAM less
    /// the headroom an automatic budget leaves (`budget::memory_limits::auto_ceiling`), never
    /// less than the start.
    pub fn auto_ceiling(&self, budget: u64, ram: u64) -> u64 {
        (self.budget_max)
            .unwrap_or_else(|| crate::budget::memory_limits::auto_ceiling(ram))
            .max(budget)
    }

    /// The configuration with every variable unset.
    pub fn defaults() -> Self {
        Self {
            budget: BudgetSpec::Auto,
            budget_min: None,
            budget_max: None,
            patterns: DEFAULT_PATTERNS.iter().map(|p| p.to_string()).collect(),
            min_size: DEFAULT_MIN_SIZE,
            policy: DEFAULT_POLICY.to_string(),
            block_size: None,
            install_threads: None,
            zero_copy: true,
            serve_forks: false,
            serve_forks_at_fork: true,
            expert_blocks: true,
            saved_experts: true,
            stats_path: None,
            snapshot_dir: None,
            trace_path: None,
            verbose: false,
            inherit: false,
            keeper_fd: None,
            share_dir: None,
        }
    }

    /// `ENV_SERVE_FORKS`'s value for this configuration.
    fn serve_forks_value(&self) -> &'static str {
        match (self.serve_forks, self.serve_forks_at_fork) {
            (true, _) => "1",
            (false, true) => "fork",
            (false, false) => "0",
        }
    }

    /// The environment that makes the shim read this configuration back.
    pub fn to_env(&self) -> Vec<(&'static str, String)> {
        let mut env = vec![
            (ENV_BUDGET, self.budget.to_env_value()),
            (ENV_MATCH, self.patterns.join(",")),
            (ENV_MIN_SIZE, self.min_size.to_string()),
            (ENV_POLICY, self.policy.clone()),
            (ENV_VERBOSE, u8::from(self.verbose).to_string()),
            (ENV_INHERIT, u8::from(self.inherit).to_string()),
            (ENV_ZERO_COPY, u8::from(self.zero_copy).to_string()),
            (ENV_SERVE_FORKS, self.serve_forks_value().to_string()),
            (ENV_EXPERT_BLOCKS, u8::from(self.expert_blocks).to_string()),
            (ENV_SAVED_EXPERTS, u8::from(self.saved_experts).to_string()),
            // Not configuration: filled by the process the launcher starts.
            (ENV_PROCESS, PROCESS_UNCLAIMED.to_string()),
        ];
        if let Some(block) = self.block_size {
            env.push((ENV_BLOCK, block.to_string()));
        }
        if let Some(min) = self.budget_min {
            env.push((ENV_BUDGET_MIN, format!("{min}B")));
        }
        if let Some(max) = self.budget_max {
            env.push((ENV_BUDGET_MAX, format!("{max}B")));
        }
        if let Some(threads) = self.install_threads {
            env.push((ENV_INSTALL_THREADS, threads.to_string()));
        }
        if let Some(path) = &self.stats_path {
            env.push((ENV_STATS, path.display().to_string()));
        }
        if let Some(path) = &self.snapshot_dir {
            env.push((ENV_SNAPSHOTS, path.display().to_string()));
        }
        if let Some(path) = &self.trace_path {
            env.push((ENV_TRACE, path.display().to_string()));
        }
        if let Some(path) = &self.share_dir {
            env.push((ENV_SHARE_DIR, path.display().to_string()));
        }
        env
    }

    /// Whether a file with this name (or path, for patterns with a `/`) is one to manage.
    pub fn matches(&self, path: &[u8]) -> bool {
        let name = match path.iter().rposition(|&b| b == b'/') {
            Some(slash) => &path[slash + 1..],
            None => path,
        };
        self.patterns.iter().any(|pattern| {
            let pattern = pattern.as_bytes();
            let subject = if pattern.contains(&b'/') { path } else { name };
            crate::glob::glob_match(pattern, subject)
        })
    }
}

/// Physical RAM of this machine in bytes (0 if unknown).
/// The block size for a file of `file_len` bytes under `budget` when none is given:
/// with zero copy and a budget of at least `HUGE_BLOCK_MIN_BUDGET`, whole huge pages
/// (more of them for a file of more than `MAX_MAPPED_BLOCKS` of them), else the page.
pub fn default_block_size(zero_copy: bool, budget: u64, file_len: u64) -> u64 {
    if zero_copy && budget >= HUGE_BLOCK_MIN_BUDGET {
        let blocks = file_len.div_ceil(HUGE_BLOCK).max(1);
        HUGE_BLOCK * blocks.div_ceil(MAX_MAPPED_BLOCKS).next_power_of_two()
    } else {
        crate::pager::DEFAULT_BLOCK_SIZE
    }
}

pub fn physical_ram() -> u64 {
    crate::sys::memory::physical_ram()
}

#[cfg(test)]
mod tests;
