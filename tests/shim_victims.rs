//! Victim programs (tests/victims/victim.c) run with and without the shim: what must be
//! served by the pager is, with the same bytes; everything else passes through untouched.

mod common;
mod shim_support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::*;
use shim_support::*;

const VICTIM_SOURCE: &str = include_str!("victims/victim.c");

struct Setup {
    dir: TempDir,
    victim: PathBuf,
}

fn setup(name: &str) -> Setup {
    let dir = TempDir::new(name);
    let victim = compile_c(&dir.0, "victim", VICTIM_SOURCE);
    Setup { dir, victim }
}

fn plain(victim: &Path, args: &[&str]) -> Output {
    Command::new(victim).args(args).output().unwrap()
}

/// The launcher's options for the victim runs: a 2M budget, 1M minimum size.
const RUN_OPTIONS: [&str; 7] = [
    "--budget",
    "2M",
    "--min-size",
    "1M",
    "--match",
    "*.gguf",
    "--stats",
];

/// `command` (a `hyperoffload run`) given `RUN_OPTIONS`, the stats path and the victim.
fn with_victim<'c>(
    command: &'c mut Command,
    setup: &Setup,
    stats: &Path,
    args: &[&str],
) -> &'c mut Command {
    command
        .args(RUN_OPTIONS)
        .arg(stats)
        .arg("--")
        .arg(&setup.victim)
        .args(args)
}

/// Runs the victim under `hyperoffload run` with `RUN_OPTIONS`.
fn shimmed(setup: &Setup, stats: &Path, args: &[&str]) -> Output {
    with_victim(&mut launcher(), setup, stats, args)
        .output()
        .unwrap()
}

/// As `shimmed`, for a run whose failure is a hang: killed after 60 s by `timeout`, from
/// outside the launcher (it kills its process group, the victim included).
fn shimmed_bounded(setup: &Setup, stats: &Path, args: &[&str]) -> Output {
    let mut command = Command::new("timeout");
    command
        .arg("60")
        .arg(LAUNCHER)
        .env("HYPEROFFLOAD_SHIM", shim())
        .arg("run");
    with_victim(&mut command, setup, stats, args)
        .output()
        .unwrap()
}

fn lines_with<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
    text.lines()
        .filter(|line| line.starts_with(prefix))
        .collect()
}

#[test]
fn read_only_model_mapping_is_served_with_the_same_bytes_and_partial_munmap_works() {
    let setup = setup("shim-read");
    let model = setup.dir.path("m.gguf");
    pattern_file(&model, (8 << 20) + 1234);
    let model = model.to_str().unwrap();
    let stats = setup.dir.path("stats.json");
    let expected = plain(&setup.victim, &["read", model]);
    assert_success(&expected, "plain run");
    assert!(stdout(&expected).contains("kind file"));
    let output = shimmed(&setup, &stats, &["read", model]);
    assert_success(&output, "shimmed run");
    let seen = stdout(&output);
    assert!(seen.contains("kind anon"), "not taken over:\n{seen}");
    for what in ["sum ", "sum again", "rest ", "after dontneed", "reuse ok"] {
        assert_eq!(
            lines_with(&seen, what),
            lines_with(&stdout(&expected), what),
            "{what}"
        );
    }
    let json = read_stats(&stats);
    assert!(json["faults"].as_u64().unwrap() > 0, "{json}");
    assert!(json["bytes_read"].as_u64().unwrap() >= 8 << 20, "{json}");
    assert!(
        json["peak_resident_bytes"].as_u64().unwrap() <= 2 << 20,
        "{json}"
    );
    assert_eq!(
        json["managed_mappings"], 0,
        "both munmaps released it: {json}"
    );
    assert_eq!(json["files"][0]["size"], (8 << 20) + 1234);
    assert!(
        stderr(&output).contains("hyperoffload: read "),
        "{}",
        stderr(&output)
    );
}

