//! Reading a `ShimConfig` from the `HYPEROFFLOAD_*` variables: each one parsed and
//! checked in turn, the first bad value the error (`ShimConfig::from_lookup`).

use std::path::PathBuf;

use super::{
    parse_block_size, BudgetSpec, ConfigError, ShimConfig, ENV_BLOCK, ENV_BUDGET, ENV_BUDGET_MAX,
    ENV_BUDGET_MIN, ENV_EXPERT_BLOCKS, ENV_INHERIT, ENV_INSTALL_THREADS, ENV_KEEPER, ENV_MATCH,
    ENV_MIN_SIZE, ENV_POLICY, ENV_SAVED_EXPERTS, ENV_SERVE_FORKS, ENV_SHARE_DIR, ENV_SNAPSHOTS,
    ENV_STATS, ENV_TRACE, ENV_VERBOSE, ENV_ZERO_COPY, MAX_INSTALL_THREADS,
};
use crate::policy_name::check_policy_name;
use crate::size::parse_size;

/// What `lookup` gives: a variable's value, or `None` when it is unset.
type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

impl ShimConfig {
    /// Reads the configuration through `lookup` (a variable's value, or `None` when
    /// unset). The first bad value is the error.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let lookup: Lookup<'_> = &lookup;
        let mut config = Self::defaults();
        config.read_budget(lookup)?;
        config.read_files(lookup)?;
        config.read_pager(lookup)?;
        config.read_reports(lookup)?;
        config.read_run(lookup)?;
        Ok(config)
    }

    /// The budget, and with `auto` the least and the most it follows pressure to.
    fn read_budget(&mut self, lookup: Lookup<'_>) -> Result<(), ConfigError> {
        if let Some(value) = lookup(ENV_BUDGET) {
            self.budget = BudgetSpec::parse(&value)
                .map_err(|error| bad(ENV_BUDGET, &value, error.to_string()))?;
        }
        for (var, bound) in [
            (ENV_BUDGET_MIN, &mut self.budget_min),
            (ENV_BUDGET_MAX, &mut self.budget_max),
        ] {
            if let Some(value) = lookup(var) {
                let bytes =
                    parse_size(&value).map_err(|error| bad(var, &value, error.to_string()))?;
                *bound = Some(bytes);
            }
        }
        if let (Some(min), Some(max)) = (self.budget_min, self.budget_max) {
            if min > max {
                return Err(bad(
                    ENV_BUDGET_MIN,
                    &min.to_string(),
                    format!("more than {ENV_BUDGET_MAX} ({max})"),
                ));
            }
        }
        Ok(())
    }

    /// Which files the shim manages: the patterns their names match, the least size.
    fn read_files(&mut self, lookup: Lookup<'_>) -> Result<(), ConfigError> {
        if let Some(value) = lookup(ENV_MATCH) {
            let patterns: Vec<String> = value
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .map(str::to_string)
                .collect();
            if patterns.is_empty() {
                return Err(bad(
                    ENV_MATCH,
                    &value,
                    "no patterns (give comma-separated globs such as *.gguf)".into(),
                ));
            }
            self.patterns = patterns;
        }
        if let Some(value) = lookup(ENV_MIN_SIZE) {
            self.min_size =
                parse_size(&value).map_err(|error| bad(ENV_MIN_SIZE, &value, error.to_string()))?;
        }
        Ok(())
    }

    /// How the pager runs: its policy, block size, install threads, zero copy, forked
    /// children and experts' blocks.
    fn read_pager(&mut self, lookup: Lookup<'_>) -> Result<(), ConfigError> {
        if let Some(value) = lookup(ENV_POLICY) {
            let name = value.trim();
            check_policy_name(name).map_err(|error| bad(ENV_POLICY, &value, error.to_string()))?;
            self.policy = name.to_string();
        }
        if let Some(value) = lookup(ENV_BLOCK) {
            let size = parse_block_size(&value)
                .map_err(|error| bad(ENV_BLOCK, &value, error.to_string()))?;
            self.block_size = Some(size);
        }
        if let Some(value) = lookup(ENV_INSTALL_THREADS) {
            self.install_threads = Some(install_threads(&value)?);
        }
        if lookup(ENV_ZERO_COPY).is_some() {
            self.zero_copy = flag(lookup, ENV_ZERO_COPY)?;
        }
        (self.serve_forks, self.serve_forks_at_fork) = serve_forks(lookup)?;
        if lookup(ENV_EXPERT_BLOCKS).is_some() {
            self.expert_blocks = flag(lookup, ENV_EXPERT_BLOCKS)?;
        }
        if lookup(ENV_SAVED_EXPERTS).is_some() {
            self.saved_experts = flag(lookup, ENV_SAVED_EXPERTS)?;
        }
        Ok(())
    }

    /// What the shim reports, and where.
    fn read_reports(&mut self, lookup: Lookup<'_>) -> Result<(), ConfigError> {
        self.stats_path = absolute_path(lookup, ENV_STATS)?;
        self.snapshot_dir = absolute_path(lookup, ENV_SNAPSHOTS)?;
        self.trace_path = absolute_path(lookup, ENV_TRACE)?;
        self.verbose = flag(lookup, ENV_VERBOSE)?;
        Ok(())
    }

    /// The run the process is part of: whether programs it executes keep the shim, and
    /// what the launcher set up for its processes (the share directory, the keeper).
    fn read_run(&mut self, lookup: Lookup<'_>) -> Result<(), ConfigError> {
        self.inherit = flag(lookup, ENV_INHERIT)?;
        self.share_dir = absolute_path(lookup, ENV_SHARE_DIR)?;
        if self.share_dir.is_some() {
            // Only file-shaped regions can be shared.
            self.serve_forks = true;
        }
        if let Some(value) = lookup(ENV_KEEPER) {
            let fd = value.trim().parse::<i32>().ok().filter(|&fd| fd > 2);
            self.keeper_fd = Some(fd.ok_or_else(|| {
                bad(
                    ENV_KEEPER,
                    &value,
                    "must be a descriptor number above 2".into(),
                )
            })?);
        }
        Ok(())
    }
}

