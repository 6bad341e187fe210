//! What the service tells the keeper (`crate::keeper`): each file-shaped region as it
//! is added and when it is forgotten, each forked child's userfaultfd as it is adopted
//! and when the child is gone. Nothing here when there is no keeper.

use std::os::fd::AsFd;

use userfaultfd::Uffd;

use super::region::ServedRegion;
use super::FaultService;
use crate::keeper::protocol::Message;
use crate::policy::RegionId;

impl FaultService {
    pub(super) fn tell_keeper_region(&mut self, id: RegionId, region: &ServedRegion) {
        let (Some(link), Some(shape)) = (&mut self.keeper, &region.shape) else {
            return;
        };
        let geometry = &region.layout.geometry;
        let message = Message::Region {
            session: link.session(),
            region: id.0,
            base: region.base as u64,
            file_offset: geometry.file_offset,
            data_len: geometry.data_len,
            shape_len: region.shape_len,
            path: region.file.path().display().to_string(),
        };
        link.send(message, &[shape.as_fd(), region.file.buffered()]);
    }

    pub(super) fn tell_keeper_region_gone(&mut self, id: RegionId) {
        if let Some(link) = &mut self.keeper {
            let message = Message::RegionGone {
                session: link.session(),
                region: id.0,
            };
            link.send(message, &[]);
        }
    }

    /// Hands child `number`'s userfaultfd (`Watch::Child`) to the keeper.
    pub(super) fn tell_keeper_child(&mut self, number: u32, uffd: &Uffd) {
        let Some(link) = &mut self.keeper else {
            return;
        };
        let regions = self
            .regions
            .iter()
            .filter(|(_, region)| !region.removed && region.shape.is_some())
            .map(|(id, _)| id.0)
            .collect();
        let message = Message::Child {
            session: link.session(),
            child: number,
            regions,
        };
        link.send(message, &[uffd.as_fd()]);
    }

    pub(super) fn tell_keeper_child_gone(&mut self, number: u32) {
        if let Some(link) = &mut self.keeper {
            let message = Message::ChildGone {
                session: link.session(),
                child: number,
            };
            link.send(message, &[]);
        }
    }
}
