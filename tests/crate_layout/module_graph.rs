//! The module dependency graph of a library crate, read from its source text (issue
//! 44): a module depends on another when its code names it in a path, `use
//! crate::a::b`, `use super::x`, `use self::child::Item` or `crate::a::b::f()` in an
//! expression. A `mod` declaration is not a dependency: it is how a parent holds its
//! children. Test code (`#[cfg(test)]` items, and so `tests.rs` files and `tests/`
//! folders) is left out, since unit tests may reach across.
//!
//! Paths resolve against the module tree built from the `mod` declarations: each
//! segment that names a child module descends into it, and the first that does not (an
//! item) ends the path at the module holding that item. A re-exported item (`pub use`)
//! therefore counts against the module that re-exports it, which itself depends on the
//! module that defines it. Names bound by `use` to a module (`use crate::sys;`, then
//! `sys::files::f()`) are followed too.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use super::source_text::{code_tokens, Token};

/// A module's path from the crate root, `"service::children"`; the root is `"crate"`.
pub type ModuleName = String;

/// One module file: its path in the tree and its code.
struct Module {
    path: Vec<String>,
    tokens: Vec<Token>,
}

/// Modules and, for each, the modules its code refers to (itself excluded).
pub struct Graph {
    pub edges: BTreeMap<ModuleName, BTreeSet<ModuleName>>,
}

pub fn name_of(path: &[String]) -> ModuleName {
    if path.is_empty() {
        "crate".to_string()
    } else {
        path.join("::")
    }
}

/// The file of module `child` declared in `parent_file` (`foo.rs` + `foo/` and
/// `foo/mod.rs` layouts).
fn child_file(parent_file: &Path, child: &str) -> PathBuf {
    let dir = parent_file.parent().expect("a source file has a folder");
    let stem = parent_file.file_stem().and_then(|stem| stem.to_str());
    let base = match stem {
        Some("lib" | "main" | "mod") => dir.to_path_buf(),
        Some(stem) => dir.join(stem),
        None => panic!("no file name: {parent_file:?}"),
    };
    let flat = base.join(format!("{child}.rs"));
    if flat.exists() {
        flat
    } else {
        base.join(child).join("mod.rs")
    }
}

/// The names of the modules `tokens` declares (`mod name;`). Inline modules outside
/// tests are not modelled, so the scan refuses them rather than misplace their paths.
fn declared_children(tokens: &[Token], file: &Path) -> Vec<String> {
    let mut children = Vec::new();
    for (i, token) in tokens.iter().enumerate() {
        let preceded_by_path_sep = i > 0 && tokens[i - 1] == Token::PathSep;
        if !token.is_ident("mod") || preceded_by_path_sep {
            continue;
        }
        let name = tokens.get(i + 1).and_then(Token::ident);
        match (name, tokens.get(i + 2)) {
            (Some(name), Some(Token::Punct(';'))) => children.push(name.to_string()),
            (Some(name), _) => panic!("{file:?}: inline module `{name}` is not modelled"),
            _ => {}
        }
    }
    children
}

/// Every module of the crate whose root is `root_file`, read from disk.
fn read_modules(root_file: &Path) -> Vec<Module> {
    let mut modules = Vec::new();
    let mut pending = vec![(Vec::new(), root_file.to_path_buf())];
    while let Some((path, file)) = pending.pop() {
        let source =
            std::fs::read_to_string(&file).unwrap_or_else(|error| panic!("{file:?}: {error}"));
        let tokens = code_tokens(&source);
        for child in declared_children(&tokens, &file) {
            let mut child_path: Vec<String> = path.clone();
            child_path.push(child.clone());
            pending.push((child_path, child_file(&file, &child)));
        }
        modules.push(Module { path, tokens });
    }
    modules
}

/// Resolves paths written in one module.
struct Resolver<'a> {
    known: &'a BTreeSet<Vec<String>>,
    here: &'a [String],
    /// Names bound by `use` to a module.
    aliases: BTreeMap<String, Vec<String>>,
}

impl Resolver<'_> {
    /// The module `segments` starts from, and how many segments that took; None for a
    /// path outside the crate (`std::...`) or starting at a local item.
    fn start(&self, segments: &[String]) -> Option<(Vec<String>, usize)> {
        let first = segments.first()?;
        if first == "crate" {
            return Some((Vec::new(), 1));
        }
        if first == "self" {
            return Some((self.here.to_vec(), 1));
        }
        if first == "super" {
            let supers = segments
                .iter()
                .take_while(|segment| *segment == "super")
                .count();
            let kept = self
                .here
                .len()
                .checked_sub(supers)
                .expect("super past the root");
            return Some((self.here[..kept].to_vec(), supers));
        }
        let mut child = self.here.to_vec();
        child.push(first.clone());
        if self.known.contains(&child) {
            return Some((child, 1));
        }
        self.aliases.get(first).map(|module| (module.clone(), 1))
    }

    /// The module `segments` ends in, and whether every segment named a module.
    fn resolve(&self, segments: &[String]) -> Option<(Vec<String>, bool)> {
        let (mut module, used) = self.start(segments)?;
        for segment in &segments[used..] {
            if segment == "self" {
                break;
            }
            module.push(segment.clone());
            if !self.known.contains(&module) {
                module.pop();
                return Some((module, false));
            }
        }
        Some((module, true))
    }
}

