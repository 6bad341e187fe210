//! The shim is loaded into every program `hyperoffload run` starts, so it must link the
//! pager alone: no argument parser, async runtime, object-store client or FUSE, which
//! are the command line's (docs/ARCHITECTURE.md "Layers").

use std::process::Command;

/// Crates only the command line may depend on.
const COMMAND_LINE_ONLY: &[&str] = &["clap", "tokio", "object_store", "fuser", "indicatif"];

/// The names of the crates `package` links (normal dependencies, all depths).
fn linked_crates(package: &str) -> Vec<String> {
    let output = Command::new(env!("CARGO"))
        .args(["tree", "--offline", "--edges", "normal", "--prefix", "none"])
        .args(["--format", "{lib}", "--package", package])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo tree");
    assert!(
        output.status.success(),
        "cargo tree -p {package} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout)
        .expect("cargo tree prints UTF-8")
        .lines()
        .map(|line| line.trim_end_matches(" (*)").trim().to_string())
        .filter(|name| !name.is_empty())
        .collect()
}

#[test]
fn the_shim_links_none_of_the_command_lines_crates() {
    let shim = linked_crates("hyperoffload-preload");
    assert!(
        shim.iter().any(|name| name == "hyperoffload"),
        "the shim links the pager library: {shim:?}"
    );
    for name in COMMAND_LINE_ONLY {
        assert!(
            !shim.iter().any(|linked| linked == name),
            "the shim links `{name}`: {shim:?}"
        );
    }
}

#[test]
fn the_command_line_links_what_the_check_above_looks_for() {
    // The names above are the ones cargo tree prints for the command line's crates: a
    // renamed or dropped crate would otherwise leave the shim's check passing vacuously.
    let command_line = linked_crates("hyperoffload");
    for name in COMMAND_LINE_ONLY {
        assert!(
            command_line.iter().any(|linked| linked == name),
            "the command line no longer links `{name}`: {command_line:?}"
        );
    }
}

/// The longest source file the workspace keeps (issue 44): past it a file holds more
/// than one job. Tests kept beside their module (`tests.rs`, `tests/`) are apart.
const MAX_SOURCE_LINES: usize = 600;

/// Every `.rs` file under `dir`, test files apart.
fn source_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|error| panic!("read {dir:?}: {error}")) {
        let path = entry.expect("read a directory entry").path();
        let name = path
            .file_name()
            .and_then(|name| name.to_str())
            .unwrap_or("");
        if path.is_dir() {
            if name != "tests" {
                source_files(&path, out);
            }
        } else if name.ends_with(".rs") && name != "tests.rs" {
            out.push(path);
        }
    }
}

/// Every source file of our crates (command line, pager, shim, benches), tests apart.
fn our_sources() -> Vec<std::path::PathBuf> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ["src", "pager/src", "preload/src", "benches"] {
        source_files(&root.join(dir), &mut files);
    }
    assert!(files.len() > 100, "found the sources: {}", files.len());
    files
}

#[test]
fn no_source_file_is_longer_than_the_limit() {
    let files = our_sources();
    let long: Vec<String> = files
        .iter()
        .filter_map(|path| {
            let lines = std::fs::read_to_string(path)
                .expect("read a source")
                .lines()
                .count();
            (lines > MAX_SOURCE_LINES).then(|| format!("{} ({lines} lines)", path.display()))
        })
        .collect();
    assert!(long.is_empty(), "over {MAX_SOURCE_LINES} lines: {long:?}");
}

/// The most lines a function may have (issue 44): past it a function does several
/// things, each of which deserves a name. Test code is apart (`function_lengths`).
const MAX_FUNCTION_LINES: usize = 80;

#[test]
fn no_function_is_longer_than_the_limit() {
    let files = our_sources();
    let mut measured = 0;
    let mut long = Vec::new();
    for path in &files {
        let source = std::fs::read_to_string(path).expect("read a source");
        let lengths = function_lengths::function_lengths(&source)
            .unwrap_or_else(|error| panic!("parse {}: {error}", path.display()));
        measured += lengths.len();
        long.extend(
            lengths
                .into_iter()
                .filter(|f| f.lines > MAX_FUNCTION_LINES)
                .map(|f| {
                    format!(
                        "{}:{} {} ({} lines)",
                        path.display(),
                        f.line,
                        f.name,
                        f.lines
                    )
                }),
        );
    }
    assert!(measured > 1000, "found the functions: {measured}");
    assert!(
        long.is_empty(),
        "over {MAX_FUNCTION_LINES} lines: {long:#?}"
    );
}

