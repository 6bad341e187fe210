//! The messages between a host (a pager serving a model file in a file-shaped region)
//! and a guest (another process of the same `hyperoffload run` tree mapping the same
//! file), one per `SOCK_SEQPACKET` datagram, with the descriptors `Attached` carries
//! (SCM_RIGHTS). Pure: bytes in, bytes out, unit-tested without a kernel.
//!
//! Layout: a tag byte, then the fields in order, little-endian.

use crate::wire::{Reader, Short};
use thiserror::Error;

/// Which file, and which part of it, a guest wants to map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileKey {
    pub dev: u64,
    pub ino: u64,
    /// The file's size and modification time (ns since the epoch), so that a file
    /// rewritten in place between the host's map and the guest's is not taken for it.
    pub size: u64,
    pub mtime_ns: i64,
}

/// One message, either way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// Guest to host: serve me `len` bytes of `file` from `offset`.
    Attach {
        file: FileKey,
        offset: u64,
        len: u64,
    },
    /// Host to guest: region `region` maps them; carries [the region's memfd
    /// (read-write), the model file].
    Attached {
        region: u32,
        /// Bytes of the file the region maps.
        data_len: u64,
        /// Bytes of the memfd (data, page rounded).
        shape_len: u64,
        /// Where the guest's range starts in the region (and its memfd): the guest
        /// may ask for part of what the region maps.
        start: u64,
    },
    /// Host to guest: no live region maps that (the guest pages for itself); with
    /// `not_yet`, the host has no region of that file yet (it claimed the file and is
    /// starting: the guest asks again).
    Refused { not_yet: bool },
    /// Guest to host: a thread of mine faulted on the page at `offset` of `region`.
    Fault { region: u32, offset: u64 },
    /// Host to guest: the page at `offset` is in the memfd now (wake the threads).
    Ready { region: u32, offset: u64 },
    /// Host to guest: the page at `offset` cannot be read (SIGBUS there).
    Poison { region: u32, offset: u64 },
}

/// A datagram that is not a message.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ProtocolError {
    #[error("empty message")]
    Empty,
    #[error("unknown message tag {0}")]
    UnknownTag(u8),
    #[error("message of tag {tag} cut short")]
    Short { tag: u8 },
    #[error("message of tag {tag} has {extra} bytes too many")]
    Long { tag: u8, extra: usize },
    #[error("message of tag {tag} came with {got} descriptors, not {expected}")]
    Descriptors {
        tag: u8,
        expected: usize,
        got: usize,
    },
}

const ATTACH: u8 = 1;
const ATTACHED: u8 = 2;
const REFUSED: u8 = 3;
const FAULT: u8 = 4;
const READY: u8 = 5;
const POISON: u8 = 6;

/// The largest message, for receive buffers.
pub const MAX_MESSAGE: usize = 64;

fn descriptors_of(tag: u8) -> usize {
    if tag == ATTACHED {
        2
    } else {
        0
    }
}

impl Message {
    fn tag(&self) -> u8 {
        match self {
            Message::Attach { .. } => ATTACH,
            Message::Attached { .. } => ATTACHED,
            Message::Refused { .. } => REFUSED,
            Message::Fault { .. } => FAULT,
            Message::Ready { .. } => READY,
            Message::Poison { .. } => POISON,
        }
    }

    /// How many descriptors travel with the message.
    pub fn descriptors(&self) -> usize {
        descriptors_of(self.tag())
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![self.tag()];
        let put64 = |out: &mut Vec<u8>, value: u64| out.extend_from_slice(&value.to_le_bytes());
        let put32 = |out: &mut Vec<u8>, value: u32| out.extend_from_slice(&value.to_le_bytes());
        match self {
            Message::Attach { file, offset, len } => {
                for value in [
                    file.dev,
                    file.ino,
                    file.size,
                    file.mtime_ns as u64,
                    *offset,
                    *len,
                ] {
                    put64(&mut out, value);
                }
            }
            Message::Attached {
                region,
                data_len,
                shape_len,
                start,
            } => {
                put32(&mut out, *region);
                put64(&mut out, *data_len);
                put64(&mut out, *shape_len);
                put64(&mut out, *start);
            }
            Message::Refused { not_yet } => out.push(u8::from(*not_yet)),
            Message::Fault { region, offset }
            | Message::Ready { region, offset }
            | Message::Poison { region, offset } => {
                put32(&mut out, *region);
                put64(&mut out, *offset);
            }
        }
        out
    }

