//! The safetensors header parser on arbitrary bytes: it must return, never panic.
#![no_main]

use hyperoffload::model::safetensors::SafetensorsFile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(file) = SafetensorsFile::parse(data) {
        for t in file.tensor_table() {
            assert!(t.file_range.start <= t.file_range.end);
            assert!(t.file_range.end <= data.len() as u64);
        }
    }
    let _ = SafetensorsFile::parse_prefix(data, (data.len() as u64).saturating_mul(3));
});