#[test]
fn writable_anonymous_non_matching_and_small_mappings_pass_through() {
    let setup = setup("shim-pass");
    let model = setup.dir.path("m.gguf");
    pattern_file(&model, 8 << 20);
    let other = setup.dir.path("m.bin");
    pattern_file(&other, 8 << 20);
    let small = setup.dir.path("small.gguf");
    pattern_file(&small, 512 << 10);
    let cases: [(&str, &Path); 5] = [
        ("private-writable", &model),
        ("shared-writable", &model),
        ("anonymous", &model),
        ("read", &other),
        ("read", &small),
    ];
    for (index, (mode, file)) in cases.into_iter().enumerate() {
        // Each run gets a fresh copy: shared-writable changes the file.
        let copy = setup.dir.path(&format!(
            "{index}-{}",
            file.file_name().unwrap().to_str().unwrap()
        ));
        std::fs::copy(file, &copy).unwrap();
        let path = copy.to_str().unwrap();
        let expected = plain(&setup.victim, &[mode, path]);
        std::fs::copy(file, &copy).unwrap();
        let stats = setup.dir.path(&format!("stats-{index}.json"));
        let output = shimmed(&setup, &stats, &[mode, path]);
        assert_success(&output, mode);
        assert_eq!(stdout(&output), stdout(&expected), "{mode} {path}");
        assert!(
            !stdout(&output).contains("kind anon") || mode == "anonymous",
            "{mode} {path} was taken over"
        );
        // Nothing managed: no pager, no stats.
        assert!(!stats.exists(), "{mode} {path}: a pager was started");
        assert!(
            stderr(&output).contains("nothing was served"),
            "{}",
            stderr(&output)
        );
    }
}

#[test]
fn a_forked_child_reads_the_files_bytes_never_zeros() {
    let setup = setup("shim-fork");
    let model = setup.dir.path("m.gguf");
    pattern_file(&model, 8 << 20);
    let model = model.to_str().unwrap();
    let expected = stdout(&plain(&setup.victim, &["fork", model]));
    let output = shimmed(&setup, &setup.dir.path("stats.json"), &["fork", model]);
    assert_success(&output, "fork");
    let seen = stdout(&output);
    let parent_byte = lines_with(&expected, "parent byte")[0].replace("parent byte ", "");
    assert_eq!(
        lines_with(&seen, "parent byte"),
        lines_with(&expected, "parent byte")
    );
    assert_eq!(lines_with(&seen, "sum"), lines_with(&expected, "sum"));
    assert_eq!(
        lines_with(&seen, "parent after"),
        lines_with(&expected, "parent after")
    );
    // The child reads the file's byte through a kernel mapping of the file put where
    // the region was (the region itself is MADV_DONTFORK), and exits normally.
    assert_eq!(
        lines_with(&seen, "child byte"),
        vec![format!("child byte {parent_byte}")],
        "{seen}"
    );
    assert_eq!(
        lines_with(&seen, "child exit"),
        vec!["child exit 0"],
        "{seen}"
    );
}

/// A forked child's kernel mappings follow the parent's live ranges: a mapping at a file
/// offset whose head was unmapped, and a second mapping of the file, both read right.
#[test]
fn a_forked_child_sees_every_live_range_at_its_file_offset() {
    let setup = setup("shim-fork-partial");
    let model = setup.dir.path("m.gguf");
    pattern_file(&model, (8 << 20) + 4321);
    let model = model.to_str().unwrap();
    let expected = stdout(&plain(&setup.victim, &["fork-partial", model]));
    let stats = setup.dir.path("stats.json");
    let output = shimmed(&setup, &stats, &["fork-partial", model]);
    assert_success(&output, "fork-partial");
    let seen = stdout(&output);
    assert_eq!(lines_with(&seen, "kind"), vec!["kind anon"], "{seen}");
    let sums = lines_with(&expected, "parent sums")[0].replace("parent sums ", "");
    assert_eq!(
        lines_with(&seen, "child sums"),
        vec![format!("child sums {sums}")],
        "{seen}"
    );
    assert_eq!(
        lines_with(&seen, "child exit"),
        vec!["child exit 0"],
        "{seen}"
    );
    assert_eq!(
        lines_with(&seen, "parent sums"),
        lines_with(&expected, "parent sums")
    );
    assert!(read_stats(&stats)["bytes_read"].as_u64().unwrap() > 0);
}

