//! Whether a remote answer belongs to the version of the object a mount opened.
//!
//! A mount reads each object's ETag once (HEAD) and asks for every range with
//! `If-Match: <that ETag>`. A store that honours it answers 412 when the object changed;
//! one that ignores it still sends the ETag of what it served, which is compared too, so
//! bytes of another version are never passed on. Pure.

/// The verdict on one ranged answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The bytes are of the version opened.
    Same,
    /// The object changed since it was opened: the read fails.
    Changed {
        /// The ETag the mount opened.
        opened: String,
        /// The ETag the store answered with, if it said one.
        now: Option<String>,
    },
}

/// An ETag as compared: without a weak marker (`W/`) and surrounding quotes. S3 and
/// nginx send strong ETags; a store that weakens one on the way (a compressing proxy)
/// still names the same version.
pub fn normalize(etag: &str) -> &str {
    let etag = etag.trim();
    let etag = etag.strip_prefix("W/").unwrap_or(etag);
    etag.strip_prefix('"')
        .and_then(|e| e.strip_suffix('"'))
        .unwrap_or(etag)
}

/// Judges an answer: `precondition_failed` when the store answered 412 to `If-Match`,
/// `answered` the ETag on a successful answer (None when it sent none, which is taken
/// as the same version: the store then could only have checked `If-Match` itself).
pub fn judge(opened: &str, precondition_failed: bool, answered: Option<&str>) -> Verdict {
    let changed =
        precondition_failed || answered.is_some_and(|now| normalize(now) != normalize(opened));
    if changed {
        Verdict::Changed {
            opened: opened.to_string(),
            now: answered.map(str::to_string),
        }
    } else {
        Verdict::Same
    }
}

/// The name under which a version of an object is cached: ETags name versions (with
/// the size, which a version also fixes), and a different ETag is a different cache
/// entry. A mount refuses an object without an ETag: it could not tell versions apart.
pub fn version_key(etag: &str, size: u64) -> String {
    format!("{}:{size}", normalize(etag))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etags_compare_without_quotes_and_weak_markers() {
        assert_eq!(normalize("\"abc\""), "abc");
        assert_eq!(normalize("W/\"abc\""), "abc");
        assert_eq!(normalize(" abc "), "abc");
        assert_eq!(judge("\"abc\"", false, Some("W/\"abc\"")), Verdict::Same);
    }

    #[test]
    fn a_412_or_another_etag_is_a_change() {
        assert_eq!(
            judge("\"a\"", true, None),
            Verdict::Changed {
                opened: "\"a\"".into(),
                now: None
            }
        );
        assert_eq!(
            judge("\"a\"", false, Some("\"b\"")),
            Verdict::Changed {
                opened: "\"a\"".into(),
                now: Some("\"b\"".into())
            }
        );
        assert_eq!(judge("\"a\"", false, None), Verdict::Same);
    }

    #[test]
    fn versions_are_keyed_by_etag_and_size() {
        assert_eq!(version_key("\"x-1\"", 5), "x-1:5");
        assert_ne!(version_key("\"x\"", 5), version_key("\"y\"", 5));
        assert_ne!(version_key("\"x\"", 5), version_key("\"x\"", 6));
    }
}
