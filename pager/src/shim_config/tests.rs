//! Tests of reading, writing and sizing the shim's configuration: pure, no kernel.
use super::*;
use std::collections::HashMap;

fn read(vars: &[(&str, &str)]) -> Result<ShimConfig, ConfigError> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    ShimConfig::from_lookup(|var| map.get(var).cloned())
}

#[test]
fn defaults_when_nothing_is_set() {
    let config = read(&[]).unwrap();
    assert_eq!(config, ShimConfig::defaults());
    assert_eq!(config.budget, BudgetSpec::Auto);
    assert!(config.matches(b"/models/x.gguf"));
    assert!(config.matches(b"model.safetensors"));
    assert!(!config.matches(b"/models/x.bin"));
    assert_eq!(config.min_size, 64 << 20);
}

#[test]
fn serving_forks_is_asked_for_and_keeps_the_block_sizing() {
    let default = read(&[]).unwrap();
    assert!(!default.serve_forks && default.serve_forks_at_fork);
    let never = read(&[(ENV_SERVE_FORKS, "0")]).unwrap();
    assert!(!never.serve_forks && !never.serve_forks_at_fork);
    assert!(never.to_env().contains(&(ENV_SERVE_FORKS, "0".to_string())));
    let refused = read(&[(ENV_SERVE_FORKS, "yes")]).unwrap_err();
    assert_eq!(
        (refused.var, refused.value.as_str()),
        (ENV_SERVE_FORKS, "yes")
    );
    let config = read(&[(ENV_SERVE_FORKS, "1")]).unwrap();
    assert!(config.serve_forks);
    // Blocks are still sized for huge pages: copied into the region's file, 2 MiB
    // blocks cost far less per byte than pages.
    assert!(config.zero_copy);
    assert!(config
        .to_env()
        .contains(&(ENV_SERVE_FORKS, "1".to_string())));
}

#[test]
fn budgets_as_sizes_and_percentages() {
    assert_eq!(BudgetSpec::parse("48M"), Ok(BudgetSpec::Bytes(48 << 20)));
    assert_eq!(BudgetSpec::parse("50%"), Ok(BudgetSpec::ModelPercent(50)));
    assert_eq!(BudgetSpec::ModelPercent(50).resolve(1000, || 1), 500);
    assert_eq!(BudgetSpec::Bytes(7).resolve(1000, || 1), 7);
    assert_eq!(BudgetSpec::Auto.resolve(1000, || 3), 3);
    assert_eq!(BudgetSpec::parse("auto"), Ok(BudgetSpec::Auto));
    assert_eq!(BudgetSpec::parse("0"), Err(BudgetError::Zero));
    assert_eq!(BudgetSpec::parse("0M"), Err(BudgetError::Zero));
    assert_eq!(
        BudgetSpec::parse("0%"),
        Err(BudgetError::PercentageRange(0))
    );
    assert_eq!(
        BudgetSpec::parse("101%"),
        Err(BudgetError::PercentageRange(101))
    );
    assert_eq!(
        BudgetSpec::parse("1.5%"),
        Err(BudgetError::Percentage("1.5%".into()))
    );
    assert!(matches!(
        BudgetSpec::parse("half"),
        Err(BudgetError::Size(_))
    ));
}

#[test]
fn a_plain_number_too_small_for_bytes_is_refused_with_a_percentage_suggested() {
    let error = BudgetSpec::parse("50").unwrap_err();
    assert_eq!(error, BudgetError::NoUnit(50));
    let message = error.to_string();
    assert!(
        message.contains("`50%`") && message.contains("50 bytes"),
        "{message}"
    );
    assert_eq!(
        BudgetSpec::parse("1048575"),
        Err(BudgetError::NoUnit(1048575))
    );
    // With a unit, or large enough to be meant as bytes, a size is taken as given.
    assert_eq!(BudgetSpec::parse("1048576"), Ok(BudgetSpec::Bytes(1 << 20)));
    assert_eq!(BudgetSpec::parse("4K"), Ok(BudgetSpec::Bytes(4096)));
    assert_eq!(BudgetSpec::parse("50B"), Ok(BudgetSpec::Bytes(50)));
    // What the launcher writes for the shim reads back, however small.
    let small = BudgetSpec::Bytes(16 << 10);
    assert_eq!(BudgetSpec::parse(&small.to_env_value()), Ok(small));
}

