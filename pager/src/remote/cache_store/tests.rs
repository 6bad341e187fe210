//! Tests of the cache tier's files: a cache directory under the temporary directory.
use super::super::eviction::Lru;
use super::*;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ho-cache-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn block(n: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31) ^ n).collect()
}

#[test]
fn a_block_another_store_is_writing_is_left_to_it() {
    let dir = temp_dir("storing");
    let cache = Cache::open(&dir, 1 << 20, Box::new(Lru)).unwrap();
    let id = cache.attach("m", "v1:8192", 8192, 4096).unwrap();
    // As if another thread's store of block 0 were between its write and its mark.
    crate::lock::lock(&cache.state).storing.insert((id.0, 0));
    assert!(!cache.store(id, 0, &block(0, 4096)).unwrap());
    assert_eq!(cache.stats().used_bytes, 0, "nothing reserved for it");
    crate::lock::lock(&cache.state).storing.remove(&(id.0, 0));
    assert!(cache.store(id, 0, &block(0, 4096)).unwrap());
    assert!(crate::lock::lock(&cache.state).storing.is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn blocks_persist_across_opens_and_other_versions_are_dropped() {
    let dir = temp_dir("persist");
    {
        let cache = Cache::open(&dir, 1 << 20, Box::new(Lru)).unwrap();
        let id = cache.attach("m", "v1:10000", 10_000, 4096).unwrap();
        assert!(cache.store(id, 0, &block(0, 4096)).unwrap());
        assert!(cache.store(id, 2, &block(2, 10_000 - 8192)).unwrap());
        cache.flush().unwrap();
        assert!(matches!(
            Cache::open(&dir, 1 << 20, Box::new(Lru)),
            Err(CacheError::Busy(_))
        ));
    }
    let cache = Cache::open(&dir, 1 << 20, Box::new(Lru)).unwrap();
    assert_eq!(cache.stats().used_bytes, 4096 + 10_000 - 8192);
    let id = cache.attach("m", "v1:10000", 10_000, 4096).unwrap();
    let mut buf = [0u8; 100];
    assert!(cache.read(id, 0, 10, &mut buf).unwrap());
    assert_eq!(&buf[..], &block(0, 4096)[10..110]);
    assert!(!cache.read(id, 1, 0, &mut buf).unwrap());
    assert!(cache.contains(id, 2));
    // A new version of the object replaces the old one's bytes.
    let id = cache.attach("m", "v2:10000", 10_000, 4096).unwrap();
    assert!(!cache.contains(id, 0));
    assert_eq!(cache.stats().used_bytes, 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_limit_evicts_least_recently_used_and_spares_what_is_read() {
    let dir = temp_dir("limit");
    let cache = Cache::open(&dir, 3 * 4096, Box::new(Lru)).unwrap();
    let id = cache.attach("m", "v", 8 * 4096, 4096).unwrap();
    for b in 0..3 {
        assert!(cache.store(id, b, &block(b as u8, 4096)).unwrap());
    }
    let mut buf = [0u8; 1];
    assert!(cache.read(id, 0, 0, &mut buf).unwrap()); // 0 is now the newest
    assert!(cache.store(id, 3, &block(3, 4096)).unwrap());
    assert!(cache.contains(id, 0) && !cache.contains(id, 1));
    assert!(cache.stats().used_bytes <= 3 * 4096);
    assert_eq!(cache.stats().evicted_blocks, 1);
    // Reopening with a smaller limit evicts down to it.
    drop(cache);
    let cache = Cache::open(&dir, 4096, Box::new(Lru)).unwrap();
    assert_eq!(cache.stats().used_bytes, 4096);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_block_with_bad_bytes_is_dropped_not_served() {
    let dir = temp_dir("crc");
    {
        let cache = Cache::open(&dir, 1 << 20, Box::new(Lru)).unwrap();
        let id = cache.attach("m", "v", 4096, 4096).unwrap();
        assert!(cache.store(id, 0, &block(0, 4096)).unwrap());
    }
    // A hole where the block was (its entry survived, its bytes did not).
    let data = std::fs::read_dir(dir.join("v1"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "data"))
        .unwrap();
    let file = OpenOptions::new().write(true).open(&data).unwrap();
    crate::sys::files::punch_hole(file.as_fd(), 0, 4096).unwrap();
    let cache = Cache::open(&dir, 1 << 20, Box::new(Lru)).unwrap();
    let id = cache.attach("m", "v", 4096, 4096).unwrap();
    let mut buf = [0u8; 16];
    assert!(!cache.read(id, 0, 0, &mut buf).unwrap());
    assert_eq!(cache.stats().corrupt_blocks, 1);
    assert!(!cache.contains(id, 0));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn blocks_cached_by_an_earlier_mount_are_checked_before_the_object_is_whole() {
    let dir = temp_dir("complete");
    {
        let cache = Cache::open(&dir, 1 << 20, Box::new(Lru)).unwrap();
        let id = cache.attach("m", "v", 10_000, 4096).unwrap();
        assert_eq!(cache.completeness(id), Completeness::Partial);
        assert!(!cache.hold(id), "a partial object is not held");
        assert!(cache.store(id, 0, &block(0, 4096)).unwrap());
        assert!(cache.store(id, 1, &block(1, 4096)).unwrap());
        assert_eq!(cache.check_all(id).unwrap(), Completeness::Partial);
        assert!(cache.store(id, 2, &block(2, 10_000 - 8192)).unwrap());
        // Stored in this mount: checked as written.
        assert_eq!(cache.completeness(id), Completeness::Whole);
        cache.flush().unwrap();
    }
    let cache = Cache::open(&dir, 1 << 20, Box::new(Lru)).unwrap();
    let id = cache.attach("m", "v", 10_000, 4096).unwrap();
    assert_eq!(cache.completeness(id), Completeness::Unchecked);
    assert!(!cache.hold(id), "not before its blocks are checked");
    let mut buf = [0u8; 10];
    assert!(cache.read(id, 1, 0, &mut buf).unwrap()); // checks block 1
    assert_eq!(cache.completeness(id), Completeness::Unchecked);
    assert_eq!(cache.check_all(id).unwrap(), Completeness::Whole);
    assert!(cache.hold(id) && cache.held(id));
    assert!(cache.data_file(id).metadata().unwrap().len() == 10_000);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_bad_block_found_by_the_check_is_dropped_and_the_object_is_not_whole() {
    let dir = temp_dir("check-bad");
    {
        let cache = Cache::open(&dir, 1 << 20, Box::new(Lru)).unwrap();
        let id = cache.attach("m", "v", 8192, 4096).unwrap();
        assert!(cache.store(id, 0, &block(0, 4096)).unwrap());
        assert!(cache.store(id, 1, &block(1, 4096)).unwrap());
    }
    let data = std::fs::read_dir(dir.join("v1"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "data"))
        .unwrap();
    let file = OpenOptions::new().write(true).open(&data).unwrap();
    file.write_all_at(b"garbage", 4096 + 100).unwrap();
    let cache = Cache::open(&dir, 1 << 20, Box::new(Lru)).unwrap();
    let id = cache.attach("m", "v", 8192, 4096).unwrap();
    assert_eq!(cache.check_all(id).unwrap(), Completeness::Partial);
    assert_eq!(cache.stats().corrupt_blocks, 1);
    assert!(!cache.contains(id, 1) && cache.contains(id, 0));
    assert!(!cache.hold(id));
    assert!(crate::lock::lock(&cache.state).pins.is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_object_held_whole_is_never_evicted() {
    let dir = temp_dir("held");
    let cache = Cache::open(&dir, 3 * 4096, Box::new(Lru)).unwrap();
    let held = cache.attach("held", "v", 2 * 4096, 4096).unwrap();
    let other = cache.attach("other", "v", 4 * 4096, 4096).unwrap();
    assert!(cache.store(held, 0, &block(0, 4096)).unwrap());
    assert!(cache.store(held, 1, &block(1, 4096)).unwrap());
    assert!(cache.hold(held));
    // The held blocks are the least recently used, yet only the other object's
    // block gives way; and when it is the only one, nothing more is stored.
    assert!(cache.store(other, 0, &block(2, 4096)).unwrap());
    assert!(cache.store(other, 1, &block(3, 4096)).unwrap());
    assert!(!cache.contains(other, 0) && cache.contains(other, 1));
    assert!(cache.contains(held, 0) && cache.contains(held, 1));
    assert_eq!(cache.completeness(held), Completeness::Whole);
    assert_eq!(cache.stats().evicted_blocks, 1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_block_larger_than_the_limit_is_not_stored() {
    let dir = temp_dir("tiny");
    let cache = Cache::open(&dir, 100, Box::new(Lru)).unwrap();
    let id = cache.attach("m", "v", 4096, 4096).unwrap();
    assert!(!cache.store(id, 0, &block(0, 4096)).unwrap());
    assert_eq!(cache.stats().used_bytes, 0);
    let _ = std::fs::remove_dir_all(&dir);
}
