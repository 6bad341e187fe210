//! The share protocol (`share::protocol`) between the pagers of one run on arbitrary
//! messages: decoding must return, never panic, and a message it accepts must encode to
//! one of at most `MAX_MESSAGE` bytes that decodes to it again. The first byte is the
//! number of descriptors the message came with (0 to 3).
#![no_main]

use hyperoffload::share::protocol::{Message, MAX_MESSAGE};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&fds, bytes)) = data.split_first() else {
        return;
    };
    let fds = usize::from(fds % 4);
    let Ok(message) = Message::decode(bytes, fds) else {
        return;
    };
    assert_eq!(message.descriptors(), fds);
    let again = message.encode();
    assert!(again.len() <= MAX_MESSAGE);
    assert_eq!(Message::decode(&again, fds), Ok(message));
});
