//! Helpers shared by the integration tests.

#![allow(dead_code)]

use std::path::PathBuf;

/// The file name of the small real model the tests use.
pub const TEST_MODEL_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The small real model: `$HYPEROFFLOAD_TEST_MODEL`, else the cache that
/// `tools/fetch-model.sh` fills. If it is missing the test fails and says how to get
/// it, unless `HYPEROFFLOAD_ALLOW_SKIP=1`: then it says why it skips and returns `None`.
pub fn test_model() -> Option<PathBuf> {
    let path = match std::env::var_os("HYPEROFFLOAD_TEST_MODEL") {
        Some(path) => PathBuf::from(path),
        None => {
            let cache = std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
                .unwrap_or_else(|| PathBuf::from(".cache"));
            cache.join("hyperoffload/models").join(TEST_MODEL_NAME)
        }
    };
    if path.is_file() {
        return Some(path);
    }
    let why = format!(
        "test model {} not found: run tools/fetch-model.sh (or set HYPEROFFLOAD_TEST_MODEL)",
        path.display()
    );
    if std::env::var("HYPEROFFLOAD_ALLOW_SKIP").as_deref() == Ok("1") {
        eprintln!("skipping: {why}");
        return None;
    }
    panic!("{why}");
}
