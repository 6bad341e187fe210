//! The references the pager is held to, measured in the same run: the device's limit
//! (cold O_DIRECT reads of the model), what of it reads shaped as the pager's keep
//! beside a warm decode, and the warm decode's speed without a memory limit.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::programs::llama_bench_command;
use super::{median, BenchArgs};
use crate::cli::compare::program_output::ProgramFigures;
use crate::cli::device::{drop_page_cache, read_rate, sequential_read_rate};

/// Measured once, before the budgets.
pub(super) struct References {
    /// The device's limit (median of three).
    pub device_bps: f64,
    /// Warm decode without a limit, tokens per second.
    pub warm_tps: f64,
    pub decode_share: DecodeShare,
}

impl References {
    pub fn measure(args: &BenchArgs) -> anyhow::Result<References> {
        let device_bps = median(&mut device_limit(args.model())?).expect("three measurements");
        eprintln!("bench: device limit {:.0} MB/s", device_bps / 1e6);
        let warm_tps = warm_tokens_per_s(args)?;
        eprintln!("bench: warm decode {warm_tps:.2} tok/s");
        let (mut alone, mut during) = device_during_decode(args)?;
        let decode_share = DecodeShare {
            alone_bps: median(&mut alone).expect("three measurements"),
            during_bps: median(&mut during).expect("three measurements"),
        };
        eprintln!(
            "bench: pager-shaped reads {:.0} MB/s alone, {:.0} MB/s beside a warm decode",
            decode_share.alone_bps / 1e6,
            decode_share.during_bps / 1e6
        );
        Ok(References {
            device_bps,
            warm_tps,
            decode_share,
        })
    }
}

/// The device's rate alone and beside a warm decode, for reads shaped as the pager's,
/// measured back to back (`device_during_decode`).
pub(super) struct DecodeShare {
    pub alone_bps: f64,
    pub during_bps: f64,
}

impl DecodeShare {
    /// What of the limit measured alone the device gives beside a decode.
    pub fn fraction(&self) -> f64 {
        self.during_bps / self.alone_bps
    }
}

/// Three cold measurements of the device's limit: io_uring O_DIRECT reads of the whole
/// model, 1 MiB each, 32 deep.
pub(super) fn device_limit(model: &Path) -> anyhow::Result<Vec<f64>> {
    let mut rates = Vec::new();
    for _ in 0..3 {
        if !drop_page_cache() {
            eprintln!("bench: cannot drop the page cache (not root?): figures are not cold");
        }
        rates.push(sequential_read_rate(model, 1 << 20, 32)?);
    }
    Ok(rates)
}

/// What of its rate the device keeps while the unchanged program decodes with the
/// model resident: reads shaped as the pager's while a spread set streams (2 MiB, two
/// deep, each landing in its own memory across 1 GiB), alone and then beside a warm
/// llama-bench tg, three measurements each, back to back. Reads and decode share the
/// memory's bandwidth, so where the pager's reads overlap the program's compute they
/// run below the device's limit measured alone (docs/design.md, "Measuring against the
/// device"). Returns (alone, during decode).
fn device_during_decode(args: &BenchArgs) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    let pager_shaped = || read_rate(args.model(), 2 << 20, 2, 1 << 30);
    let mut alone = Vec::new();
    for _ in 0..3 {
        alone.push(pager_shaped()?);
    }
    // Long enough to outlast loading and the measurements; killed once they are done.
    let command = llama_bench_command(args, 512);
    let mut decode = Command::new(&command[0])
        .args(&command[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting llama-bench")?;
    let measured = (|| {
        // Decoding once the program has had 3 s of CPU: loading a model from the page
        // cache takes a fraction of that, decode uses both threads.
        let started = Instant::now();
        while cpu_seconds(decode.id())? < 3.0 {
            if let Some(status) = decode.try_wait()? {
                bail!("llama-bench exited ({status}) before it started decoding");
            }
            if started.elapsed() > Duration::from_secs(120) {
                bail!("llama-bench did not start decoding within 120 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut during = Vec::new();
        for _ in 0..3 {
            during.push(pager_shaped()?);
        }
        if let Some(status) = decode.try_wait()? {
            bail!("llama-bench exited ({status}) while the device was measured beside it");
        }
        Ok(during)
    })();
    let _ = decode.kill();
    let _ = decode.wait();
    Ok((alone, measured?))
}

/// User and system CPU seconds process `pid` has used so far.
fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces), from field 3 on.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |field: usize| -> anyhow::Result<f64> {
        fields
            .get(field - 3)
            .and_then(|v| v.parse::<f64>().ok())
            .with_context(|| format!("no field {field} in /proc/{pid}/stat"))
    };
    // SAFETY: sysconf reads a configuration value and touches no memory of ours.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok((ticks(14)? + ticks(15)?) / per_second.max(1.0))
}

/// Tokens per second of llama-bench's tg test, warm and without a memory limit: the
/// compute-bound speed. The fastest of three runs after one that warms the page cache:
/// on a shared machine noise only slows a run, and the floor should not be lowered by
/// it.
fn warm_tokens_per_s(args: &BenchArgs) -> anyhow::Result<f64> {
    let command = llama_bench_command(args, args.tokens);
    let mut speeds = Vec::new();
    for _ in 0..4 {
        let output = Command::new(&command[0])
            .args(&command[1..])
            .output()
            .context("running llama-bench")?;
        if !output.status.success() {
            bail!(
                "llama-bench failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let figures = ProgramFigures::parse(
            &String::from_utf8_lossy(&output.stdout),
            &String::from_utf8_lossy(&output.stderr),
        );
        speeds.push(
            figures
                .bench_tokens_per_s("tg")
                .context("no tg figure from llama-bench")?,
        );
    }
    speeds.remove(0);
    Ok(speeds.into_iter().fold(0.0, f64::max))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_seconds_counts_this_process_and_names_a_missing_one() {
        let before = cpu_seconds(std::process::id()).unwrap();
        let started = Instant::now();
        let mut spin = 0u64;
        let mut after = before;
        // Until the count moves by 0.2 s of CPU, or 10 s of a count that stays put.
        while after - before < 0.2 && started.elapsed() < Duration::from_secs(10) {
            for _ in 0..1_000_000 {
                spin = std::hint::black_box(spin.wrapping_add(1));
            }
            after = cpu_seconds(std::process::id()).unwrap();
        }
        assert!(
            after - before >= 0.2,
            "{before} -> {after} after 10 s of spinning"
        );
        // Past the kernel's largest pid (4194304).
        let error = cpu_seconds(u32::MAX).unwrap_err().to_string();
        assert!(
            error.contains(&format!("/proc/{}/stat", u32::MAX)),
            "{error}"
        );
    }
}