fn bad(var: &'static str, value: &str, reason: String) -> ConfigError {
    ConfigError {
        var,
        value: value.to_string(),
        reason,
    }
}

/// `ENV_INSTALL_THREADS`'s value: a number of threads up to `MAX_INSTALL_THREADS`.
fn install_threads(value: &str) -> Result<usize, ConfigError> {
    value
        .trim()
        .parse::<usize>()
        .ok()
        .filter(|&n| n <= MAX_INSTALL_THREADS)
        .ok_or_else(|| {
            bad(
                ENV_INSTALL_THREADS,
                value,
                format!("give a number of threads from 0 to {MAX_INSTALL_THREADS}"),
            )
        })
}

/// `ENV_SERVE_FORKS`'s value, as `(serve_forks, serve_forks_at_fork)`.
fn serve_forks(lookup: Lookup<'_>) -> Result<(bool, bool), ConfigError> {
    match lookup(ENV_SERVE_FORKS).as_deref().map(str::trim) {
        None | Some("") | Some("fork") => Ok((false, true)),
        Some("1") => Ok((true, false)),
        Some("0") => Ok((false, false)),
        Some(other) => Err(bad(ENV_SERVE_FORKS, other, "must be 0, 1 or fork".into())),
    }
}

/// A path variable's value: unset or empty is none; a relative path is refused.
fn absolute_path(lookup: Lookup<'_>, var: &'static str) -> Result<Option<PathBuf>, ConfigError> {
    match lookup(var) {
        None => Ok(None),
        Some(value) if value.is_empty() => Ok(None),
        Some(value) if !value.starts_with('/') => Err(bad(
            var,
            &value,
            "must be an absolute path (the program may change directory)".into(),
        )),
        Some(value) => Ok(Some(PathBuf::from(value))),
    }
}

/// A `0`/`1` variable's value: unset or empty is `false`.
fn flag(lookup: Lookup<'_>, var: &'static str) -> Result<bool, ConfigError> {
    match lookup(var).as_deref().map(str::trim) {
        None | Some("") | Some("0") => Ok(false),
        Some("1") => Ok(true),
        Some(other) => Err(bad(var, other, "must be 0 or 1".into())),
    }
}
