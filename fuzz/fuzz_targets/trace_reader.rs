//! The fault-trace reader on arbitrary bytes: every line gives a record or an error
//! naming the line, never a panic.
#![no_main]

use hyperoffload::trace::TraceReader;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(reader) = TraceReader::new(data) {
        for record in reader.take(10_000) {
            if record.is_err() {
                break;
            }
        }
    }
});
