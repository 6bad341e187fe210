//! Reading the little-endian fields of the messages the pager's services exchange over
//! sockets (`keeper::protocol`, `share::protocol`): each protocol decodes its messages
//! with a `Reader` and turns `Short` into its own error.

/// A message ended before the field being read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Short {
    /// The message's tag (its first byte), for the error.
    pub tag: u8,
}

/// The fields of one message after its tag, read front to back.
pub(crate) struct Reader<'a> {
    /// What is left to read.
    pub rest: &'a [u8],
    pub tag: u8,
}

impl Reader<'_> {
    pub fn take<const N: usize>(&mut self) -> Result<[u8; N], Short> {
        if self.rest.len() < N {
            return Err(Short { tag: self.tag });
        }
        let (head, rest) = self.rest.split_at(N);
        self.rest = rest;
        Ok(head.try_into().expect("N bytes"))
    }

    pub fn u64(&mut self) -> Result<u64, Short> {
        self.take::<8>().map(u64::from_le_bytes)
    }

    pub fn u32(&mut self) -> Result<u32, Short> {
        self.take::<4>().map(u32::from_le_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_read_in_order_and_a_short_message_names_its_tag() {
        let bytes = [1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 9];
        let mut reader = Reader {
            rest: &bytes,
            tag: 5,
        };
        assert_eq!(reader.u32(), Ok(1));
        assert_eq!(reader.u64(), Ok(2));
        assert_eq!(reader.u32(), Err(Short { tag: 5 }));
        assert_eq!(reader.take::<1>(), Ok([9]));
        assert!(reader.rest.is_empty());
    }
}
