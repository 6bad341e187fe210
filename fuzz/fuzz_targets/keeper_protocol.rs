//! The keeper's wire protocol (`keeper::protocol`) on arbitrary messages: decoding must
//! return, never panic or allocate more than the message holds, and a message it
//! accepts must encode to one that decodes to it again. The first byte is the number of
//! descriptors the message came with (0 to 3).
#![no_main]

use hyperoffload::keeper::protocol::Message;
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
    if let Message::Child { regions, .. } = &message {
        assert!(regions.len() * 4 <= bytes.len());
    }
    let again = message.encode();
    assert_eq!(Message::decode(&again, fds), Ok(message));
});
