//! Shell-style wildcard matching (`*`, `?`, `[a-z]`, `[!x]`) on byte strings, for the
//! shim's file-name patterns. Written out rather than calling fnmatch(3) so that the
//! decision runs without allocating a C string inside an interposed `mmap`.

/// Whether `name` matches `pattern` as a whole. `*` and `?` match any bytes, `/`
/// included: patterns are matched against a file name, or a whole path when they
/// contain a `/`.
pub fn glob_match(pattern: &[u8], name: &[u8]) -> bool {
    let (mut p, mut n) = (0, 0);
    // Where to resume after the last `*`: (pattern index after it, name index it covers up to).
    let mut backtrack: Option<(usize, usize)> = None;
    while n < name.len() {
        let step = match pattern.get(p) {
            Some(b'*') => {
                backtrack = Some((p + 1, n));
                p += 1;
                continue;
            }
            Some(b'?') => Some(p + 1),
            Some(b'[') => match class_match(&pattern[p..], name[n]) {
                Some((true, used)) => Some(p + used),
                Some((false, _)) => None,
                // An unterminated `[` is a literal.
                None => (name[n] == b'[').then_some(p + 1),
            },
            Some(&literal) => (literal == name[n]).then_some(p + 1),
            None => None,
        };
        match (step, backtrack) {
            (Some(next), _) => {
                p = next;
                n += 1;
            }
            (None, Some((star_p, star_n))) => {
                backtrack = Some((star_p, star_n + 1));
                p = star_p;
                n = star_n + 1;
            }
            (None, None) => return false,
        }
    }
    pattern[p..].iter().all(|&byte| byte == b'*')
}

/// Matches one byte against the class at the start of `class` (`[...]`). Returns whether
/// it matched and the class's length, or `None` if the class is not terminated.
fn class_match(class: &[u8], byte: u8) -> Option<(bool, usize)> {
    let mut i = 1;
    let negated = matches!(class.get(i), Some(b'!') | Some(b'^'));
    if negated {
        i += 1;
    }
    let mut matched = false;
    let mut first = true;
    loop {
        let &c = class.get(i)?;
        if c == b']' && !first {
            return Some((matched != negated, i + 1));
        }
        first = false;
        if class.get(i + 1) == Some(&b'-') && class.get(i + 2).is_some_and(|&end| end != b']') {
            let end = class[i + 2];
            matched |= (c..=end).contains(&byte);
            i += 3;
        } else {
            matched |= c == byte;
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::glob_match;

    fn m(pattern: &str, name: &str) -> bool {
        glob_match(pattern.as_bytes(), name.as_bytes())
    }

    #[test]
    fn stars_and_literals() {
        assert!(m("*.gguf", "model.gguf"));
        assert!(m("*.gguf", ".gguf"));
        assert!(!m("*.gguf", "model.gguf.part"));
        assert!(!m("*.gguf", "model.safetensors"));
        assert!(m(
            "model-*-of-*.safetensors",
            "model-00001-of-00002.safetensors"
        ));
        assert!(m("*", ""));
        assert!(m("a*b*c", "aXXbYYbZc"));
        assert!(!m("a*b*c", "aXXbYYbZ"));
        assert!(m("exact", "exact"));
        assert!(!m("exact", "exactly"));
    }

    #[test]
    fn question_marks_and_classes() {
        assert!(m("f?.bin", "f1.bin"));
        assert!(!m("f?.bin", "f.bin"));
        assert!(m("shard[0-9].bin", "shard7.bin"));
        assert!(!m("shard[0-9].bin", "shardx.bin"));
        assert!(m("shard[!0-9].bin", "shardx.bin"));
        assert!(m("[]]", "]"));
        assert!(m("a[", "a["));
    }
}