#[test]
fn mlock_pins_within_the_budget_and_mremap_is_refused() {
    let setup = setup("shim-lock");
    let model = setup.dir.path("m.gguf");
    pattern_file(&model, 8 << 20);
    let model = model.to_str().unwrap();
    let expected = stdout(&plain(&setup.victim, &["lock", model]));
    let output = shimmed(&setup, &setup.dir.path("stats.json"), &["lock", model]);
    assert_success(&output, "lock");
    let seen = stdout(&output);
    assert!(seen.contains("mlock small 0"), "{seen}");
    assert!(seen.contains("mlock all -1 errno ENOMEM"), "{seen}");
    assert!(stderr(&output).contains("mlock of a model mapping refused"));
    // Pinned by the shim, not locked by the kernel (which broke eviction).
    assert!(seen.contains("mlock unaligned 0"), "{seen}");
    let json = read_stats(&setup.dir.path("stats.json"));
    assert!(json["pinned_bytes"].as_u64().unwrap() >= 65536, "{json}");
    assert_eq!(lines_with(&seen, "sum"), lines_with(&expected, "sum"));

    let expected = stdout(&plain(&setup.victim, &["remap", model]));
    let output = shimmed(&setup, &setup.dir.path("stats2.json"), &["remap", model]);
    assert_success(&output, "remap");
    let seen = stdout(&output);
    assert!(seen.contains("mremap failed EINVAL"), "{seen}");
    assert!(stderr(&output).contains("mremap of a model mapping is not supported"));
    assert_eq!(lines_with(&seen, "sum"), lines_with(&expected, "sum"));
}

/// Advice that drops pages is the pager's to carry out: given to the kernel it dropped
/// pages the pager counted resident. Advice the shim does not know is refused, as the
/// kernel refuses advice it does not know.
#[test]
fn advice_that_drops_pages_is_carried_out_and_unknown_advice_refused() {
    let setup = setup("shim-advice");
    let model = setup.dir.path("m.gguf");
    pattern_file(&model, 8 << 20);
    let model = model.to_str().unwrap();
    let expected = stdout(&plain(&setup.victim, &["advice", model]));
    let stats = setup.dir.path("stats.json");
    let output = shimmed(&setup, &stats, &["advice", model]);
    assert_success(&output, "advice");
    let seen = stdout(&output);
    assert!(seen.contains("dontneed_locked 0"), "{seen}");
    assert!(seen.contains("unknown advice -1 errno EINVAL"), "{seen}");
    assert!(stderr(&output).contains("madvise advice 64 on a model mapping is not supported"));
    assert_eq!(lines_with(&seen, "sum"), lines_with(&expected, "sum"));
    let json = read_stats(&stats);
    assert!(json["dropped_blocks"].as_u64().unwrap() > 0, "{json}");
}

#[test]
fn bad_configuration_leaves_the_program_running_unpaged() {
    let setup = setup("shim-badconfig");
    let model = setup.dir.path("m.gguf");
    pattern_file(&model, 8 << 20);
    let model = model.to_str().unwrap();
    let expected = stdout(&plain(&setup.victim, &["read", model]));
    for (var, value) in [
        ("HYPEROFFLOAD_BUDGET", "lots"),
        ("HYPEROFFLOAD_POLICY", "belady"),
        ("HYPEROFFLOAD_MIN_SIZE", "-1"),
        ("HYPEROFFLOAD_STATS", "relative.json"),
    ] {
        let output = Command::new(&setup.victim)
            .args(["read", model])
            .env("LD_PRELOAD", shim())
            .env("HYPEROFFLOAD_MIN_SIZE", "1M")
            .env(var, value)
            .output()
            .unwrap();
        assert_success(&output, var);
        assert_eq!(stdout(&output), expected, "{var}={value}");
        let messages = stderr(&output);
        assert_eq!(
            messages.matches("hyperoffload:").count(),
            1,
            "one message expected:\n{messages}"
        );
        assert!(messages.contains(var), "{messages}");
        assert!(messages.contains("the shim is disabled"), "{messages}");
    }
}

/// A program the launched process executes in its own pid (a wrapper's exec) keeps the
/// shim; a child process has it only with `--inherit`.
#[test]
fn children_inherit_the_shim_only_when_asked() {
    let setup = setup("shim-inherit");
    for (flag, expected) in [
        (None, "child has shim 0"),
        (Some("--inherit"), "child has shim 1"),
    ] {
        let run = |mode: &str| {
            let mut command = launcher();
            command.args(["-q"]);
            command.args(flag);
            let output = command
                .arg("--")
                .arg(&setup.victim)
                .arg(mode)
                .output()
                .unwrap();
            assert_success(&output, mode);
            stdout(&output)
        };
        let exec = run("exec-child");
        assert!(
            exec.contains("own LD_PRELOAD has shim 1"),
            "{flag:?}: {exec}"
        );
        assert!(exec.contains("child has shim 1"), "{flag:?}: {exec}");
        let spawned = run("spawn-child");
        assert!(spawned.contains(expected), "{flag:?}: {spawned}");
    }
}

