//! The pager's userfaultfd, with the features every pager needs, and errors that say
//! why the kernel refused it.

use userfaultfd::{FeatureFlags, Uffd, UffdBuilder};

use super::PagerError;
use crate::uffd_ext;

/// The pager's userfaultfd, with `extra` features beside those always needed.
pub(super) fn create_uffd(extra: u64) -> Result<Uffd, PagerError> {
    let build = |features: u64| {
        UffdBuilder::new()
            .close_on_exec(true)
            .non_blocking(true)
            // Kernel-mode accesses (write(2) from a region, O_DIRECT into... ) must fault
            // like user accesses, not fail with EFAULT: needs root or /dev/userfaultfd.
            .user_mode_only(false)
            .require_features(FeatureFlags::from_bits_retain(features))
            .create()
    };
    let features = FeatureFlags::THREAD_ID.bits()
        | uffd_ext::FEATURE_POISON
        | uffd_ext::FEATURE_EXACT_ADDRESS
        | extra;
    match build(features) {
        Ok(uffd) => Ok(uffd),
        // The `userfaultfd` crate's errors carry its own errno type, matched by number.
        Err(userfaultfd::Error::SystemError(errno)) if errno as i32 == libc::EPERM => {
            Err(PagerError::UffdNotPermitted(errno.desc().into()))
        }
        Err(userfaultfd::Error::OpenDevUserfaultfd(error))
            if error.kind() == std::io::ErrorKind::PermissionDenied =>
        {
            Err(PagerError::UffdNotPermitted(error.to_string()))
        }
        Err(userfaultfd::Error::SystemError(errno)) if errno as i32 == libc::EINVAL => {
            // The API handshake refused the features: check whether POISON is the reason.
            match UffdBuilder::new().user_mode_only(false).create() {
                Ok(_) => Err(PagerError::UffdNoPoison),
                Err(error) => Err(PagerError::UffdUnavailable(error.to_string())),
            }
        }
        Err(error) => Err(PagerError::UffdUnavailable(error.to_string())),
    }
}
