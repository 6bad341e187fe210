//! The GGUF header parser on arbitrary bytes: it must return, never panic, and never
//! allocate more than the input could hold.
#![no_main]

use hyperoffload::model::gguf::GgufFile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(file) = GgufFile::parse(data) {
        let table = file.tensor_table();
        for t in &table {
            assert!(t.file_range.start <= t.file_range.end);
            assert!(t.file_range.end <= data.len() as u64);
        }
    }
    // As the prefix of a larger file: the bounds are checked against the claimed length.
    let _ = GgufFile::parse_prefix(data, (data.len() as u64).saturating_mul(3));
});