    /// The message in `bytes`, which came with `fds` descriptors.
    pub fn decode(bytes: &[u8], fds: usize) -> Result<Message, ProtocolError> {
        let (&tag, rest) = bytes.split_first().ok_or(ProtocolError::Empty)?;
        if !(ATTACH..=POISON).contains(&tag) {
            return Err(ProtocolError::UnknownTag(tag));
        }
        let expected = descriptors_of(tag);
        if fds != expected {
            return Err(ProtocolError::Descriptors {
                tag,
                expected,
                got: fds,
            });
        }
        let mut reader = Reader { rest, tag };
        let message = match tag {
            ATTACH => Message::Attach {
                file: FileKey {
                    dev: reader.u64()?,
                    ino: reader.u64()?,
                    size: reader.u64()?,
                    mtime_ns: reader.u64()? as i64,
                },
                offset: reader.u64()?,
                len: reader.u64()?,
            },
            ATTACHED => Message::Attached {
                region: reader.u32()?,
                data_len: reader.u64()?,
                shape_len: reader.u64()?,
                start: reader.u64()?,
            },
            REFUSED => Message::Refused {
                not_yet: reader.take::<1>()?[0] != 0,
            },
            FAULT => Message::Fault {
                region: reader.u32()?,
                offset: reader.u64()?,
            },
            READY => Message::Ready {
                region: reader.u32()?,
                offset: reader.u64()?,
            },
            _ => Message::Poison {
                region: reader.u32()?,
                offset: reader.u64()?,
            },
        };
        if !reader.rest.is_empty() {
            return Err(ProtocolError::Long {
                tag,
                extra: reader.rest.len(),
            });
        }
        Ok(message)
    }
}

impl From<Short> for ProtocolError {
    fn from(short: Short) -> Self {
        ProtocolError::Short { tag: short.tag }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<Message> {
        let file = FileKey {
            dev: 0x803,
            ino: 1234567,
            size: 128 << 20,
            mtime_ns: -5,
        };
        vec![
            Message::Attach {
                file,
                offset: 4096,
                len: 128 << 20,
            },
            Message::Attached {
                region: 3,
                data_len: 128 << 20,
                shape_len: (128 << 20) + 4096,
                start: 1 << 20,
            },
            Message::Refused { not_yet: false },
            Message::Refused { not_yet: true },
            Message::Fault {
                region: 3,
                offset: 1 << 21,
            },
            Message::Ready {
                region: 3,
                offset: 1 << 21,
            },
            Message::Poison {
                region: 3,
                offset: !4095,
            },
        ]
    }

    #[test]
    fn every_message_reads_back_as_written() {
        for message in all() {
            let bytes = message.encode();
            assert!(bytes.len() <= MAX_MESSAGE);
            let back = Message::decode(&bytes, message.descriptors()).unwrap();
            assert_eq!(back, message);
        }
    }

    #[test]
    fn malformed_datagrams_are_told_apart() {
        assert_eq!(Message::decode(&[], 0), Err(ProtocolError::Empty));
        assert_eq!(Message::decode(&[0], 0), Err(ProtocolError::UnknownTag(0)));
        assert_eq!(
            Message::decode(&[99], 0),
            Err(ProtocolError::UnknownTag(99))
        );
        for message in all() {
            let bytes = message.encode();
            let tag = bytes[0];
            let fds = message.descriptors();
            if bytes.len() > 1 {
                assert_eq!(
                    Message::decode(&bytes[..bytes.len() - 1], fds),
                    Err(ProtocolError::Short { tag })
                );
            }
            let mut long = bytes.clone();
            long.push(0);
            assert_eq!(
                Message::decode(&long, fds),
                Err(ProtocolError::Long { tag, extra: 1 })
            );
            assert_eq!(
                Message::decode(&bytes, fds + 1),
                Err(ProtocolError::Descriptors {
                    tag,
                    expected: fds,
                    got: fds + 1
                })
            );
        }
    }
}
