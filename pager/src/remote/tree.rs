//! The directory tree a mount shows: object names (`a/b.gguf`) as files under
//! directories, with inode numbers. Pure.

use std::collections::BTreeMap;

use super::source::{check_name, SourceError};

/// The root directory's inode number (FUSE's).
pub const ROOT: u64 = 1;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// A directory and its entries by name.
    Dir(BTreeMap<String, u64>),
    /// A file: the object's number in the list given to `build`.
    File(usize),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub parent: u64,
    pub kind: Kind,
}

/// Inodes from `ROOT` on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tree {
    nodes: Vec<Node>,
}

impl Tree {
    /// The tree of `names` (object `i` is `names[i]`).
    pub fn build<S: AsRef<str>>(names: &[S]) -> Result<Self, SourceError> {
        let mut tree = Self {
            nodes: vec![Node {
                parent: ROOT,
                kind: Kind::Dir(BTreeMap::new()),
            }],
        };
        for (object, name) in names.iter().enumerate() {
            let name = name.as_ref();
            check_name(name)?;
            let clash = || SourceError::Clash(name.to_string());
            let parts: Vec<&str> = name.split('/').collect();
            let mut dir = ROOT;
            for (i, part) in parts.iter().enumerate() {
                let last = i == parts.len() - 1;
                let existing = match &tree.node(dir).unwrap().kind {
                    Kind::Dir(entries) => entries.get(*part).copied(),
                    Kind::File(_) => return Err(clash()),
                };
                dir = match (existing, last) {
                    (Some(_), true) => return Err(clash()),
                    (Some(ino), false) => ino,
                    (None, _) => {
                        let kind = if last {
                            Kind::File(object)
                        } else {
                            Kind::Dir(BTreeMap::new())
                        };
                        tree.nodes.push(Node { parent: dir, kind });
                        let ino = tree.nodes.len() as u64;
                        match &mut tree.nodes[(dir - ROOT) as usize].kind {
                            Kind::Dir(entries) => entries.insert(part.to_string(), ino),
                            Kind::File(_) => unreachable!(),
                        };
                        ino
                    }
                };
            }
        }
        Ok(tree)
    }

    pub fn node(&self, ino: u64) -> Option<&Node> {
        self.nodes.get(ino.checked_sub(ROOT)? as usize)
    }

    /// The entry `name` of directory `dir`.
    pub fn lookup(&self, dir: u64, name: &str) -> Option<u64> {
        match &self.node(dir)?.kind {
            Kind::Dir(entries) => entries.get(name).copied(),
            Kind::File(_) => None,
        }
    }

    /// The inode of object `object`'s file.
    pub fn file_inode(&self, object: usize) -> Option<u64> {
        self.nodes
            .iter()
            .position(|node| node.kind == Kind::File(object))
            .map(|i| i as u64 + ROOT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_become_directories_and_files() {
        let tree = Tree::build(&["m.gguf", "sub/a.safetensors", "sub/b.safetensors"]).unwrap();
        let m = tree.lookup(ROOT, "m.gguf").unwrap();
        assert_eq!(tree.node(m).unwrap().kind, Kind::File(0));
        let sub = tree.lookup(ROOT, "sub").unwrap();
        let b = tree.lookup(sub, "b.safetensors").unwrap();
        assert_eq!(tree.node(b).unwrap().kind, Kind::File(2));
        assert_eq!(tree.node(b).unwrap().parent, sub);
        assert_eq!(tree.file_inode(1), tree.lookup(sub, "a.safetensors"));
        assert_eq!(tree.lookup(m, "x"), None);
        assert_eq!(tree.lookup(ROOT, "nope"), None);
        assert!(tree.node(0).is_none() && tree.node(99).is_none());
    }

    #[test]
    fn clashes_and_bad_names_are_refused() {
        let refused = |names: &[&str]| Tree::build(names).err();
        assert_eq!(refused(&["a", "a"]), Some(SourceError::Clash("a".into())));
        assert_eq!(
            refused(&["a", "a/b"]),
            Some(SourceError::Clash("a/b".into()))
        );
        assert_eq!(refused(&["a/b", "a"]), Some(SourceError::Clash("a".into())));
        assert_eq!(
            refused(&["../x"]),
            Some(SourceError::BadName("../x".into()))
        );
    }
}