#[test]
fn launcher_refuses_what_the_shim_cannot_reach_and_passes_exit_status() {
    let dir = TempDir::new("shim-launcher");
    let output = launcher()
        .args(["--", "/sbin/ldconfig", "-p"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("statically linked"),
        "{}",
        stderr(&output)
    );

    let setuid = dir.path("setuid-true");
    std::fs::copy("/bin/true", &setuid).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&setuid, std::fs::Permissions::from_mode(0o4755)).unwrap();
    let output = launcher().arg("--").arg(&setuid).output().unwrap();
    assert!(!output.status.success());
    assert!(stderr(&output).contains("setuid"), "{}", stderr(&output));

    let output = launcher()
        .args(["-q", "--", "sh", "-c", "exit 42"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(42));
    let output = launcher()
        .args(["-q", "--", "sh", "-c", "kill -USR1 $$"])
        .output()
        .unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(output.status.signal(), Some(libc::SIGUSR1));

    let taken = dir.path("exists.json");
    std::fs::write(&taken, "keep").unwrap();
    let output = launcher()
        .arg("--stats")
        .arg(&taken)
        .args(["--", "true"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(stderr(&output).contains("refusing to overwrite"));
    assert_eq!(std::fs::read_to_string(&taken).unwrap(), "keep");
}

#[test]
fn threads_started_during_load_and_an_exit_with_reads_in_flight_end_cleanly() {
    let setup = setup("shim-threads-exit");
    let model = setup.dir.path("m.gguf");
    pattern_file(&model, 16 << 20);
    let model = model.to_str().unwrap();
    let stats = setup.dir.path("stats.json");
    let expected = plain(&setup.victim, &["threads-exit", model]);
    assert_success(&expected, "plain run");
    // A hang is the failure this test exists for: bound it from outside the launcher.
    let started = std::time::Instant::now();
    let output = shimmed_bounded(&setup, &stats, &["threads-exit", model]);
    assert_success(&output, "shimmed run");
    assert!(started.elapsed() < std::time::Duration::from_secs(30));
    let seen = stdout(&output);
    assert!(seen.contains("kind anon"), "not taken over:\n{seen}");
    assert!(seen.contains("exiting with reads in flight"), "{seen}");
    assert_eq!(
        lines_with(&seen, "first"),
        lines_with(&stdout(&expected), "first")
    );
    let json = read_stats(&stats);
    assert!(json["faults"].as_u64().unwrap() > 0, "{json}");
    assert!(
        json["peak_resident_bytes"].as_u64().unwrap() <= 2 << 20,
        "{json}"
    );
}

#[test]
fn stats_files_are_private_never_clobbered_and_never_written_through_a_symlink() {
    use std::os::unix::fs::PermissionsExt;
    let setup = setup("shim-stats-files");
    let model = setup.dir.path("m.gguf");
    pattern_file(&model, 4 << 20);
    let model = model.to_str().unwrap();
    let stats = setup.dir.path("stats.json");
    let output = shimmed(&setup, &stats, &["read", model]);
    assert_success(&output, "shimmed run");
    let mode = std::fs::metadata(&stats).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "stats file mode {mode:o}");
    // An existing file is not overwritten.
    let existing = setup.dir.path("existing.json");
    std::fs::write(&existing, "keep me").unwrap();
    let output = shimmed(&setup, &existing, &["read", model]);
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("refusing to overwrite"),
        "{}",
        stderr(&output)
    );
    assert_eq!(std::fs::read_to_string(&existing).unwrap(), "keep me");
    // A symlink is not followed: its target is never created.
    let target = setup.dir.path("target.json");
    let link = setup.dir.path("link.json");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let output = shimmed(&setup, &link, &["read", model]);
    assert!(!output.status.success());
    assert!(!target.exists(), "the stats went through a symlink");
}

#[test]
fn without_userfaultfd_the_program_runs_on_kernel_mmap_with_one_message() {
    use std::os::unix::fs::PermissionsExt;
    let build = setup("shim-no-uffd");
    // The unprivileged user must reach the victim and the model: a world-readable
    // directory under /tmp (the target directory's parents may be private).
    let dir = std::env::temp_dir().join(format!("hyperoffload-no-uffd-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let victim = dir.join("victim");
    std::fs::copy(&build.victim, &victim).unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o755)).unwrap();
    let model = dir.join("m.gguf");
    pattern_file(&model, 4 << 20);
    std::fs::set_permissions(&model, std::fs::Permissions::from_mode(0o644)).unwrap();
    let setup = Setup {
        dir: TempDir(dir),
        victim,
    };
    let model = model.to_str().unwrap();
    let expected = plain(&setup.victim, &["read", model]);
    assert_success(&expected, "plain run");
    // nobody may not create a kernel-mode userfaultfd here (root-only /dev/userfaultfd,
    // vm.unprivileged_userfaultfd=0); setpriv is an exec wrapper, hence --inherit.
    let output = launcher()
        .args([
            "--inherit",
            "--budget",
            "2M",
            "--min-size",
            "1M",
            "--match",
            "*.gguf",
            "--",
        ])
        .args([
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
        ])
        .arg(&setup.victim)
        .args(["read", model])
        .output()
        .unwrap();
    assert_success(&output, "victim as nobody under the shim");
    let seen = stdout(&output);
    assert!(seen.contains("kind file"), "left to the kernel:\n{seen}");
    for what in ["sum ", "sum again", "rest "] {
        assert_eq!(
            lines_with(&seen, what),
            lines_with(&stdout(&expected), what),
            "{what}"
        );
    }
    let messages = stderr(&output);
    assert_eq!(
        messages.matches("cannot start the pager").count(),
        1,
        "one message:\n{messages}"
    );
    assert!(messages.contains("userfaultfd"), "{messages}");
}

#[test]
fn a_file_of_no_known_format_has_its_access_order_learned_and_reused() {
    let setup = setup("shim-learn");
    // 8 MiB: 128 chunks of 64 KiB, coprime with the victim's stride of 37.
    let model = setup.dir.path("m.bin");
    pattern_file(&model, 8 << 20);
    let model_arg = model.to_str().unwrap();
    let expected = plain(&setup.victim, &["permuted", model_arg, "4"]);
    assert_success(&expected, "plain run");
    let run = |stats: &Path| {
        let output = launcher()
            .args([
                "--budget",
                "4M",
                "--min-size",
                "1M",
                "--match",
                "*.bin",
                "--stats",
            ])
            .arg(stats)
            .arg("--")
            .arg(&setup.victim)
            .args(["permuted", model_arg, "4"])
            .output()
            .unwrap();
        assert_success(&output, "shimmed run");
        assert_eq!(
            lines_with(&stdout(&output), "permuted"),
            lines_with(&stdout(&expected), "permuted")
        );
        (read_stats(stats), stderr(&output))
    };
    let (first, messages) = run(&setup.dir.path("first.json"));
    let policy = first["config"]["policy_in_use"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(policy.contains("recording"), "{policy}");
    assert!(messages.contains("learned the access order"), "{messages}");
    let graph = setup.dir.path("m.bin.hyperoffload-graph");
    assert!(graph.exists(), "no learned graph beside the file");
    // Runs 2-4 use the graph, and each must cut the reads by the same margin. A run with
    // the graph used to save the transitions among its few mispredicted faults in its
    // place, so every other run was nearly as bad as the recording. Now it keeps it.
    let recorded = std::fs::read(&graph).unwrap();
    let read1 = first["bytes_read"].as_u64().unwrap();
    let mut reads = vec![read1];
    for n in 2..=4 {
        let (later, _) = run(&setup.dir.path(&format!("run{n}.json")));
        let policy = later["config"]["policy_in_use"].as_str().unwrap();
        assert!(policy.contains("learned graph"), "run {n}: {policy}");
        assert!(later["peak_resident_bytes"].as_u64().unwrap() <= 4 << 20);
        reads.push(later["bytes_read"].as_u64().unwrap());
    }
    eprintln!("reads: recording run, then with the learned graph: {reads:?}");
    // Recording (demand, FIFO) re-reads the whole file each pass: ~32 MiB; with the
    // learned order half stays resident: ~8 + 3 x 4 = 20 MiB.
    for (n, &read) in reads.iter().enumerate().skip(1) {
        assert!(
            (read as f64) < 0.8 * read1 as f64,
            "run {} with the learned graph did not cut the reads: {reads:?}",
            n + 1
        );
    }
    assert!(
        std::fs::read(&graph).unwrap() == recorded,
        "the graph was replaced"
    );
}

/// The victim's `sum` of a whole file, as it prints it (FNV-1a's step; its seed is the
/// victim's own, not FNV's).
fn file_sum(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap();
    let sum = bytes.iter().fold(1_469_598_103_934_665_603u64, |s, &b| {
        (s ^ u64::from(b)).wrapping_mul(1_099_511_628_211)
    });
    format!("{sum:x}")
}

/// Runs `victim fork-bypass MODEL OTHER how` under the shim and checks what every
/// process saw. Children made without the `fork` symbol used to keep the parent's shim
/// state, and their exit report or own model mapping waited forever for a fault service
/// that does not exist in them. The victim bounds each process with alarm(), so a hang
/// shows as a child dead of SIGALRM (or a missing exit line), not as a stuck test.
fn check_child_made_without_the_fork_symbol(how: &str) {
    let setup = setup(&format!("shim-fork-bypass{how}"));
    let model = setup.dir.path("m.gguf");
    pattern_file(&model, 8 << 20);
    let other = setup.dir.path("other.gguf");
    pattern_file(&other, (4 << 20) + 77);
    let stats = setup.dir.path("stats.json");
    let started = std::time::Instant::now();
    let (model_arg, other_arg) = (model.to_str().unwrap(), other.to_str().unwrap());
    let output = shimmed_bounded(&setup, &stats, &["fork-bypass", model_arg, other_arg, how]);
    let elapsed = started.elapsed();
    assert_success(&output, how);
    let seen = stdout(&output);
    let has = |line: &str| lines_with(&seen, line) == vec![line];
    // The parent's bytes came through the region and are the file's.
    let model_sum = file_sum(&model);
    assert!(
        has(&format!("parent sum {model_sum} kind anon")),
        "{how}:\n{seen}"
    );
    // The child's own model mapping went to the kernel; the parent's range was absent.
    let child = if how == "daemon" {
        "daemon child"
    } else {
        "child"
    };
    assert!(
        has(&format!("child sum {} kind file", file_sum(&other))),
        "{how}:\n{seen}"
    );
    assert!(has("child munmap parent range 0"), "{how}:\n{seen}");
    assert!(has(&format!("exit complete {child}")), "{how}:\n{seen}");
    let messages = stderr(&output);
    assert!(!messages.contains("cannot write"), "{how}: {messages}");
    if how != "daemon" {
        // daemon's caller _exits inside it: only the other ways have a parent to go on.
        assert!(has("child exit 0"), "{how}:\n{seen}");
        assert!(
            has(&format!("parent after sum {model_sum}")),
            "{how}:\n{seen}"
        );
        assert!(has("system 3"), "{how}:\n{seen}");
        assert!(has("exit complete parent"), "{how}:\n{seen}");
        let parent_pid = lines_with(&seen, "parent pid ")[0].replace("parent pid ", "");
        let json = read_stats(&stats);
        assert_eq!(json["pid"].to_string(), parent_pid, "{json}");
        assert!(json["faults"].as_u64().unwrap() > 0, "{json}");
    }
    assert!(
        elapsed < std::time::Duration::from_secs(20),
        "{how}: took {elapsed:?}"
    );
}

#[test]
fn a_child_made_by_daemon_exits_and_maps_models_without_the_parents_pager() {
    check_child_made_without_the_fork_symbol("daemon");
}

#[test]
fn a_child_made_by_underscore_fork_exits_and_maps_models_without_the_parents_pager() {
    check_child_made_without_the_fork_symbol("_Fork");
}

#[test]
fn a_child_made_by_the_raw_fork_syscall_exits_and_maps_models_without_the_parents_pager() {
    check_child_made_without_the_fork_symbol("syscall");
}

#[test]
fn a_model_mapped_into_the_unmapped_head_of_another_is_served_and_so_is_the_rest() {
    let setup = setup("shim-nest");
    let first = setup.dir.path("a.gguf");
    pattern_file(&first, 8 << 20);
    let second = setup.dir.path("b.gguf");
    std::fs::write(&second, vec![0x5A; 1 << 20]).unwrap();
    let args = [
        "nest",
        first.to_str().unwrap(),
        second.to_str().unwrap(),
        "2097152",
    ];
    let stats = setup.dir.path("stats.json");
    let expected = plain(&setup.victim, &args);
    assert_success(&expected, "plain run");
    let output = shimmed_bounded(&setup, &stats, &args);
    assert_success(&output, "shimmed run");
    let seen = stdout(&output);
    assert!(seen.contains("nested 1"), "not placed in the hole:\n{seen}");
    for what in ["b sum", "a rest"] {
        assert_eq!(
            lines_with(&seen, what),
            lines_with(&stdout(&expected), what),
            "{what}"
        );
    }
    // Both taken over (and still mapped at exit, with any copies placed elsewhere).
    let json = read_stats(&stats);
    assert!(json["managed_mappings"].as_u64().unwrap() >= 2, "{json}");
}

/// A GGUF with one 64 MiB tensor: as large as the launcher's default `--min-size`, which
/// `hyperoffload trace` uses, and with a tensor table for the trace's names.
fn trace_model(path: &Path) {
    use hyperoffload::model::ggml_type::GgmlType;
    use hyperoffload::model::gguf::{GgufValue, GgufWriter, NewTensor};
    let tensor = NewTensor {
        name: "blob".to_string(),
        dims: vec![16 << 20],
        ggml_type: GgmlType::F32,
    };
    let metadata = [("general.name".to_string(), GgufValue::string("blob"))];
    let file = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut writer = GgufWriter::new(file, &metadata, vec![tensor], 32).unwrap();
    let piece: Vec<u8> = (0..1u64 << 20).map(pattern_byte).collect();
    for _ in 0..64 {
        writer.write_data(&piece).unwrap();
    }
    use std::io::Write;
    writer.finish().unwrap().flush().unwrap();
}

/// `hyperoffload trace --out OUT -- victim sum-exit MODEL CODE` in the setup's directory.
fn traced_sum_exit(setup: &Setup, out: &Path, model: &Path, code: &str) -> Output {
    traced_sum_exit_with(setup, &[], out, model, code)
}

/// As `traced_sum_exit`, with `options` for `trace` before `--out`.
fn traced_sum_exit_with(
    setup: &Setup,
    options: &[&str],
    out: &Path,
    model: &Path,
    code: &str,
) -> Output {
    Command::new(LAUNCHER)
        .env("HYPEROFFLOAD_SHIM", shim())
        .arg("trace")
        .args(options)
        .arg("--out")
        .arg(out)
        .arg("--")
        .arg(&setup.victim)
        .arg("sum-exit")
        .arg(model)
        .arg(code)
        .current_dir(&setup.dir.0)
        .output()
        .unwrap()
}

/// `trace` takes `run`'s options and passes them on: the recording is made with the
/// policy and block size given.
#[test]
fn trace_runs_the_program_with_runs_policy_block_and_budget() {
    let setup = setup("shim-trace-options");
    let model = setup.dir.path("m.gguf");
    trace_model(&model);
    let out = setup.dir.path("t.json");
    let options = ["--policy", "demand", "--block", "64K", "--budget", "8M"];
    let output = traced_sum_exit_with(&setup, &options, &out, &model, "0");
    let messages = stderr(&output);
    assert!(output.status.success(), "{messages}");
    let csv = std::fs::read_to_string(setup.dir.path("t.csv")).unwrap();
    assert!(
        csv.lines().any(|line| line.contains("block_size=65536")),
        "{csv}"
    );
    // Demand paging at 8 MiB of a 64 MiB model: every block faults, none is prefetched.
    let blocks: std::collections::HashSet<&str> = csv
        .lines()
        .filter(|line| !line.starts_with('#') && !line.starts_with("t_ns"))
        .filter_map(|line| line.split(',').nth(4))
        .collect();
    assert!(blocks.len() >= 1000, "{} blocks faulted", blocks.len());
    // A bad value is refused before anything runs, with `run`'s message.
    let refused = traced_sum_exit_with(&setup, &["--policy", "nope"], &out, &model, "0");
    assert!(!refused.status.success());
    assert!(stderr(&refused).contains("unknown policy `nope`"));
}

#[test]
fn trace_passes_the_programs_exit_status_through_and_still_writes_the_trace() {
    let setup = setup("shim-trace-status");
    let model = setup.dir.path("m.gguf");
    trace_model(&model);
    let out = setup.dir.path("t.json");
    let output = traced_sum_exit(&setup, &out, &model, "3");
    let messages = stderr(&output);
    assert_eq!(output.status.code(), Some(3), "{messages}");
    assert!(
        stdout(&output).contains("kind anon"),
        "not served by the pager"
    );
    assert!(messages.contains("faults: "), "{messages}");
    let csv = std::fs::read_to_string(setup.dir.path("t.csv")).unwrap();
    assert!(csv.lines().count() > 2, "no faults recorded:\n{csv}");
    let json = std::fs::read_to_string(&out).unwrap();
    serde_json::from_str::<serde_json::Value>(&json).unwrap();
    assert!(setup.dir.path("t.tensors.csv").is_file());
    // And success stays success.
    let output = traced_sum_exit(&setup, &out, &model, "0");
    assert_success(&output, "trace of a program that succeeded");
}

#[test]
fn trace_replaces_every_file_an_earlier_trace_left() {
    let setup = setup("shim-trace-rerun");
    let model = setup.dir.path("m.gguf");
    trace_model(&model);
    let out = setup.dir.path("t.json");
    // What a previous run left (the shim refuses to overwrite its events file).
    let events = setup.dir.path("t.csv.events.jsonl");
    for file in ["t.json", "t.csv", "t.tensors.csv", "t.csv.events.jsonl"] {
        std::fs::write(setup.dir.path(file), "stale\n").unwrap();
    }
    let output = traced_sum_exit(&setup, &out, &model, "0");
    assert_success(&output, "rerun of a trace");
    let messages = stderr(&output);
    assert!(!messages.contains("cannot write"), "{messages}");
    for file in ["t.json", "t.csv", "t.tensors.csv", "t.csv.events.jsonl"] {
        let text = std::fs::read_to_string(setup.dir.path(file)).unwrap();
        assert!(!text.contains("stale"), "{file} is the old one");
    }
    let events = std::fs::read_to_string(events).unwrap();
    assert!(events.lines().any(|line| line.contains('{')), "{events}");
}

/// ^C at a terminal reaches the whole foreground group: trace, the launcher and the
/// program. A program that ends normally on it writes its trace, and trace must still be
/// there to convert it; it died of the ^C at once and the JSON was never written.
#[test]
fn trace_outlives_a_ctrl_c_that_the_program_ends_on() {
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    let setup = setup("shim-trace-sigint");
    let model = setup.dir.path("m.gguf");
    trace_model(&model);
    let out = setup.dir.path("t.json");
    let mut child = Command::new(LAUNCHER)
        .env("HYPEROFFLOAD_SHIM", shim())
        .arg("trace")
        .arg("--out")
        .arg(&out)
        .arg("--")
        .arg(&setup.victim)
        .arg("sum-then-wait-for-sigint")
        .arg(&model)
        .current_dir(&setup.dir.0)
        // Its own group, as a shell's foreground job: the ^C goes to all of it.
        .process_group(0)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let group = child.id() as i32;
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        let waiting = line == "waiting";
        seen.push(line);
        if waiting {
            break;
        }
    }
    assert!(seen.iter().any(|l| l == "waiting"), "{seen:?}");
    // SAFETY: signals the process group this test made.
    unsafe { libc::kill(-group, libc::SIGINT) };
    seen.extend(lines.map(Result::unwrap));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("trace did not end after the ^C");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert!(status.success(), "trace: {status}; {seen:?}");
    assert!(seen.iter().any(|l| l == "interrupted"), "{seen:?}");
    let json = std::fs::read_to_string(&out).unwrap();
    serde_json::from_str::<serde_json::Value>(&json).unwrap();
}

/// A model argument of no format with tensors (the pager served it; the shim learns its
/// order): the trace is written with faults named by block, and a warning. It used to
/// fail after the whole run for want of tensor names.
#[test]
fn trace_of_a_file_without_tensors_names_faults_by_block() {
    let setup = setup("shim-trace-no-tensors");
    let model = setup.dir.path("m.gguf");
    pattern_file(&model, 64 << 20);
    let out = setup.dir.path("t.json");
    let output = traced_sum_exit(&setup, &out, &model, "0");
    assert_success(&output, "trace of a file without tensors");
    assert!(
        stderr(&output).contains("faults are named by block"),
        "{}",
        stderr(&output)
    );
    let json = std::fs::read_to_string(&out).unwrap();
    serde_json::from_str::<serde_json::Value>(&json).unwrap();
}
