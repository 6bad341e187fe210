//! The messages a pager's service sends the keeper (`crate::keeper`), one per
//! `SOCK_SEQPACKET` datagram, with the descriptors it names attached (SCM_RIGHTS).
//! Pure: bytes in, bytes out, unit-tested without a kernel.
//!
//! Layout: a tag byte, then the fields in order, little-endian; a region's path last,
//! as the rest of the datagram (UTF-8, lossy: it only names the file in messages).

use crate::wire::{Reader, Short};
use thiserror::Error;

/// Which service a message is from: its thread's id in the high half, a number drawn
/// when it started in the low half (a thread id can be taken again after an exec).
pub type SessionId = u64;

/// One message from a service to the keeper.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// A service started. Carries the pidfd of its thread (`PIDFD_THREAD`), readable
    /// once that thread has exited: with its process, or at an exec.
    Session { session: SessionId },
    /// A file-shaped region was added (before the program can touch it, so before any
    /// child can have it). Carries its file (`shaped_region`, read-write) and the model
    /// file it maps (readable).
    Region {
        session: SessionId,
        region: u32,
        /// The region's address in the program (and in every child forked after this).
        base: u64,
        file_offset: u64,
        data_len: u64,
        /// Bytes of the region's file (its data, page rounded).
        shape_len: u64,
        path: String,
    },
    /// The service forgot the region (filled first, if children lived).
    RegionGone { session: SessionId, region: u32 },
    /// A fork handed the service a child's userfaultfd, carried along; `regions` are
    /// those live at that moment (a superset of what the child maps).
    Child {
        session: SessionId,
        child: u32,
        regions: Vec<u32>,
    },
    /// The child exited or exec'd: its userfaultfd was closed.
    ChildGone { session: SessionId, child: u32 },
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
    #[error("message of tag {tag} came with {got} descriptors, not {expected}")]
    Descriptors {
        tag: u8,
        expected: usize,
        got: usize,
    },
}

const SESSION: u8 = 1;
const REGION: u8 = 2;
const REGION_GONE: u8 = 3;
const CHILD: u8 = 4;
const CHILD_GONE: u8 = 5;

impl Message {
    fn tag(&self) -> u8 {
        match self {
            Message::Session { .. } => SESSION,
            Message::Region { .. } => REGION,
            Message::RegionGone { .. } => REGION_GONE,
            Message::Child { .. } => CHILD,
            Message::ChildGone { .. } => CHILD_GONE,
        }
    }

    /// How many descriptors travel with the message.
    pub fn descriptors(&self) -> usize {
        descriptors_of(self.tag())
    }

    pub fn session(&self) -> SessionId {
        match self {
            Message::Session { session }
            | Message::Region { session, .. }
            | Message::RegionGone { session, .. }
            | Message::Child { session, .. }
            | Message::ChildGone { session, .. } => *session,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![self.tag()];
        let put64 = |out: &mut Vec<u8>, value: u64| out.extend_from_slice(&value.to_le_bytes());
        let put32 = |out: &mut Vec<u8>, value: u32| out.extend_from_slice(&value.to_le_bytes());
        put64(&mut out, self.session());
        match self {
            Message::Session { .. } => {}
            Message::Region {
                region,
                base,
                file_offset,
                data_len,
                shape_len,
                path,
                ..
            } => {
                put32(&mut out, *region);
                for value in [*base, *file_offset, *data_len, *shape_len] {
                    put64(&mut out, value);
                }
                out.extend_from_slice(path.as_bytes());
            }
            Message::RegionGone { region, .. } => put32(&mut out, *region),
            Message::Child { child, regions, .. } => {
                put32(&mut out, *child);
                put32(&mut out, regions.len() as u32);
                for region in regions {
                    put32(&mut out, *region);
                }
            }
            Message::ChildGone { child, .. } => put32(&mut out, *child),
        }
        out
    }

    /// The message in `bytes`, which came with `fds` descriptors.
    pub fn decode(bytes: &[u8], fds: usize) -> Result<Message, ProtocolError> {
        let (&tag, rest) = bytes.split_first().ok_or(ProtocolError::Empty)?;
        if !(SESSION..=CHILD_GONE).contains(&tag) {
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
        let session = reader.u64()?;
        let message = match tag {
            SESSION => Message::Session { session },
            REGION => Message::Region {
                session,
                region: reader.u32()?,
                base: reader.u64()?,
                file_offset: reader.u64()?,
                data_len: reader.u64()?,
                shape_len: reader.u64()?,
                path: String::from_utf8_lossy(reader.rest).into_owned(),
            },
            REGION_GONE => Message::RegionGone {
                session,
                region: reader.u32()?,
            },
            CHILD => {
                let child = reader.u32()?;
                let count = reader.u32()? as usize;
                if reader.rest.len() < count.saturating_mul(4) {
                    return Err(ProtocolError::Short { tag });
                }
                let regions = (0..count).map(|_| reader.u32()).collect::<Result<_, _>>()?;
                Message::Child {
                    session,
                    child,
                    regions,
                }
            }
            _ => Message::ChildGone {
                session,
                child: reader.u32()?,
            },
        };
        Ok(message)
    }
}

fn descriptors_of(tag: u8) -> usize {
    match tag {
        SESSION | CHILD => 1,
        REGION => 2,
        _ => 0,
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
        vec![
            Message::Session {
                session: 7 << 32 | 9,
            },
            Message::Region {
                session: 1,
                region: 3,
                base: 0x7f00_0000_0000,
                file_offset: 4096,
                data_len: 128 << 20,
                shape_len: (128 << 20) + 4096,
                path: "/models/m.gguf".into(),
            },
            Message::RegionGone {
                session: 1,
                region: 3,
            },
            Message::Child {
                session: 1,
                child: 17,
                regions: vec![0, 3],
            },
            Message::Child {
                session: 1,
                child: 18,
                regions: vec![],
            },
            Message::ChildGone {
                session: 1,
                child: 17,
            },
        ]
    }

    #[test]
    fn every_message_reads_back_as_written() {
        for message in all() {
            let bytes = message.encode();
            let back = Message::decode(&bytes, message.descriptors()).unwrap();
            assert_eq!(back, message);
        }
    }

    #[test]
    fn a_message_cut_short_or_with_the_wrong_descriptors_is_refused() {
        for message in all() {
            let bytes = message.encode();
            let fds = message.descriptors();
            // Cut anywhere before its fixed fields end (a region's path may be empty).
            let fixed = match message {
                Message::Region { ref path, .. } => bytes.len() - path.len(),
                _ => bytes.len(),
            };
            for len in 1..fixed {
                assert!(
                    matches!(
                        Message::decode(&bytes[..len], fds),
                        Err(ProtocolError::Short { .. })
                    ),
                    "{message:?} cut at {len}"
                );
            }
            assert!(matches!(
                Message::decode(&bytes, fds + 1),
                Err(ProtocolError::Descriptors { .. })
            ));
        }
        assert_eq!(Message::decode(&[], 0), Err(ProtocolError::Empty));
        assert_eq!(
            Message::decode(&[99, 0], 0),
            Err(ProtocolError::UnknownTag(99))
        );
    }

    #[test]
    fn a_child_claiming_more_regions_than_it_carries_is_refused() {
        let mut bytes = Message::Child {
            session: 1,
            child: 2,
            regions: vec![1],
        }
        .encode();
        // The count says a billion.
        bytes[13..17].copy_from_slice(&1_000_000_000u32.to_le_bytes());
        assert!(matches!(
            Message::decode(&bytes, 1),
            Err(ProtocolError::Short { .. })
        ));
    }
}
