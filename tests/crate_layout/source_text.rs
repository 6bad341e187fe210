//! A Rust source file's code as tokens, for `module_graph`: comments, string and
//! character literals taken out, and items under `#[cfg(test)]` (test modules, test
//! helpers) dropped, since unit tests may reach across modules. A small hand-written
//! scan, not a parser: it knows identifiers, `::` and single punctuation characters,
//! which is all a module path is made of.

/// One token of code.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Token {
    Ident(String),
    /// `::`
    PathSep,
    Punct(char),
}

impl Token {
    pub fn is_ident(&self, name: &str) -> bool {
        matches!(self, Token::Ident(ident) if ident == name)
    }

    pub fn ident(&self) -> Option<&str> {
        match self {
            Token::Ident(ident) => Some(ident),
            _ => None,
        }
    }
}

/// The code of `source` as tokens, with comments, literals and `#[cfg(test)]` items
/// gone.
pub fn code_tokens(source: &str) -> Vec<Token> {
    drop_test_items(tokens(&strip_comments_and_literals(source)))
}

fn is_ident_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// `source` with every comment and string, byte-string and character literal replaced
/// by a space (lifetimes and labels stay).
fn strip_comments_and_literals(source: &str) -> String {
    let chars: Vec<char> = source.chars().collect();
    let mut out = String::with_capacity(source.len());
    let mut i = 0;
    while i < chars.len() {
        let after_ident = i > 0 && is_ident_char(chars[i - 1]);
        let skip = match chars[i] {
            '/' if chars.get(i + 1) == Some(&'/') => line_comment_end(&chars, i),
            '/' if chars.get(i + 1) == Some(&'*') => block_comment_end(&chars, i),
            '"' => string_end(&chars, i + 1),
            '\'' => char_literal_end(&chars, i),
            'r' | 'b' if !after_ident => raw_string_end(&chars, i),
            _ => None,
        };
        match skip {
            Some(end) => {
                out.push(' ');
                i = end;
            }
            None => {
                out.push(chars[i]);
                i += 1;
            }
        }
    }
    out
}

fn line_comment_end(chars: &[char], start: usize) -> Option<usize> {
    Some(
        (start..chars.len())
            .find(|&i| chars[i] == '\n')
            .unwrap_or(chars.len()),
    )
}

/// Block comments nest in Rust.
fn block_comment_end(chars: &[char], start: usize) -> Option<usize> {
    let mut depth = 0;
    let mut i = start;
    while i + 1 < chars.len() {
        match (chars[i], chars[i + 1]) {
            ('/', '*') => {
                depth += 1;
                i += 2;
            }
            ('*', '/') => {
                depth -= 1;
                i += 2;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => i += 1,
        }
    }
    Some(chars.len())
}

/// The end of a quoted string whose body starts at `body` (escapes honoured).
fn string_end(chars: &[char], body: usize) -> Option<usize> {
    let mut i = body;
    while i < chars.len() {
        match chars[i] {
            '\\' => i += 2,
            '"' => return Some(i + 1),
            _ => i += 1,
        }
    }
    Some(chars.len())
}

/// `'x'`, `'\n'`, `'\u{..}'` are literals; `'a` (a lifetime or label) is not.
fn char_literal_end(chars: &[char], start: usize) -> Option<usize> {
    if chars.get(start + 1) == Some(&'\\') {
        let close = (start + 2..chars.len()).find(|&i| chars[i] == '\'')?;
        return Some(close + 1);
    }
    (chars.get(start + 2) == Some(&'\'')).then_some(start + 3)
}

/// `b"..."`, `r"..."`, `r#"..."#`, `br#"..."#` and `b'x'`.
fn raw_string_end(chars: &[char], start: usize) -> Option<usize> {
    let mut i = start;
    if chars[i] == 'b' {
        i += 1;
        match chars.get(i) {
            Some('"') => return string_end(chars, i + 1),
            Some('\'') => return char_literal_end(chars, i),
            Some('r') => {}
            _ => return None,
        }
    }
    i += 1;
    let hashes = chars[i..].iter().take_while(|&&c| c == '#').count();
    if chars.get(i + hashes) != Some(&'"') {
        return None;
    }
    let body = i + hashes + 1;
    let closing: Vec<char> = std::iter::once('"')
        .chain(std::iter::repeat_n('#', hashes))
        .collect();
    let end = (body..chars.len())
        .find(|&j| chars[j..].starts_with(&closing))
        .map_or(chars.len(), |j| j + closing.len());
    Some(end)
}

/// Identifiers (keywords included), `::` and single punctuation; numbers are dropped.
fn tokens(code: &str) -> Vec<Token> {
    let chars: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if is_ident_char(c) {
            let start = i;
            while i < chars.len() && is_ident_char(chars[i]) {
                i += 1;
            }
            if !c.is_ascii_digit() {
                out.push(Token::Ident(chars[start..i].iter().collect()));
            }
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            out.push(Token::PathSep);
            i += 2;
        } else {
            out.push(Token::Punct(c));
            i += 1;
        }
    }
    out
}

/// Whether `tokens[at..]` starts with `#[cfg(test)]`.
fn is_cfg_test(tokens: &[Token], at: usize) -> bool {
    let want = [
        Token::Punct('#'),
        Token::Punct('['),
        Token::Ident("cfg".into()),
        Token::Punct('('),
        Token::Ident("test".into()),
        Token::Punct(')'),
        Token::Punct(']'),
    ];
    tokens[at..].starts_with(&want)
}

/// The index just past the item starting at `start` (its attributes included): the
/// first `;` or braced block at bracket depth 0.
fn item_end(tokens: &[Token], start: usize) -> usize {
    let mut depth = 0usize;
    let mut i = start;
    while i < tokens.len() {
        match tokens[i] {
            Token::Punct('(' | '[') => depth += 1,
            Token::Punct(')' | ']') => depth = depth.saturating_sub(1),
            Token::Punct(';') if depth == 0 => return i + 1,
            Token::Punct('{') if depth == 0 => return block_end(tokens, i),
            _ => {}
        }
        i += 1;
    }
    tokens.len()
}

/// The index just past the braced block opening at `open`.
fn block_end(tokens: &[Token], open: usize) -> usize {
    let mut depth = 0usize;
    for (i, token) in tokens.iter().enumerate().skip(open) {
        match token {
            Token::Punct('{') => depth += 1,
            Token::Punct('}') => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
    }
    tokens.len()
}

/// `tokens` without the items `#[cfg(test)]` guards.
fn drop_test_items(tokens: Vec<Token>) -> Vec<Token> {
    let mut out = Vec::with_capacity(tokens.len());
    let mut i = 0;
    while i < tokens.len() {
        if is_cfg_test(&tokens, i) {
            i = item_end(&tokens, i + 7);
        } else {
            out.push(tokens[i].clone());
            i += 1;
        }
    }
    out
}

#[test]
fn the_scan_keeps_code_and_drops_the_rest() {
    let source = r##"
        use crate::a::b; // crate::comment
        /* crate::block /* nested */ crate::still */
        let s = "crate::string \" crate::escaped";
        let r = r#"crate::raw "# ;
        let c = '"'; let l: &'static str = x;
        #[cfg(test)]
        mod tests { use crate::tested; }
        fn f() { super::g(); }
    "##;
    let names: Vec<String> = code_tokens(source)
        .iter()
        .filter_map(|token| token.ident().map(str::to_string))
        .collect();
    assert_eq!(
        names.join(" "),
        "use crate a b let s let r let c let l static str x fn f super g"
    );
}
