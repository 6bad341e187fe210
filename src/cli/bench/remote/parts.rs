//! The remote bench's three parts, each a series of rounds of the two sides: time to the
//! first token cold (`ttft`), decode with a warm cache tier (`decode`), bytes fetched per
//! token (`fetch`); and what they share: the download, the cache tiers, one run through
//! a mount.

use std::fs::File;
use std::io::ErrorKind;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};

use super::super::budget_bytes;
use super::super::remote_figures::{
    fetch_floor, per_token, side_order, DecodeRow, FetchRow, RemoteSide, Spread, TtftRow,
};
use super::completion::completion;
use super::record::{describe, side_name, RunRecord};
use super::{MountChild, MountStats, Setup};
use crate::cli::device::drop_page_cache;
use crate::cli::mount::remote::Remote;
use hyperoffload::size::format_size;

/// Tokens of the fetch part's shorter run.
const FETCH_FIRST_TOKENS: u32 = 4;

/// An error once an interrupt came (checked before each run).
fn interrupted() -> anyhow::Result<()> {
    if crate::cli::compare::command::INTERRUPTED.load(std::sync::atomic::Ordering::Relaxed) {
        bail!("interrupted");
    }
    Ok(())
}

/// Downloads the object to the local copy; returns the seconds it took.
pub(super) fn download(
    setup: &Setup,
    client: &Remote,
    runtime: &tokio::runtime::Runtime,
) -> anyhow::Result<f64> {
    if let Some(dir) = setup.local.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let _ = std::fs::remove_file(&setup.local);
    let started = Instant::now();
    runtime
        .block_on(client.download(&setup.object, &setup.local))
        .with_context(|| format!("downloading {} from {}", setup.key, setup.source))?;
    Ok(started.elapsed().as_secs_f64())
}

/// A cache tier directory under --cache-dir, emptied.
fn empty_tier(setup: &Setup, name: &str) -> anyhow::Result<PathBuf> {
    let dir = setup.cache_dir.join(name);
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => {}
        Err(error) if error.kind() == ErrorKind::NotFound => {}
        Err(error) => return Err(error).with_context(|| format!("emptying {}", dir.display())),
    }
    Ok(dir)
}

/// Time to the first token at `share` percent of the model.
pub(super) fn ttft(
    setup: &Setup,
    client: &Remote,
    runtime: &tokio::runtime::Runtime,
    share: f64,
    records: &mut Vec<RunRecord>,
) -> anyhow::Result<TtftRow> {
    let budget = budget_bytes(setup.object.size, share);
    eprintln!(
        "bench: time to the first token, cold, budget {share}% ({})",
        format_size(budget)
    );
    let (mut mount_s, mut local_s, mut download_s, mut run_s, mut fetched) =
        (vec![], vec![], vec![], vec![], vec![]);
    for round in 1..=setup.args.runs {
        for side in side_order(round) {
            interrupted()?;
            drop_page_cache();
            let record = match side {
                RemoteSide::Mount => {
                    let tier = empty_tier(setup, "cache-cold")?;
                    let name = format!("ttft-{share}pct-{round}");
                    let mount = MountChild::start(setup, &tier, None, true, &name)?;
                    let (record, stats) = run_through(mount, "ttft", round, budget, 1, false)?;
                    mount_s.push(record.run_s);
                    fetched.push(stats.remote_bytes as f64);
                    record
                }
                RemoteSide::Local => {
                    let got = download(setup, client, runtime)?;
                    let run = completion(setup, &setup.local, 1, budget, false)?;
                    download_s.push(got);
                    run_s.push(run.wall_s);
                    local_s.push(got + run.wall_s);
                    RunRecord {
                        download_s: Some(got),
                        ..run.record("ttft", side, round, budget, 1)
                    }
                }
            };
            eprintln!(
                "bench:   {} round {round}: {}",
                side_name("ttft", side),
                describe(&record)
            );
            records.push(record);
        }
    }
    Ok(TtftRow {
        share,
        budget,
        mount_s: Spread::of(&mount_s),
        local_s: Spread::of(&local_s),
        download_s: Spread::of(&download_s),
        local_run_s: Spread::of(&run_s),
        mount_remote_bytes: Spread::of(&fetched),
    })
}

/// The warm cache tier of the decode part: the whole object read through a mount once.
pub(super) fn warm_cache_tier(setup: &Setup) -> anyhow::Result<()> {
    let tier = empty_tier(setup, "cache-warm")?;
    eprintln!("bench: filling the warm cache tier {}", tier.display());
    let mount = MountChild::start(setup, &tier, None, false, "decode-fill")?;
    let file = mount.file(setup.key);
    let copied = File::open(&file)
        .and_then(|mut f| std::io::copy(&mut f, &mut std::io::sink()))
        .with_context(|| format!("reading {} through the mount", file.display()));
    mount.stop()?;
    let copied = copied?;
    if copied != setup.object.size {
        bail!(
            "{}: read {copied} bytes through the mount, the object has {}",
            file.display(),
            setup.object.size
        );
    }
    Ok(())
}