#[test]
fn block_sizes_are_powers_of_two_from_a_page_to_a_gigabyte() {
    assert_eq!(parse_block_size("4K"), Ok(4096));
    assert_eq!(parse_block_size("64M"), Ok(64 << 20));
    assert_eq!(parse_block_size("1G"), Ok(1 << 30));
    assert_eq!(parse_block_size("2G"), Err(BlockError::TooLarge(2 << 30)));
    assert_eq!(
        parse_block_size("3M"),
        Err(BlockError::NotPowerOfTwo(3 << 20))
    );
    assert_eq!(
        parse_block_size("2K"),
        Err(BlockError::TooSmall {
            bytes: 2048,
            meant_kib: false
        })
    );
    assert_eq!(
        parse_block_size("3000"),
        Err(BlockError::TooSmall {
            bytes: 3000,
            meant_kib: false
        })
    );
    let error = parse_block_size("64").unwrap_err();
    assert!(error.to_string().contains("did you mean 64K?"), "{error}");
    assert!(error.to_string().contains("4K to 1G"), "{error}");
    assert!(matches!(parse_block_size("64Q"), Err(BlockError::Size(_))));
}

#[test]
fn the_sizing_raises_the_budget_to_the_floor_and_prefers_small_blocks_to_a_raise() {
    let mut config = ShimConfig::defaults();
    let gib = 1u64 << 30;
    // 4 KiB blocks, two threads: 16 KiB at least.
    let sizing = config.sizing(4096, gib, 2);
    assert_eq!((sizing.block_size, sizing.budget), (4096, 16 << 10));
    assert_eq!(sizing.raised.map(|raise| raise.asked), Some(4096));
    assert_eq!(config.sizing(gib, gib, 2).raised, None);
    // Huge blocks chosen by themselves for 16 MiB, but 8 threads would need 32 MiB
    // of them: 4 KiB blocks instead, and no raise.
    assert_eq!(config.sizing(16 << 20, gib, 4).block_size, 2 << 20);
    let sizing = config.sizing(16 << 20, gib, 8);
    assert_eq!((sizing.block_size, sizing.raised), (4096, None));
    // A block the user asked for stays; the budget grows to hold it.
    config.block_size = Some(64 << 20);
    let sizing = config.sizing(32 << 20, gib, 2);
    assert_eq!((sizing.block_size, sizing.budget), (64 << 20, 256 << 20));
}

#[test]
fn huge_blocks_only_with_zero_copy_a_large_enough_budget_and_few_enough_blocks() {
    let mut config = ShimConfig::defaults();
    let gib = 1u64 << 30;
    assert_eq!(config.block_size_for(gib, 3 * gib), 2 << 20);
    assert_eq!(config.block_size_for(16 << 20, 3 * gib), 2 << 20);
    assert_eq!(config.block_size_for((16 << 20) - 1, 3 * gib), 4096);
    // 32 GiB is 16384 blocks of 2 MiB; one byte more doubles the block.
    assert_eq!(config.block_size_for(gib, 32 * gib), 2 << 20);
    assert_eq!(config.block_size_for(gib, 32 * gib + 1), 4 << 20);
    assert_eq!(config.block_size_for(gib, 100 * gib), 8 << 20);
    config.zero_copy = false;
    assert_eq!(config.block_size_for(gib, 3 * gib), 4096);
    config.block_size = Some(64 << 10);
    assert_eq!(config.block_size_for(gib, 3 * gib), 64 << 10);
}

