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