/// Decode speed at `share` percent of the model: warm cache tier against the local copy.
pub(super) fn decode(
    setup: &Setup,
    share: f64,
    records: &mut Vec<RunRecord>,
) -> anyhow::Result<DecodeRow> {
    let budget = budget_bytes(setup.object.size, share);
    let tokens = setup.args.tokens;
    eprintln!(
        "bench: decode, warm cache tier, budget {share}% ({})",
        format_size(budget)
    );
    let tier = setup.cache_dir.join("cache-warm");
    let (mut mount_tps, mut local_tps, mut fetched) = (vec![], vec![], vec![]);
    for round in 1..=setup.args.runs {
        for side in side_order(round) {
            interrupted()?;
            let record = match side {
                RemoteSide::Mount => {
                    let name = format!("decode-{share}pct-{round}");
                    let mount = MountChild::start(setup, &tier, None, true, &name)?;
                    let (record, stats) =
                        run_through(mount, "decode", round, budget, tokens, true)?;
                    mount_tps.extend(record.eval_tps);
                    fetched.push(stats.remote_bytes as f64);
                    record
                }
                RemoteSide::Local => {
                    let run = completion(setup, &setup.local, tokens, budget, true)?;
                    local_tps.extend(run.eval_tps);
                    run.record("decode", side, round, budget, tokens)
                }
            };
            eprintln!(
                "bench:   {} round {round}: {}",
                side_name("decode", side),
                describe(&record)
            );
            records.push(record);
        }
    }
    Ok(DecodeRow {
        share,
        budget,
        mount_tps: Spread::of(&mount_tps),
        local_tps: Spread::of(&local_tps),
        mount_remote_bytes: Spread::of(&fetched),
    })
}

/// Bytes fetched per token with a cache tier of half the model, at the fetch budget;
/// one local run of each length beside, for the texts.
pub(super) fn fetch(setup: &Setup, records: &mut Vec<RunRecord>) -> anyhow::Result<FetchRow> {
    let remote = &setup.args.remote;
    let model = setup.object.size;
    let budget = budget_bytes(model, remote.fetch_budget);
    let cache = model / 2;
    let lengths = [FETCH_FIRST_TOKENS, FETCH_FIRST_TOKENS + remote.fetch_tokens];
    eprintln!(
        "bench: bytes fetched per token, cache tier {}, budget {}% ({})",
        format_size(cache),
        remote.fetch_budget,
        format_size(budget)
    );
    let mut per = Vec::new();
    for round in 1..=setup.args.runs {
        let mut fetched = Vec::new();
        for tokens in lengths {
            interrupted()?;
            let tier = empty_tier(setup, "cache-half")?;
            drop_page_cache();
            let name = format!("fetch-{round}-{tokens}-tokens");
            // The mount's defaults: the figure is the cache tier's and the pager's.
            let mount = MountChild::start(setup, &tier, Some(cache), false, &name)?;
            let (record, stats) = run_through(mount, "fetch", round, budget, tokens, true)?;
            fetched.push(stats.remote_bytes);
            eprintln!(
                "bench:   fetch round {round}, -n {tokens}: {}",
                describe(&record)
            );
            records.push(record);
        }
        let bytes = per_token(fetched[0], fetched[1], remote.fetch_tokens);
        eprintln!(
            "bench:   fetch round {round}: {} per token",
            format_size(bytes.max(0.0) as u64)
        );
        per.push(bytes);
    }
    // The local texts of both lengths, to check the mount's against.
    for tokens in lengths {
        interrupted()?;
        let run = completion(setup, &setup.local, tokens, budget, true)?;
        records.push(run.record("fetch", RemoteSide::Local, 1, budget, tokens));
    }
    Ok(FetchRow {
        share: remote.fetch_budget,
        budget,
        cache,
        tokens: (lengths[0], lengths[1]),
        per_token: Spread::of(&per),
        floor: fetch_floor(model, budget, cache),
    })
}

/// One run of `part` through `mount` (`tokens` tokens at `budget`), the mount stopped
/// after it whatever the run's outcome: its record, and the mount's stats.
fn run_through(
    mount: MountChild,
    part: &'static str,
    round: usize,
    budget: u64,
    tokens: u32,
    ignore_eos: bool,
) -> anyhow::Result<(RunRecord, MountStats)> {
    let setup = mount.setup;
    let run = completion(setup, &mount.file(setup.key), tokens, budget, ignore_eos);
    let up = mount.up_s;
    let (stats, stats_file) = mount.stop()?;
    let run = run?;
    let record = RunRecord {
        mount: Some(stats),
        mount_stats_file: Some(stats_file),
        mount_start_s: Some(up),
        ..run.record(part, RemoteSide::Mount, round, budget, tokens)
    };
    Ok((record, stats))
}
