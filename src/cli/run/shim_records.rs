//! What the shim left in the private directory when the program ended: its records of
//! the model files, and its last stats snapshot.

use std::path::Path;

use hyperoffload::served_files::SeenFiles;

/// What the shim recorded of the model files (`seen-<pid>.json` in `dir`): the
/// program's (`pid`) first, then those of the programs it ran with `--inherit`.
pub(super) fn seen_files(dir: &Path, pid: u32) -> Option<SeenFiles> {
    let mut records: Vec<(bool, SeenFiles)> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            let own = name == format!("seen-{pid}.json");
            if !name.starts_with("seen-") || !name.ends_with(".json") {
                return None;
            }
            let json = std::fs::read_to_string(entry.path()).ok()?;
            Some((own, SeenFiles::from_json(&json)?))
        })
        .collect();
    records.sort_by_key(|(own, _)| !own);
    let mut records = records.into_iter().map(|(_, seen)| seen);
    let mut seen = records.next()?;
    for other in records {
        seen.files.extend(other.files);
    }
    Some(seen)
}

/// The last stats snapshot the shim wrote in `dir` (see `ShimConfig::snapshot_dir`):
/// the program's (`pid`), else the newest of the programs it ran with `--inherit`.
pub(super) fn last_snapshot(dir: &Path, pid: u32) -> Option<String> {
    let own = dir.join(format!("snapshot-{pid}.json"));
    if let Ok(json) = std::fs::read_to_string(own) {
        return Some(json);
    }
    let newest = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter(|entry| {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            name.starts_with("snapshot-") && name.ends_with(".json")
        })
        .filter_map(|entry| Some((entry.metadata().ok()?.modified().ok()?, entry.path())))
        .max()?;
    std::fs::read_to_string(newest.1).ok()
}
