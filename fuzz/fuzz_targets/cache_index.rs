//! The remote cache's index file (`remote::cache_index`) on arbitrary bytes: decoding
//! must return, never panic nor allocate by what the header claims; an index it accepts
//! holds at most one entry per block, and its header and entries encode to bytes that
//! decode to them again.
#![no_main]

use hyperoffload::remote::cache_index::{decode, padded, ENTRY_LEN, MAX_BLOCKS};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok((header, len, entries)) = decode(data) else {
        return;
    };
    assert!(entries.len() as u64 <= header.blocks());
    assert_eq!(entries.len(), (data.len() - len) / ENTRY_LEN);
    let mut again = header.encode();
    assert_eq!(again.len(), len);
    for entry in &entries {
        again.extend_from_slice(&entry.encode());
    }
    let (header_again, len_again, entries_again) = decode(&again).expect("re-encoded index");
    assert_eq!((&header_again, len_again), (&header, len));
    assert_eq!(entries_again, entries);
    // Padding allocates only for objects of a size an index may have.
    if header.blocks() <= 1 << 16 {
        let all = padded(&header, entries).expect("a small object is indexed");
        assert_eq!(all.len() as u64, header.blocks());
    } else if header.blocks() > MAX_BLOCKS {
        assert!(padded(&header, Vec::new()).is_err());
    }
});