#[test]
fn round_trips_through_the_environment() {
    let mut config = ShimConfig::defaults();
    config.budget = BudgetSpec::ModelPercent(25);
    config.patterns = vec!["*.bin".into(), "/data/*.gguf".into()];
    config.min_size = 1 << 20;
    config.policy = "demand".into();
    config.block_size = Some(1 << 20);
    config.stats_path = Some("/tmp/s.json".into());
    config.snapshot_dir = Some("/tmp/snapshots".into());
    config.trace_path = Some("/tmp/t.jsonl".into());
    config.verbose = true;
    config.inherit = true;
    config.zero_copy = false;
    config.saved_experts = false;
    config.budget_min = Some(300 << 20);
    config.budget_max = Some(3 << 30);
    let env: HashMap<String, String> = config
        .to_env()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    let back = ShimConfig::from_lookup(|var| env.get(var).cloned()).unwrap();
    assert_eq!(back, config);
}

#[test]
fn an_auto_budget_starts_and_follows_within_min_and_max() {
    const GIB: u64 = 1 << 30;
    let mut config = read(&[(ENV_BUDGET_MIN, "1G"), (ENV_BUDGET_MAX, "4G")]).unwrap();
    assert_eq!(config.bounded_auto(8 * GIB), 4 * GIB);
    assert_eq!(config.bounded_auto(GIB / 2), GIB);
    assert_eq!(config.bounded_auto(2 * GIB), 2 * GIB);
    assert_eq!(config.auto_ceiling(2 * GIB, 24 * GIB), 4 * GIB);
    config.budget_max = None;
    assert_eq!(config.auto_ceiling(2 * GIB, 24 * GIB), 18 * GIB);
    // Never below where it starts (a --min above the ceiling).
    assert_eq!(config.auto_ceiling(20 * GIB, 24 * GIB), 20 * GIB);
    let crossed = read(&[(ENV_BUDGET_MIN, "4G"), (ENV_BUDGET_MAX, "1G")]);
    assert_eq!(crossed.unwrap_err().var, ENV_BUDGET_MIN);
    assert_eq!(
        read(&[(ENV_BUDGET_MAX, "x")]).unwrap_err().var,
        ENV_BUDGET_MAX
    );
}

#[test]
fn bad_values_name_the_variable_and_value() {
    let error = read(&[(ENV_BUDGET, "lots")]).unwrap_err();
    assert_eq!(error.var, ENV_BUDGET);
    assert!(error
        .to_string()
        .starts_with("HYPEROFFLOAD_BUDGET=\"lots\""));
    assert_eq!(read(&[(ENV_MATCH, " , ")]).unwrap_err().var, ENV_MATCH);
    assert_eq!(read(&[(ENV_MIN_SIZE, "x")]).unwrap_err().var, ENV_MIN_SIZE);
    assert_eq!(read(&[(ENV_POLICY, "belady")]).unwrap_err().var, ENV_POLICY);
    assert_eq!(read(&[(ENV_BLOCK, "3000")]).unwrap_err().var, ENV_BLOCK);
    assert_eq!(
        read(&[(ENV_INSTALL_THREADS, "many")]).unwrap_err().var,
        ENV_INSTALL_THREADS
    );
    assert_eq!(
        read(&[(ENV_INSTALL_THREADS, "17")]).unwrap_err().var,
        ENV_INSTALL_THREADS
    );
    assert_eq!(
        read(&[(ENV_INSTALL_THREADS, "0")]).unwrap().install_threads,
        Some(0)
    );
    assert_eq!(read(&[(ENV_STATS, "rel.json")]).unwrap_err().var, ENV_STATS);
    assert_eq!(
        read(&[(ENV_SNAPSHOTS, "rel")]).unwrap_err().var,
        ENV_SNAPSHOTS
    );
    assert_eq!(read(&[(ENV_VERBOSE, "yes")]).unwrap_err().var, ENV_VERBOSE);
}

#[test]
fn patterns_with_a_slash_match_the_whole_path() {
    let config = read(&[(ENV_MATCH, "/data/*.bin, weights-*")]).unwrap();
    assert!(config.matches(b"/data/a.bin"));
    assert!(!config.matches(b"/other/a.bin"));
    assert!(config.matches(b"/anywhere/weights-1"));
}
