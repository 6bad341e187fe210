//! Python as a client: `mmap`, `numpy.memmap` and the `safetensors` package read a model
//! file through the shim and see the same bytes (checksums) as without it.
//! numpy and safetensors are installed by tools/setup.sh.

mod common;
mod shim_support;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::TempDir;
use shim_support::*;

/// Writes a safetensors file of about 12 MiB (several tensors of several dtypes) and a raw
/// file, from fixed seeds.
const MAKE: &str = r#"
import sys, numpy as np
from safetensors.numpy import save_file
rng = np.random.default_rng(7)
tensors = {
    "embed.weight": rng.standard_normal((2048, 512), dtype=np.float32),
    "layer.0.q": rng.standard_normal((512, 512)).astype(np.float16),
    "layer.0.ffn": rng.integers(0, 255, (1024, 3000), dtype=np.uint8),
    "norm": rng.standard_normal((512,), dtype=np.float32),
}
save_file(tensors, sys.argv[1])
rng.integers(0, 255, 9 * 2**20 + 777, dtype=np.uint8).tofile(sys.argv[2])
"#;

const READ_MMAP: &str = r#"
import sys, mmap, hashlib
with open(sys.argv[1], "rb") as f:
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
h = hashlib.sha256()
for start in range(0, len(m), 1 << 20):
    h.update(m[start:start + (1 << 20)])
print("mmap", h.hexdigest())
"#;

const READ_MEMMAP: &str = r#"
import sys, hashlib, numpy as np
a = np.memmap(sys.argv[1], dtype=np.uint8, mode="r")
print("memmap", hashlib.sha256(memoryview(a)).hexdigest(), int(a[::4096].sum()))
"#;

const READ_SAFETENSORS: &str = r#"
import sys, hashlib
from safetensors import safe_open
h = hashlib.sha256()
with safe_open(sys.argv[1], framework="np") as f:
    for name in sorted(f.keys()):
        t = f.get_tensor(name)
        h.update(name.encode()); h.update(str(t.dtype).encode()); h.update(t.tobytes())
print("safetensors", h.hexdigest())
"#;

/// The python3 with the clients: the virtual environment tools/setup.sh makes when
/// the system's Python refuses pip installs (PEP 668), else the one on PATH.
/// Whether python3 has numpy and safetensors; without them the test fails saying how
/// to get them, unless HYPEROFFLOAD_ALLOW_SKIP=1 (then false, after saying why).
fn python_clients_or_skip() -> bool {
    let check = python3()
        .args(["-c", "import numpy, safetensors"])
        .output()
        .expect("python3");
    if check.status.success() {
        return true;
    }
    let why = "python3 with numpy and safetensors is needed: run tools/setup.sh";
    if skip_allowed() {
        eprintln!("skipped: {why}");
        return false;
    }
    panic!("{why}");
}

fn run_plain(script: &str, args: &[&Path]) -> String {
    let output = Command::new(python())
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .unwrap();
    assert_success(&output, "python");
    stdout(&output)
}

fn run_shimmed(script: &str, file: &Path, stats: &Path) -> String {
    let output = launcher()
        .args([
            "--budget",
            "2M",
            "--min-size",
            "1M",
            "--match",
            "*.safetensors,*.bin",
        ])
        .arg("--stats")
        .arg(stats)
        .arg("--")
        .arg(python())
        .arg("-c")
        .arg(script)
        .arg(file)
        .output()
        .unwrap();
    assert_success(&output, "python under the shim");
    stdout(&output)
}

#[test]
fn python_clients_see_the_same_bytes_under_the_shim() {
    if !python_clients_or_skip() {
        return;
    }
    let dir = TempDir::new("shim-python");
    let tensors = dir.path("model.safetensors");
    let raw = dir.path("weights.bin");
    run_plain(MAKE, &[&tensors, &raw]);
    let cases: [(&str, &str, &Path); 3] = [
        ("mmap", READ_MMAP, &raw),
        ("memmap", READ_MEMMAP, &raw),
        ("safetensors", READ_SAFETENSORS, &tensors),
    ];
    for (name, script, file) in cases {
        let expected = run_plain(script, &[file]);
        let stats = dir.path(&format!("stats-{name}.json"));
        let seen = run_shimmed(script, file, &stats);
        assert_eq!(seen, expected, "{name}");
        let json = read_stats(&stats);
        let size = std::fs::metadata(file).unwrap().len();
        assert!(json["faults"].as_u64().unwrap() > 0, "{name}: {json}");
        assert!(
            json["bytes_read"].as_u64().unwrap() >= size - (2 << 20),
            "{name}: {json}"
        );
        assert!(
            json["peak_resident_bytes"].as_u64().unwrap() <= 2 << 20,
            "{json}"
        );
        eprintln!("{name}: same checksum; {json}");
    }
}

