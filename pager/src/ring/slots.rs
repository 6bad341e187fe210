//! The ring's read slots: which buffer is free, handed out, being written by the kernel
//! or back with its owner, and the tag each read carries. Pure bookkeeping; the state of
//! a slot is what decides whether its buffer may be touched (see `ring`).

/// What a slot (a buffer and the read it carries) is doing.
enum Slot<Tag> {
    /// In the free list.
    Free,
    /// Handed out by `checkout`, no read issued yet: its owner may use the buffer.
    Claimed,
    /// A read was issued: the kernel may be writing the buffer.
    InFlight(Tag),
    /// The read's completion was reaped: the buffer is the owner's again.
    Done(Tag),
}

/// A slot's state without its tag, for panic messages.
struct SlotName<'a, Tag>(&'a Slot<Tag>);

impl<Tag> std::fmt::Debug for SlotName<'_, Tag> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            Slot::Free => "free",
            Slot::Claimed => "claimed",
            Slot::InFlight(_) => "in flight",
            Slot::Done(_) => "reaped",
        })
    }
}

/// Every slot's state, slots numbered from 0 and allocated lazily, in order, up to a
/// limit.
pub(super) struct ReadSlots<Tag> {
    /// Slots handed out so far.
    allocated: u32,
    slots: Vec<Slot<Tag>>,
    free: Vec<u32>,
    max_slots: u32,
}

impl<Tag> ReadSlots<Tag> {
    pub(super) fn new(max_slots: u32) -> Self {
        Self {
            allocated: 0,
            slots: Vec::new(),
            free: Vec::new(),
            max_slots,
        }
    }

    /// Reads issued and not yet checked in (in flight, or reaped and still held).
    pub(super) fn issued(&self) -> usize {
        self.slots
            .iter()
            .filter(|slot| matches!(slot, Slot::InFlight(_) | Slot::Done(_)))
            .count()
    }

    /// Reads issued whose completions have not been reaped yet.
    pub(super) fn in_flight(&self) -> usize {
        self.slots
            .iter()
            .filter(|slot| matches!(slot, Slot::InFlight(_)))
            .count()
    }

    /// Whether `checkout` would find a slot.
    pub(super) fn has_free(&self) -> bool {
        !self.free.is_empty() || self.allocated < self.max_slots
    }

    /// A free slot, allocating one lazily up to the limit.
    pub(super) fn checkout(&mut self) -> Option<u32> {
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None if self.allocated < self.max_slots => {
                self.allocated += 1;
                self.slots.push(Slot::Free);
                self.allocated - 1
            }
            None => return None,
        };
        self.slots[slot as usize] = Slot::Claimed;
        Some(slot)
    }

    /// Frees a slot whose read was reaped (or never issued), returning its tag.
    ///
    /// # Panics
    /// If the slot's read is in flight or the slot is already free.
    pub(super) fn checkin(&mut self, slot: u32) -> Option<Tag> {
        let tag = match std::mem::replace(&mut self.slots[slot as usize], Slot::Free) {
            Slot::Claimed => None,
            Slot::Done(tag) => Some(tag),
            other => panic!("slot {slot} checked in while {:?}", SlotName(&other)),
        };
        self.free.push(slot);
        tag
    }

    /// Takes the tag back from a slot whose read was reaped, keeping the slot claimed.
    ///
    /// # Panics
    /// If the slot's read is not reaped.
    pub(super) fn reclaim(&mut self, slot: u32) -> Tag {
        match std::mem::replace(&mut self.slots[slot as usize], Slot::Claimed) {
            Slot::Done(tag) => tag,
            other => panic!(
                "slot {slot} reclaimed while {other:?}",
                other = SlotName(&other)
            ),
        }
    }

    /// A read carrying `tag` is issued into `slot`: from now on the kernel may write
    /// its buffer.
    ///
    /// # Panics
    /// If the slot is free or its read in flight.
    pub(super) fn issue(&mut self, slot: u32, tag: Tag) {
        let state = &mut self.slots[slot as usize];
        assert!(
            matches!(state, Slot::Claimed | Slot::Done(_)),
            "read issued into slot {slot} while {:?}",
            SlotName(state)
        );
        *state = Slot::InFlight(tag);
    }

    /// The completion of `slot`'s read was reaped: its buffer is the owner's again.
    ///
    /// # Panics
    /// If no read of the slot is in flight: a completion the ring never asked for.
    pub(super) fn reaped(&mut self, slot: u32) {
        let state = &mut self.slots[slot as usize];
        *state = match std::mem::replace(state, Slot::Free) {
            Slot::InFlight(tag) => Slot::Done(tag),
            other => {
                unreachable!("completion for slot {slot} while {:?}", SlotName(&other))
            }
        };
    }

    /// The tag of the read `slot` carries (in flight or reaped).
    pub(super) fn tag(&self, slot: u32) -> Option<&Tag> {
        match &self.slots[slot as usize] {
            Slot::InFlight(tag) | Slot::Done(tag) => Some(tag),
            Slot::Free | Slot::Claimed => None,
        }
    }

    pub(super) fn tag_mut(&mut self, slot: u32) -> Option<&mut Tag> {
        match &mut self.slots[slot as usize] {
            Slot::InFlight(tag) | Slot::Done(tag) => Some(tag),
            Slot::Free | Slot::Claimed => None,
        }
    }

    /// Panics unless `slot`'s owner may touch its buffer: claimed, or its read reaped.
    pub(super) fn check_owned(&self, slot: u32) {
        let state = &self.slots[slot as usize];
        if !matches!(state, Slot::Claimed | Slot::Done(_)) {
            panic!("buffer of slot {slot} used while {:?}", SlotName(state));
        }
    }
}