/// The paths of the `use` tree at `tokens[at..]`, each with the name it binds; returns
/// the index past the tree.
fn use_tree(
    tokens: &[Token],
    mut at: usize,
    prefix: &[String],
    out: &mut Vec<(Vec<String>, String)>,
) -> usize {
    let mut path = prefix.to_vec();
    if tokens.get(at) == Some(&Token::PathSep) {
        return skip_to_tree_end(tokens, at); // `::std::...`: outside the crate
    }
    loop {
        match tokens.get(at) {
            Some(Token::Ident(ident)) => path.push(ident.clone()),
            Some(Token::Punct('{')) => {
                at += 1;
                while tokens.get(at) != Some(&Token::Punct('}')) {
                    at = use_tree(tokens, at, &path, out);
                    if tokens.get(at) == Some(&Token::Punct(',')) {
                        at += 1;
                    }
                }
                return at + 1;
            }
            Some(Token::Punct('*')) => {
                out.push((path, String::new()));
                return at + 1;
            }
            _ => panic!(
                "unexpected token in a use tree at {at}: {:?}",
                tokens.get(at)
            ),
        }
        at += 1;
        if tokens.get(at) == Some(&Token::PathSep) {
            at += 1;
            continue;
        }
        let mut bound = path.last().cloned().unwrap_or_default();
        if bound == "self" && path.len() > 1 {
            bound = path[path.len() - 2].clone();
        }
        if tokens.get(at).is_some_and(|token| token.is_ident("as")) {
            bound = tokens
                .get(at + 1)
                .and_then(Token::ident)
                .unwrap_or("_")
                .to_string();
            at += 2;
        }
        out.push((path, bound));
        return at;
    }
}

/// The index of the `,`, `}` or `;` that ends the tree at `at`, nested braces skipped.
fn skip_to_tree_end(tokens: &[Token], mut at: usize) -> usize {
    let mut depth = 0usize;
    while let Some(token) = tokens.get(at) {
        match token {
            Token::Punct('{') => depth += 1,
            Token::Punct('}') if depth == 0 => return at,
            Token::Punct('}') => depth -= 1,
            Token::Punct(',' | ';') if depth == 0 => return at,
            _ => {}
        }
        at += 1;
    }
    at
}

/// The path of segments starting at `tokens[at]`: `a::b::c` (stops at `::<` and `::{`).
fn path_at(tokens: &[Token], mut at: usize) -> Vec<String> {
    let mut segments = Vec::new();
    while let Some(ident) = tokens.get(at).and_then(Token::ident) {
        segments.push(ident.to_string());
        if tokens.get(at + 1) != Some(&Token::PathSep) {
            break;
        }
        at += 2;
    }
    segments
}

/// Whether the path at `at` is a visibility, `pub(in crate::a)`, not a reference.
fn is_visibility(tokens: &[Token], at: usize) -> bool {
    at >= 2 && tokens[at - 1].is_ident("in") && tokens[at - 2] == Token::Punct('(')
}

/// The modules `module`'s code refers to.
fn references(module: &Module, known: &BTreeSet<Vec<String>>) -> BTreeSet<Vec<String>> {
    let tokens = &module.tokens;
    let mut resolver = Resolver {
        known,
        here: &module.path,
        aliases: BTreeMap::new(),
    };
    let mut found = BTreeSet::new();
    let mut uses = Vec::new();
    let mut in_use = vec![false; tokens.len()];
    for (i, token) in tokens.iter().enumerate() {
        if token.is_ident("use") {
            let end = use_tree(tokens, i + 1, &[], &mut uses);
            in_use[i..end.min(tokens.len())].fill(true);
        }
    }
    for (path, bound) in &uses {
        if let Some((target, whole)) = resolver.resolve(path) {
            if whole && !bound.is_empty() {
                resolver.aliases.insert(bound.clone(), target.clone());
            }
            found.insert(target);
        }
    }
    for i in (0..tokens.len()).filter(|&i| !in_use[i]) {
        let starts_path = tokens.get(i + 1) == Some(&Token::PathSep)
            && (i == 0 || !matches!(tokens[i - 1], Token::PathSep | Token::Punct('$')));
        if starts_path && tokens[i].ident().is_some() && !is_visibility(tokens, i) {
            if let Some((target, _)) = resolver.resolve(&path_at(tokens, i)) {
                found.insert(target);
            }
        }
    }
    found.remove(&module.path);
    found
}

/// The graph of the crate whose root file is `root_file`.
pub fn read_graph(root_file: &Path) -> Graph {
    let modules = read_modules(root_file);
    let known: BTreeSet<Vec<String>> = modules.iter().map(|module| module.path.clone()).collect();
    let edges = modules
        .iter()
        .map(|module| {
            let targets = references(module, &known)
                .iter()
                .map(|target| name_of(target))
                .collect();
            (name_of(&module.path), targets)
        })
        .collect();
    Graph { edges }
}