#[test]
fn none_of_our_crates_depends_on_nix_itself() {
    // The system calls go through rustix (pager/src/sys/); nix may come in only with
    // the userfaultfd and fuser crates.
    for package in ["hyperoffload", "hyperoffload-pager", "hyperoffload-preload"] {
        let output = Command::new(env!("CARGO"))
            .args([
                "tree",
                "--offline",
                "--edges",
                "normal,dev",
                "--prefix",
                "none",
            ])
            .args(["--depth", "1", "--format", "{lib}", "--package", package])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .expect("run cargo tree");
        assert!(output.status.success(), "cargo tree -p {package} failed");
        let direct = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            direct.lines().any(|line| line.trim() == "libc"),
            "{package}'s direct dependencies are listed: {direct}"
        );
        assert!(
            !direct
                .lines()
                .any(|line| line.trim_end_matches(" (*)").trim() == "nix"),
            "{package} depends on nix directly: {direct}"
        );
    }
}

#[path = "crate_layout/cycles.rs"]
mod cycles;
#[path = "crate_layout/function_lengths.rs"]
mod function_lengths;
#[path = "crate_layout/module_graph.rs"]
mod module_graph;
#[path = "crate_layout/source_text.rs"]
mod source_text;

/// The module cycles the pager's library has (issue 44: "no circle between files of one
/// folder; no module cycles"), each with why it stays. `[crate]` is a cycle of module
/// files in the whole graph; `[m::*]` one among `m`'s children, each standing for
/// everything below it. A new cycle fails the check below, and so does one of these
/// gone, which is then struck off here.
const KNOWN_CYCLES: &[(&str, &str)] = &[
    (
        "[crate] {model::synth, model::synth::arch, model::synth::fill, model::synth::hf_order, \
         model::synth::metadata, model::synth::mix, model::synth::plan, model::synth::plan::moe, \
         model::synth::plan::order, model::synth::plan::roles, model::synth::plan::shape, \
         model::synth::plan::sizing, model::synth::plan::small_model, model::synth::plan::tensors, \
         model::synth::quantize, model::synth::router}",
        "synth/mod.rs defines the SynthError its parts return and offers their types",
    ),
    (
        "[crate] {pager, pager::builder, pager::map_extent, pager::region, pager::uffd}",
        "pager/mod.rs's Pager is what builder makes and map_extent and region extend; \
         uffd's refusals are its PagerError",
    ),
    (
        "[crate] {policy, policy::fifo, policy::graph, policy::graph::eviction, \
         policy::graph::expert_blocks, policy::graph::prefetch, policy::lru, policy::per_block, \
         policy::readahead, policy::recording}",
        "policy/mod.rs defines the traits and BlockRef the policies implement, and offers them",
    ),
    (
        "[crate] {service, service::children, service::injection, service::install_pool, \
         service::page_tables, service::reads, service::reads::tag, service::staging}",
        "service/mod.rs's FaultService has its methods in its parts, and holds their state",
    ),
    (
        "[model::synth::*] {arch, hf_order, metadata, mix, plan}",
        "plan's LlamaShape, MoeSpec and Role are read by arch, metadata and mix, which plan asks",
    ),
    (
        "[model::synth::*] {fill, quantize, router}",
        "Fill::Context holds router's types and fill hands it to router, which makes Fills",
    ),
];

#[test]
fn the_pager_modules_cycles_are_the_known_ones() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let graph = module_graph::read_graph(&root.join("pager/src/lib.rs"));
    assert!(
        graph.edges.len() > 100,
        "found the modules: {}",
        graph.edges.len()
    );
    let found = cycles::cycles(&graph);
    let known: std::collections::BTreeSet<String> = KNOWN_CYCLES
        .iter()
        .map(|(cycle, _)| cycle.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    let new: Vec<String> = found
        .iter()
        .filter(|cycle| !known.contains(&cycle.to_string()))
        .map(|cycle| {
            let edges = cycles::references_within(&graph, cycle);
            format!("{cycle}\n    {}", edges.join("\n    "))
        })
        .collect();
    let gone: Vec<&String> = known
        .iter()
        .filter(|cycle| !found.iter().any(|found| found.to_string() == **cycle))
        .collect();
    assert!(
        new.is_empty() && gone.is_empty(),
        "new cycles:\n{}\nknown cycles gone (strike them off): {gone:#?}",
        new.join("\n")
    );
}