/// Three Hugging Face shards of a llama-named model (2 layers each).
const MAKE_SHARDS: &str = r#"
import sys, numpy as np
from safetensors.numpy import save_file
rng = np.random.default_rng(11)
for shard in range(3):
    tensors = {}
    for layer in range(2 * shard, 2 * shard + 2):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"):
            tensors[f"model.layers.{layer}.{name}.weight"] = rng.standard_normal((256, 512), dtype=np.float32)
    save_file(tensors, f"{sys.argv[1]}/model-{shard + 1:05d}-of-00003.safetensors")
"#;

/// Every tensor of every shard, in shard order: a checksum.
const READ_SHARDS: &str = r#"
import sys, hashlib
from safetensors import safe_open
h = hashlib.sha256()
for shard in range(3):
    with safe_open(f"{sys.argv[1]}/model-{shard + 1:05d}-of-00003.safetensors", framework="np") as f:
        for name in sorted(f.keys()):
            h.update(name.encode()); h.update(f.get_tensor(name).tobytes())
print("shards", h.hexdigest())
"#;

/// A model in Hugging Face safetensors shards is one model to the shim: a percentage
/// budget is of all the shards, one predicted order runs through them (before: half of
/// the first shard, and a graph of its tensors only).
#[test]
fn safetensors_shards_are_one_model_under_the_shim() {
    if !python_clients_or_skip() {
        return;
    }
    let dir = TempDir::new("shim-python-shards");
    run_plain(MAKE_SHARDS, &[&dir.0]);
    let expected = run_plain(READ_SHARDS, &[&dir.0]);
    let stats = dir.path("stats.json");
    let output = launcher()
        .args(["--budget", "50%", "--min-size", "1M", "--stats"])
        .arg(&stats)
        .arg("--")
        .arg(python())
        .arg("-c")
        .arg(READ_SHARDS)
        .arg(&dir.0)
        .output()
        .unwrap();
    assert_success(&output, "python under the shim");
    assert_eq!(stdout(&output), expected);
    let json = read_stats(&stats);
    let total: u64 = (1..=3)
        .map(|n| {
            let shard = dir.path(&format!("model-{n:05}-of-00003.safetensors"));
            std::fs::metadata(shard).unwrap().len()
        })
        .sum();
    assert_eq!(json["budget_bytes"].as_u64(), Some(total / 2), "{json}");
    assert_eq!(json["files"].as_array().map(Vec::len), Some(3), "{json}");
    let policy = json["config"]["policy_in_use"].as_str().unwrap();
    assert!(policy.contains("3 split files"), "{policy}");
    assert!(
        json["peak_resident_bytes"].as_u64().unwrap() <= total / 2,
        "{json}"
    );
}

/// Reads the file given in a fixed shuffled order of 1 MiB chunks (the order a seed
/// gives), 4 passes, and prints a checksum of what it read.
const READ_SHUFFLED: &str = r#"
import sys, mmap, random, hashlib
with open(sys.argv[1], "rb") as f:
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
chunks = list(range(len(m) >> 20))
random.Random(int(sys.argv[2])).shuffle(chunks)
h = hashlib.sha256()
for _ in range(4):
    for c in chunks:
        h.update(m[c << 20:(c + 1) << 20])
print("shuffled", h.hexdigest())
"#;

/// A 256 MiB file of no known format, for `READ_SHUFFLED`.
struct ShuffledFile {
    dir: TempDir,
    file: PathBuf,
    len: u64,
}

/// What one run of `READ_SHUFFLED` under the shim did.
struct ShuffledRun {
    bytes_read: u64,
    stderr: String,
    policy_in_use: String,
    stats: serde_json::Value,
}

