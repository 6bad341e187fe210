//! How long each function of a source file is, as syn parses it: from `fn` to the
//! closing brace of its body. Test code (`#[test]` functions, items under
//! `#[cfg(test)]`) is apart: a test may spell out a long scenario.

use syn::visit::Visit;

/// A function of a source file and its length in lines.
#[derive(Debug, PartialEq, Eq)]
pub struct FunctionLength {
    pub name: String,
    /// Line of its `fn` keyword, from 1.
    pub line: usize,
    pub lines: usize,
}

/// Every function with a body in `source` (free, in an impl, a trait's default,
/// nested), test code apart.
pub fn function_lengths(source: &str) -> Result<Vec<FunctionLength>, syn::Error> {
    let file = syn::parse_file(source)?;
    let mut lengths = Lengths::default();
    lengths.visit_file(&file);
    Ok(lengths.found)
}

#[derive(Default)]
struct Lengths {
    found: Vec<FunctionLength>,
}

impl Lengths {
    fn record(&mut self, sig: &syn::Signature, body: &syn::Block) {
        let line = sig.fn_token.span.start().line;
        let end = body.brace_token.span.close().end().line;
        self.found.push(FunctionLength {
            name: sig.ident.to_string(),
            line,
            lines: end + 1 - line,
        });
    }
}

/// Whether `attrs` make an item test code: `#[test]`, or `#[cfg(test)]`.
fn is_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|attr| {
        attr.path().is_ident("test")
            || (attr.path().is_ident("cfg")
                && attr
                    .parse_args::<syn::Ident>()
                    .is_ok_and(|ident| ident == "test"))
    })
}

impl<'ast> Visit<'ast> for Lengths {
    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        if !is_test(&item.attrs) {
            syn::visit::visit_item_mod(self, item);
        }
    }

    fn visit_item_impl(&mut self, item: &'ast syn::ItemImpl) {
        if !is_test(&item.attrs) {
            syn::visit::visit_item_impl(self, item);
        }
    }

    fn visit_item_fn(&mut self, item: &'ast syn::ItemFn) {
        if !is_test(&item.attrs) {
            self.record(&item.sig, &item.block);
            syn::visit::visit_item_fn(self, item);
        }
    }

    fn visit_impl_item_fn(&mut self, item: &'ast syn::ImplItemFn) {
        if !is_test(&item.attrs) {
            self.record(&item.sig, &item.block);
            syn::visit::visit_impl_item_fn(self, item);
        }
    }

    fn visit_trait_item_fn(&mut self, item: &'ast syn::TraitItemFn) {
        if let Some(body) = &item.default {
            if !is_test(&item.attrs) {
                self.record(&item.sig, body);
            }
        }
        syn::visit::visit_trait_item_fn(self, item);
    }
}

#[test]
fn functions_are_measured_from_fn_to_their_closing_brace() {
    let source = "\
/// A doc comment is not counted.
fn three() {
    let _ = 1;
}

struct S;
impl S {
    fn one(&self) {}
}

trait T {
    fn declared(&self);
    fn defaulted(&self) {
        fn nested() {
        }
    }
}

#[cfg(test)]
mod tests {
    fn helper() {
    }
}

#[test]
fn a_test() {
}
";
    let found = function_lengths(source).expect("parses");
    let found: Vec<(&str, usize, usize)> = found
        .iter()
        .map(|f| (f.name.as_str(), f.line, f.lines))
        .collect();
    assert_eq!(
        found,
        [
            ("three", 2, 3),
            ("one", 8, 1),
            ("defaulted", 13, 4),
            ("nested", 14, 2)
        ]
    );
}
