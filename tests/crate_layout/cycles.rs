//! Cycles in a `module_graph::Graph`: strongly connected components of more than one
//! module, in the whole graph and among the children of each module (a folder's
//! files, each standing for itself and everything below it).

use std::collections::{BTreeMap, BTreeSet};

use super::module_graph::{Graph, ModuleName};

/// A set of modules each of which reaches every other through references.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Cycle {
    /// `"crate"` for the whole graph, else the module whose children these are.
    pub among: ModuleName,
    pub members: BTreeSet<ModuleName>,
}

impl std::fmt::Display for Cycle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let members: Vec<&str> = self.members.iter().map(String::as_str).collect();
        write!(f, "[{}] {{{}}}", self.among, members.join(", "))
    }
}

type Edges = BTreeMap<ModuleName, BTreeSet<ModuleName>>;

/// Every node `from` reaches (itself included).
fn reachable(edges: &Edges, from: &str) -> BTreeSet<ModuleName> {
    let mut seen = BTreeSet::from([from.to_string()]);
    let mut pending = vec![from.to_string()];
    while let Some(node) = pending.pop() {
        for next in edges.get(&node).into_iter().flatten() {
            if seen.insert(next.clone()) {
                pending.push(next.clone());
            }
        }
    }
    seen
}

/// The strongly connected components of `edges` with more than one node (the graphs
/// here have a few hundred nodes, so a reachability set per node is plenty).
fn components(edges: &Edges) -> BTreeSet<BTreeSet<ModuleName>> {
    let reach: BTreeMap<&ModuleName, BTreeSet<ModuleName>> = edges
        .keys()
        .map(|node| (node, reachable(edges, node)))
        .collect();
    reach
        .iter()
        .map(|(node, reached)| {
            reached
                .iter()
                .filter(|other| reach.get(other).is_some_and(|back| back.contains(*node)))
                .cloned()
                .collect::<BTreeSet<_>>()
        })
        .filter(|component| component.len() > 1)
        .collect()
}

/// The child of `parent` that `module` is or lies under; None if it is not below.
fn child_under<'a>(parent: &str, module: &'a str) -> Option<&'a str> {
    let rest = if parent == "crate" {
        module
    } else {
        module.strip_prefix(parent)?.strip_prefix("::")?
    };
    (rest != "crate").then(|| rest.split("::").next().unwrap_or(rest))
}

/// The graph among `parent`'s children, each standing for its whole subtree.
fn among_children(graph: &Graph, parent: &str) -> Edges {
    let mut edges = Edges::new();
    for (from, targets) in &graph.edges {
        let Some(from_child) = child_under(parent, from) else {
            continue;
        };
        let entry = edges.entry(from_child.to_string()).or_default();
        for target in targets {
            if let Some(to_child) = child_under(parent, target) {
                if to_child != from_child {
                    entry.insert(to_child.to_string());
                }
            }
        }
    }
    edges
}

/// The cycles of the whole graph and those among each module's children.
pub fn cycles(graph: &Graph) -> BTreeSet<Cycle> {
    let whole = components(&graph.edges).into_iter().map(|members| Cycle {
        among: "crate".to_string(),
        members,
    });
    let folders = graph.edges.keys().flat_map(|parent| {
        components(&among_children(graph, parent))
            .into_iter()
            .map(move |members| Cycle {
                among: format!("{parent}::*"),
                members,
            })
    });
    whole.chain(folders).collect()
}

/// The references among `cycle`'s members, for a failure's message.
pub fn references_within(graph: &Graph, cycle: &Cycle) -> Vec<String> {
    let below = |module: &str| {
        if cycle.among == "crate" {
            cycle.members.contains(module).then(|| module.to_string())
        } else {
            let parent = cycle.among.trim_end_matches("::*");
            child_under(parent, module)
                .filter(|child| cycle.members.contains(*child))
                .map(str::to_string)
        }
    };
    let mut lines = Vec::new();
    for (from, targets) in &graph.edges {
        for target in targets {
            if let (Some(a), Some(b)) = (below(from), below(target)) {
                if a != b {
                    lines.push(format!("{from} -> {target}"));
                }
            }
        }
    }
    lines
}