impl ShuffledFile {
    fn new(name: &str) -> Self {
        let dir = TempDir::new(name);
        let file = dir.path("data.bin");
        let len: u64 = 256 << 20;
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let bytes: Vec<u8> = (0..len)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (state >> 56) as u8
            })
            .collect();
        std::fs::write(&file, &bytes).unwrap();
        Self { dir, file, len }
    }

    /// Reads the file in the order of `seed` under `--budget 96M --policy graph`, and
    /// checks it read the file's bytes.
    fn run(&self, seed: u32, stats_name: &str) -> ShuffledRun {
        let seed = seed.to_string();
        let expected = run_plain(READ_SHUFFLED, &[&self.file, Path::new(&seed)]);
        let stats = self.dir.path(stats_name);
        let output = launcher()
            .args(["--budget", "96M", "--match", "*.bin", "--policy", "graph"])
            .arg("--stats")
            .arg(&stats)
            .arg("--")
            .arg(python())
            .arg("-c")
            .arg(READ_SHUFFLED)
            .arg(&self.file)
            .arg(&seed)
            .output()
            .unwrap();
        assert_success(&output, "python under the shim");
        assert_eq!(stdout(&output), expected, "different bytes under the shim");
        let stats = read_stats(&stats);
        ShuffledRun {
            bytes_read: stats["bytes_read"].as_u64().unwrap(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
            policy_in_use: stats["config"]["policy_in_use"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            stats,
        }
    }

    /// Bytes LRU and Belady's policy read on the order of `seed` (2 MiB blocks, 96 MiB),
    /// simulated.
    fn lru_and_belady(&self, seed: u32) -> (u64, u64) {
        let order = Command::new(python())
            .args([
                "-c",
                "import random, sys; c = list(range(256)); \
                 random.Random(int(sys.argv[1])).shuffle(c); print(*c)",
            ])
            .arg(seed.to_string())
            .output()
            .unwrap();
        let blocks: Vec<u32> = stdout(&order)
            .split_whitespace()
            .map(|c| c.parse::<u32>().unwrap() / 2)
            .collect();
        let trace = self.dir.path(&format!("order-{seed}.csv"));
        replay_lru_and_belady(&trace, &blocks.repeat(4), self.len)
    }
}

/// A learned graph on an order no tensor table predicts: a 256 MiB file of no known
/// format read in a fixed shuffled order of 1 MiB chunks, 4 passes, under a
/// budget of 96M. The first run records the access order (every access: resident
/// blocks are watched, so the recording is not only the misses of demand paging); the
/// next run follows the graph learned from it and reads at most 0.8x what the recording
/// run read, and no more than LRU on the same order (simulated). Same bytes throughout.
#[test]
fn a_graph_learned_from_a_recording_run_beats_demand_paging() {
    let file = ShuffledFile::new("shim-python-learned");
    let recording = file.run(7, "record.json");
    assert!(
        recording.policy_in_use.contains("recording"),
        "{}",
        recording.policy_in_use
    );
    assert!(file.dir.path("data.bin.hyperoffload-graph").is_file());
    let following = file.run(7, "follow.json");
    assert!(
        following.policy_in_use.contains("learned graph"),
        "{}",
        following.policy_in_use
    );
    let (recorded, followed) = (recording.bytes_read, following.bytes_read);
    let (lru, belady) = file.lru_and_belady(7);
    eprintln!(
        "shuffled chunks: recording run read {recorded}, the learned graph {followed}; \
         on the order LRU {lru}, Belady {belady}; prediction {}",
        following.stats["prediction"]
    );
    assert!(
        followed as f64 <= recorded as f64 * 0.8,
        "the learned graph read {followed}, demand paging {recorded}"
    );
    assert!(
        followed <= lru,
        "the learned graph read {followed}, LRU {lru}"
    );
    // The program follows the order it was learned on: prefetch stops nowhere.
    let prediction = &following.stats["prediction"];
    assert_eq!(prediction["failing_parts"], 0, "{prediction}");
    assert!(
        prediction["expected_faults"].as_u64().unwrap()
            > 10 * prediction["surprise_faults"].as_u64().unwrap(),
        "{prediction}"
    );
}

/// Adaptive safety: the program reads the file in another order than the one the graph
/// was learned on (another seed). Following the learned order, prefetch would read
/// blocks that are evicted unused (9.3 GiB against LRU's 1.7 measured without the
/// check); the graph policy finds the program does not land where its plans say and
/// reads nothing ahead there, so it reads no more than LRU on the new order, and forgets
/// the order learned: the next run records the new one.
#[test]
fn a_learned_order_the_program_no_longer_follows_reads_no_more_than_lru() {
    let file = ShuffledFile::new("shim-python-unfollowed");
    file.run(7, "record.json");
    let (lru, belady) = file.lru_and_belady(8);
    file.lru_and_belady(7);
    let other = file.run(8, "other.json");
    assert!(
        other.policy_in_use.contains("learned graph"),
        "{}",
        other.policy_in_use
    );
    let prediction = &other.stats["prediction"];
    eprintln!(
        "another order: the learned graph read {}; LRU {lru}, Belady {belady}; \
         prediction {prediction}",
        other.bytes_read
    );
    assert!(
        other.bytes_read <= lru,
        "the learned graph read {} on an order it was not learned on, LRU {lru}",
        other.bytes_read
    );
    assert!(
        prediction["failing_parts"].as_u64().unwrap() >= prediction["parts"].as_u64().unwrap() / 2,
        "{prediction}"
    );
    assert!(
        prediction["surprise_faults"].as_u64().unwrap()
            > prediction["expected_faults"].as_u64().unwrap(),
        "{prediction}"
    );
    // The order learned is forgotten, and the next run records the new one.
    assert!(
        other.stderr.contains("did not follow the order learned"),
        "{}",
        other.stderr
    );
    assert!(!file.dir.path("data.bin.hyperoffload-graph").exists());
    let again = file.run(8, "again.json");
    assert!(
        again.policy_in_use.contains("recording"),
        "{}",
        again.policy_in_use
    );
    assert!(file.dir.path("data.bin.hyperoffload-graph").is_file());
    // The simulator, learning from the order recorded and replaying the other, predicts
    // the real pager's bytes within 10 %.
    let output = Command::new(env!("CARGO_BIN_EXE_hyperoffload"))
        .args(["simulate", "--budget", "96M", "--policy", "graph", "--json"])
        .arg("--trace")
        .arg(file.dir.path("order-8.csv"))
        .arg("--learn-from")
        .arg(file.dir.path("order-7.csv"))
        .output()
        .unwrap();
    assert_success(&output, "simulate --learn-from");
    let json: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
    let simulated = json["report"]["bytes_read"].as_u64().unwrap();
    eprintln!("simulated {simulated}, real {}", other.bytes_read);
    let error = (simulated as f64 - other.bytes_read as f64).abs() / other.bytes_read as f64;
    assert!(
        error <= 0.10,
        "simulated {simulated}, the pager read {}",
        other.bytes_read
    );
}

/// Bytes `hyperoffload simulate` reads replaying `blocks` (2 MiB blocks of a file of
/// `len` bytes) under 96 MiB with LRU, and with Belady's policy (the floor it reports
/// beside every policy). The order is written as the fault trace the pager records.
fn replay_lru_and_belady(trace: &Path, blocks: &[u32], len: u64) -> (u64, u64) {
    use hyperoffload::policy::FaultOutcome;
    use hyperoffload::trace::{TraceRecord, TraceWriter};
    let block_size: u64 = 2 << 20;
    let file = std::fs::File::create(trace).unwrap();
    let mut writer = TraceWriter::new(
        std::io::BufWriter::new(file),
        &[
            ("size", len.to_string()),
            ("block_size", block_size.to_string()),
        ],
    )
    .unwrap();
    for (at, &block) in blocks.iter().enumerate() {
        writer
            .write(&TraceRecord {
                t_ns: at as u64,
                tid: 1,
                region: 0,
                file_offset: block as u64 * block_size,
                block,
                block_size,
                outcome: FaultOutcome::Missing,
                latency_ns: 0,
                offset_in_block: Some(0),
            })
            .unwrap();
    }
    writer.into_inner().unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_hyperoffload"))
        .args([
            "simulate",
            "--budget",
            "96M",
            "--policy",
            "lru",
            "--prefetch",
            "none",
            "--json",
            "--trace",
        ])
        .arg(trace)
        .output()
        .unwrap();
    assert_success(&output, "simulate");
    let json: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
    (
        json["report"]["bytes_read"].as_u64().unwrap(),
        json["belady_bytes_read"].as_u64().unwrap(),
    )
}
