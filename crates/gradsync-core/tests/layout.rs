//! The layout of the whole workspace's Rust sources: files stay short, and the files of a crate
//! import one another without cycles.
//!
//! # Files
//!
//! No `.rs` file under `crates/*/src`, `crates/*/tests` or `crates/*/benches` has more than
//! [`MAX_LINES`] lines.
//!
//! # Import cycles
//!
//! For every crate root (`src/lib.rs`, `src/main.rs`, `src/bin/*.rs`, `tests/*.rs`,
//! `benches/*.rs`) the test builds the tree of its modules from the `mod x;` declarations and a
//! graph of its files, with an edge from file A to file B when:
//!
//! - A declares `mod b;` (a parent depends on its children), or
//! - A names a path that resolves into B: a `use` (`use crate::..`, `use super::..`,
//!   `use self::..`, or a path that starts with a child module, re-exports included) or a path
//!   in code (`crate::a::b`, `super::x`, `self::m::f`).
//!
//! A path resolves to the deepest module file it walks through: `crate::schedule::plan::build`
//! is an edge to `schedule/plan.rs`, `super::Op` to the parent's file, wherever `Op` is defined:
//! an item imported through a parent `mod.rs` is an edge to that `mod.rs`, so a child that takes
//! anything from its parent closes a cycle with it. The crate root is the one exception: a name
//! it imports or re-exports (`pub use types::DataType` makes `crate::DataType`) resolves
//! through that import to the module that defines it, since every module of a crate is declared
//! in its root and `crate::Name` is how Rust spells the crate's own public names; an item
//! *defined* in the root is an edge to the root.
//!
//! Inline modules (`mod field { .. }`) belong to their file, and `super::` inside them climbs
//! through them first. Test-only code is left out: items under `#[cfg(test)]` (so the
//! `#[cfg(test)] mod tests;` files and everything below them). `macro_rules!` bodies are skipped
//! (their paths resolve where the macro is used). Cycles are reported per crate as strongly
//! connected sets of files, with the edges between them and where each comes from.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

/// The workspace root.
const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");

/// Longest a source file may be, in lines.
const MAX_LINES: usize = 1200;

fn root() -> PathBuf {
    fs::canonicalize(ROOT).expect("the workspace root exists")
}

fn rel(p: &Path) -> String {
    p.strip_prefix(root()).unwrap_or(p).display().to_string()
}

/// The crate directories: `crates/*` with a `Cargo.toml`.
fn crates() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(root().join("crates"))
        .expect("crates/ is readable")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.join("Cargo.toml").is_file())
        .collect();
    v.sort();
    v
}

/// Every `.rs` file below `dir`, sorted.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let mut paths: Vec<PathBuf> = entries
        .map(|e| e.expect("a directory entry").path())
        .collect();
    paths.sort();
    for p in paths {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn no_source_file_is_too_long() {
    let mut long = Vec::new();
    let mut files = 0;
    for krate in crates() {
        let mut all = Vec::new();
        for sub in ["src", "tests", "benches"] {
            rust_files(&krate.join(sub), &mut all);
        }
        for f in all {
            files += 1;
            let lines = fs::read_to_string(&f)
                .expect("a readable file")
                .lines()
                .count();
            if lines > MAX_LINES {
                long.push(format!("{:>6} lines  {}", lines, rel(&f)));
            }
        }
    }
    assert!(
        files > 50,
        "found only {files} source files under {}",
        root().display()
    );
    assert!(
        long.is_empty(),
        "{} file(s) longer than {MAX_LINES} lines:\n{}",
        long.len(),
        long.join("\n")
    );
}

// ---- lexing ------------------------------------------------------------------------------------

#[derive(Clone, Debug, PartialEq, Eq)]
enum Tok {
    Ident(String),
    /// `::`
    Sep,
    Punct(char),
}

/// The tokens of Rust source that matter here, with their lines: identifiers, `::` and
/// punctuation; comments, strings, characters and numbers are dropped.
fn lex(src: &str) -> Vec<(Tok, usize)> {
    let c: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    let at = |k: usize| c.get(k).copied().unwrap_or('\0');
    // Skips a quoted string starting at the quote `i`; returns the index after it.
    let skip_str = |mut k: usize, line: &mut usize| {
        k += 1;
        while k < c.len() && c[k] != '"' {
            if c[k] == '\\' {
                k += 1;
            }
            if at(k) == '\n' {
                *line += 1;
            }
            k += 1;
        }
        k + 1
    };
    // Skips a raw string whose `#`s start at `k`; returns the index after it.
    let skip_raw = |mut k: usize, line: &mut usize| {
        let mut hashes = 0;
        while at(k) == '#' {
            hashes += 1;
            k += 1;
        }
        k += 1; // the opening quote
        loop {
            if k >= c.len() {
                return k;
            }
            if c[k] == '\n' {
                *line += 1;
            }
            if c[k] == '"' && (1..=hashes).all(|h| at(k + h) == '#') {
                return k + 1 + hashes;
            }
            k += 1;
        }
    };
    while i < c.len() {
        let ch = c[i];
        match ch {
            '\n' => {
                line += 1;
                i += 1;
            }
            _ if ch.is_whitespace() => i += 1,
            '/' if at(i + 1) == '/' => {
                while i < c.len() && c[i] != '\n' {
                    i += 1;
                }
            }
            '/' if at(i + 1) == '*' => {
                let mut depth = 0;
                loop {
                    if i >= c.len() {
                        break;
                    }
                    if c[i] == '/' && at(i + 1) == '*' {
                        depth += 1;
                        i += 2;
                    } else if c[i] == '*' && at(i + 1) == '/' {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        if c[i] == '\n' {
                            line += 1;
                        }
                        i += 1;
                    }
                }
            }
            '"' => i = skip_str(i, &mut line),
            '\'' => {
                // A character literal ('x', '\n', '\u{..}') or a lifetime or label ('a).
                if at(i + 1) == '\\' {
                    i += 2;
                    while i < c.len() && c[i] != '\'' {
                        i += 1;
                    }
                    i += 1;
                } else if at(i + 2) == '\'' {
                    i += 3;
                } else {
                    i += 1;
                }
            }
            _ if ch.is_ascii_digit() => {
                while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                    i += 1;
                }
            }
            _ if ch.is_alphabetic() || ch == '_' => {
                let start = i;
                while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                    i += 1;
                }
                let word: String = c[start..i].iter().collect();
                let next = at(i);
                match word.as_str() {
                    "r" | "br" | "cr" if next == '"' || (next == '#' && at(i + 1) == '"') => {
                        i = skip_raw(i, &mut line);
                    }
                    "r" if next == '#' && (at(i + 1).is_alphabetic() || at(i + 1) == '_') => {
                        // A raw identifier, `r#type`.
                        let s = i + 1;
                        i = s;
                        while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                            i += 1;
                        }
                        out.push((Tok::Ident(c[s..i].iter().collect()), line));
                    }
                    "b" | "c" if next == '"' => i = skip_str(i, &mut line),
                    "b" if next == '\'' => {
                        i += 1;
                        if at(i + 1) == '\\' {
                            i += 2;
                        } else {
                            i += 1;
                        }
                        while i < c.len() && c[i] != '\'' {
                            i += 1;
                        }
                        i += 1;
                    }
                    _ => out.push((Tok::Ident(word), line)),
                }
            }
            ':' if at(i + 1) == ':' => {
                out.push((Tok::Sep, line));
                i += 2;
            }
            _ => {
                out.push((Tok::Punct(ch), line));
                i += 1;
            }
        }
    }
    out
}

// ---- parsing -----------------------------------------------------------------------------------

/// Where a path starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Start {
    Crate,
    /// `super::` this many times.
    Super(usize),
    SelfMod,
    /// A bare first segment: a child module, or something that is not a module of the crate.
    Bare,
}

/// A path named in a module.
#[derive(Clone, Debug)]
struct Reference {
    start: Start,
    segs: Vec<String>,
    line: usize,
    /// Spelled out, for reports.
    text: String,
}

/// One module: a file, or an inline module inside one.
#[derive(Debug)]
struct Node {
    file: PathBuf,
    /// The directory its child module files live in.
    dir: PathBuf,
    parent: Option<usize>,
    children: BTreeMap<String, usize>,
    /// Child modules declared `mod x;`, with their line.
    declared: Vec<(String, usize)>,
    /// Names the module imports, `name -> (start, path)`; used to resolve through the root.
    imports: HashMap<String, (Start, Vec<String>)>,
    refs: Vec<Reference>,
}

struct Tree {
    nodes: Vec<Node>,
    /// Files reached but absent, with the module that declares them.
    missing: Vec<String>,
}

fn start_of(segs: &[String]) -> (Start, usize) {
    match segs.first().map(String::as_str) {
        Some("crate") => (Start::Crate, 1),
        Some("self") => (Start::SelfMod, 1),
        Some("super") => {
            let n = segs.iter().take_while(|s| *s == "super").count();
            (Start::Super(n), n)
        }
        _ => (Start::Bare, 0),
    }
}

fn reference(segs: Vec<String>, line: usize) -> Reference {
    let (start, skip) = start_of(&segs);
    Reference {
        start,
        text: segs.join("::"),
        segs: segs[skip..].to_vec(),
        line,
    }
}

/// A `use` tree from `toks[*i]` on, under `prefix`: every path it names, with the name it binds
/// (`None` for a glob).
fn use_tree(
    toks: &[(Tok, usize)],
    i: &mut usize,
    prefix: Vec<String>,
    out: &mut Vec<(Vec<String>, Option<String>)>,
) {
    let mut path = prefix;
    loop {
        match toks.get(*i).map(|t| &t.0) {
            Some(Tok::Ident(w)) => {
                path.push(w.clone());
                *i += 1;
                if toks.get(*i).map(|t| &t.0) == Some(&Tok::Sep) {
                    *i += 1;
                    continue;
                }
                let mut name = path.last().cloned();
                if name.as_deref() == Some("self") {
                    path.pop();
                    name = path.last().cloned();
                }
                if let (Some(Tok::Ident(kw)), Some(Tok::Ident(alias))) =
                    (toks.get(*i).map(|t| &t.0), toks.get(*i + 1).map(|t| &t.0))
                    && kw == "as"
                {
                    name = Some(alias.clone());
                    *i += 2;
                }
                out.push((path, name));
                return;
            }
            Some(Tok::Punct('*')) => {
                *i += 1;
                out.push((path, None));
                return;
            }
            Some(Tok::Punct('{')) => {
                *i += 1;
                loop {
                    match toks.get(*i).map(|t| &t.0) {
                        Some(Tok::Punct('}')) | None => {
                            *i += 1;
                            return;
                        }
                        Some(Tok::Punct(',')) => *i += 1,
                        _ => use_tree(toks, i, path.clone(), out),
                    }
                }
            }
            Some(Tok::Sep) => {
                // A leading `::`: an external crate.
                *i += 1;
                path.push("::".into());
            }
            _ => return,
        }
    }
}

/// Whether the attribute tokens `toks` (between `#[` and `]`) make an item test-only.
fn test_only(toks: &[Tok]) -> bool {
    let has = |w: &str| toks.iter().any(|t| *t == Tok::Ident(w.into()));
    toks.first() == Some(&Tok::Ident("cfg".into())) && has("test") && !has("not")
}

/// The index after the item starting at `i`: after its `;` (or `,`, for a field or a variant),
/// or after its `{ .. }` block; at the `}` or `)` that closes the enclosing group if that comes
/// first.
fn skip_item(toks: &[(Tok, usize)], mut i: usize) -> usize {
    let mut depth = 0i32;
    while i < toks.len() {
        match toks[i].0 {
            Tok::Punct('(' | '[') => depth += 1,
            Tok::Punct(')' | ']' | '}') if depth == 0 => return i,
            Tok::Punct(')' | ']') => depth -= 1,
            Tok::Punct(';' | ',') if depth == 0 => return i + 1,
            Tok::Punct('{') if depth == 0 => return skip_block(toks, i),
            _ => {}
        }
        i += 1;
    }
    i
}

/// The index after the balanced `{ .. }`, `( .. )` or `[ .. ]` group opening at `i`.
fn skip_block(toks: &[(Tok, usize)], mut i: usize) -> usize {
    let mut depth = 0i32;
    while i < toks.len() {
        match toks[i].0 {
            Tok::Punct('{' | '(' | '[') => depth += 1,
            Tok::Punct('}' | ')' | ']') => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    i
}

impl Tree {
    /// The module tree of the crate whose root file is `root`.
    fn of(root: &Path) -> Tree {
        let mut t = Tree {
            nodes: Vec::new(),
            missing: Vec::new(),
        };
        let dir = root
            .parent()
            .expect("a root file has a directory")
            .to_path_buf();
        t.load(root.to_path_buf(), dir, None);
        t
    }

    fn add(&mut self, file: PathBuf, dir: PathBuf, parent: Option<usize>) -> usize {
        self.nodes.push(Node {
            file,
            dir,
            parent,
            children: BTreeMap::new(),
            declared: Vec::new(),
            imports: HashMap::new(),
            refs: Vec::new(),
        });
        self.nodes.len() - 1
    }

    /// Parses `file` as a new module under `parent`, and the module files it declares.
    fn load(&mut self, file: PathBuf, dir: PathBuf, parent: Option<usize>) -> usize {
        let src = fs::read_to_string(&file).expect("a readable source file");
        let toks = lex(&src);
        let id = self.add(file, dir, parent);
        self.parse(&toks, id);
        id
    }

    /// Parses the tokens of module `id` (a file, or from `{` of an inline module to its `}`).
    fn parse(&mut self, toks: &[(Tok, usize)], id: usize) {
        // Inline modules open at a brace depth: (node, depth).
        let mut scopes: Vec<(usize, i32)> = vec![(id, 0)];
        let mut depth = 0i32;
        let mut test_attr = false;
        let mut i = 0;
        while i < toks.len() {
            let scope = scopes.last().expect("the file's scope").0;
            let ident = |k: usize| match toks.get(k).map(|t| &t.0) {
                Some(Tok::Ident(w)) => Some(w.as_str()),
                _ => None,
            };
            match &toks[i].0 {
                Tok::Punct('#') => {
                    // An attribute: `#[..]` or `#![..]`.
                    let mut k = i + 1;
                    if toks.get(k).map(|t| &t.0) == Some(&Tok::Punct('!')) {
                        k += 1;
                    }
                    if toks.get(k).map(|t| &t.0) == Some(&Tok::Punct('[')) {
                        let end = skip_block(toks, k);
                        let inner: Vec<Tok> =
                            toks[k + 1..end - 1].iter().map(|t| t.0.clone()).collect();
                        test_attr |= test_only(&inner);
                        i = end;
                    } else {
                        i += 1;
                    }
                    continue;
                }
                Tok::Punct('{') => depth += 1,
                Tok::Punct('}') => {
                    if scopes.len() > 1 && scopes.last().expect("a scope").1 == depth {
                        scopes.pop();
                    }
                    depth -= 1;
                }
                Tok::Punct('$') => {
                    // `$crate::..` in a macro: resolved where the macro is used.
                    i += 2;
                    continue;
                }
                Tok::Ident(w) if w == "pub" => {
                    // Visibility, `pub(crate)`, `pub(in path)`: not a reference.
                    if toks.get(i + 1).map(|t| &t.0) == Some(&Tok::Punct('(')) {
                        i = skip_block(toks, i + 1);
                    } else {
                        i += 1;
                    }
                    continue;
                }
                Tok::Ident(w) if w == "macro_rules" => {
                    i = skip_item(toks, i);
                    test_attr = false;
                    continue;
                }
                Tok::Ident(w) if w == "mod" && ident(i + 1).is_some() => {
                    let name = ident(i + 1).expect("checked").to_string();
                    let line = toks[i].1;
                    if test_attr {
                        test_attr = false;
                        i = skip_item(toks, i);
                        continue;
                    }
                    match toks.get(i + 2).map(|t| &t.0) {
                        Some(Tok::Punct(';')) => {
                            self.nodes[scope].declared.push((name, line));
                            i += 3;
                        }
                        Some(Tok::Punct('{')) => {
                            let (file, dir) = (
                                self.nodes[scope].file.clone(),
                                self.nodes[scope].dir.join(&name),
                            );
                            let child = self.add(file, dir, Some(scope));
                            self.nodes[scope].children.insert(name, child);
                            depth += 1;
                            scopes.push((child, depth));
                            i += 3;
                        }
                        _ => i += 1,
                    }
                    continue;
                }
                Tok::Ident(w) if w == "use" => {
                    let end = skip_item(toks, i);
                    if !test_attr {
                        let mut k = i + 1;
                        let mut paths = Vec::new();
                        use_tree(&toks[..end], &mut k, Vec::new(), &mut paths);
                        for (path, name) in paths {
                            if path.first().is_some_and(|s| s == "::") {
                                continue;
                            }
                            let r = reference(path, toks[i].1);
                            if let Some(n) = name {
                                self.nodes[scope]
                                    .imports
                                    .insert(n, (r.start, r.segs.clone()));
                            }
                            self.nodes[scope].refs.push(r);
                        }
                    }
                    test_attr = false;
                    i = end;
                    continue;
                }
                Tok::Ident(w) if test_attr && !matches!(w.as_str(), "pub" | "unsafe" | "async") => {
                    test_attr = false;
                    i = skip_item(toks, i);
                    continue;
                }
                Tok::Ident(w) if matches!(w.as_str(), "crate" | "super" | "self") => {
                    let after_sep = i > 0 && toks[i - 1].0 == Tok::Sep;
                    if !after_sep && toks.get(i + 1).map(|t| &t.0) == Some(&Tok::Sep) {
                        let mut segs = vec![w.clone()];
                        let mut k = i + 1;
                        while toks.get(k).map(|t| &t.0) == Some(&Tok::Sep) {
                            match toks.get(k + 1).map(|t| &t.0) {
                                Some(Tok::Ident(s)) => {
                                    segs.push(s.clone());
                                    k += 2;
                                }
                                _ => break,
                            }
                        }
                        self.nodes[scope].refs.push(reference(segs, toks[i].1));
                        i = k;
                        continue;
                    }
                }
                Tok::Punct(';') => test_attr = false,
                _ => {}
            }
            i += 1;
        }
        // The module files this file's modules declare.
        let mut stack = vec![id];
        while let Some(n) = stack.pop() {
            let declared = std::mem::take(&mut self.nodes[n].declared);
            for (name, line) in declared {
                let dir = self.nodes[n].dir.clone();
                let candidates = [
                    dir.join(format!("{name}.rs")),
                    dir.join(&name).join("mod.rs"),
                ];
                match candidates.iter().find(|p| p.is_file()) {
                    Some(file) => {
                        let child = self.load(file.clone(), dir.join(&name), Some(n));
                        self.nodes[n].children.insert(name, child);
                    }
                    None => self.missing.push(format!(
                        "{}:{line}: mod {name} has no file",
                        rel(&self.nodes[n].file)
                    )),
                }
            }
            stack.extend(
                self.nodes[n]
                    .children
                    .values()
                    .copied()
                    .filter(|&c| self.nodes[c].file == self.nodes[n].file),
            );
        }
    }

    /// The module a path names, or `None` when it leaves the crate.
    fn resolve(&self, from: usize, start: Start, segs: &[String], hops: usize) -> Option<usize> {
        if hops > 16 {
            return None;
        }
        let mut cur = match start {
            Start::Crate => 0,
            Start::SelfMod => from,
            Start::Super(n) => {
                let mut c = from;
                for _ in 0..n {
                    c = self.nodes[c].parent?;
                }
                c
            }
            Start::Bare => {
                let first = segs.first()?;
                if !self.nodes[from].children.contains_key(first) {
                    return None;
                }
                from
            }
        };
        for seg in segs {
            if let Some(&c) = self.nodes[cur].children.get(seg) {
                cur = c;
                continue;
            }
            if cur == 0
                && let Some((s, path)) = self.nodes[0].imports.get(seg)
            {
                // Through the root's import to where the name is defined.
                return self.resolve(0, *s, path, hops + 1);
            }
            break;
        }
        Some(cur)
    }
}

/// An edge of the file graph and where it comes from.
type Edges = BTreeMap<(PathBuf, PathBuf), String>;

/// The file graph of the crate rooted at `root_file`.
fn file_graph(root_file: &Path, problems: &mut Vec<String>) -> Edges {
    let tree = Tree::of(root_file);
    problems.extend(tree.missing.iter().cloned());
    let mut edges = Edges::new();
    for (id, node) in tree.nodes.iter().enumerate() {
        for (name, &child) in &node.children {
            let (a, b) = (&node.file, &tree.nodes[child].file);
            if a != b {
                edges
                    .entry((a.clone(), b.clone()))
                    .or_insert_with(|| format!("mod {name}"));
            }
        }
        for r in &node.refs {
            let Some(t) = tree.resolve(id, r.start, &r.segs, 0) else {
                continue;
            };
            let (a, b) = (&node.file, &tree.nodes[t].file);
            if a != b {
                edges
                    .entry((a.clone(), b.clone()))
                    .or_insert_with(|| format!("line {}: {}", r.line, r.text));
            }
        }
    }
    edges
}

/// The strongly connected sets of more than one file (Tarjan's algorithm).
fn cycles(edges: &Edges) -> Vec<Vec<PathBuf>> {
    let mut files: BTreeSet<&PathBuf> = BTreeSet::new();
    for (a, b) in edges.keys() {
        files.insert(a);
        files.insert(b);
    }
    let files: Vec<&PathBuf> = files.into_iter().collect();
    let idx: HashMap<&PathBuf, usize> = files.iter().enumerate().map(|(i, f)| (*f, i)).collect();
    let mut adj = vec![Vec::new(); files.len()];
    for (a, b) in edges.keys() {
        adj[idx[a]].push(idx[b]);
    }
    struct State {
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(v: usize, adj: &[Vec<usize>], s: &mut State) {
        s.index[v] = Some(s.next);
        s.low[v] = s.next;
        s.next += 1;
        s.stack.push(v);
        s.on[v] = true;
        for &w in &adj[v] {
            match s.index[w] {
                None => {
                    visit(w, adj, s);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on[w] => s.low[v] = s.low[v].min(iw),
                _ => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut comp = Vec::new();
            loop {
                let w = s.stack.pop().expect("v is on the stack");
                s.on[w] = false;
                comp.push(w);
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                s.out.push(comp);
            }
        }
    }
    let n = files.len();
    let mut s = State {
        index: vec![None; n],
        low: vec![0; n],
        on: vec![false; n],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if s.index[v].is_none() {
            visit(v, &adj, &mut s);
        }
    }
    s.out
        .into_iter()
        .map(|c| {
            let mut c: Vec<PathBuf> = c.into_iter().map(|i| files[i].clone()).collect();
            c.sort();
            c
        })
        .collect()
}

/// A shortest cycle through the first file of `set`, within it.
fn a_cycle(set: &[PathBuf], edges: &Edges) -> Vec<PathBuf> {
    let inside: BTreeSet<&PathBuf> = set.iter().collect();
    let start = &set[0];
    let mut prev: HashMap<&PathBuf, &PathBuf> = HashMap::new();
    let mut queue = VecDeque::from([start]);
    while let Some(a) = queue.pop_front() {
        for (x, b) in edges.keys() {
            if x != a || !inside.contains(b) {
                continue;
            }
            if b == start {
                let mut path = vec![a.clone()];
                let mut cur = a;
                while cur != start {
                    cur = prev[cur];
                    path.push(cur.clone());
                }
                path.reverse();
                path.push(start.clone());
                return path;
            }
            if !prev.contains_key(b) {
                prev.insert(b, a);
                queue.push_back(b);
            }
        }
    }
    Vec::new()
}

/// The crate roots of crate directory `krate`.
fn crate_roots(krate: &Path) -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = ["src/lib.rs", "src/main.rs"]
        .iter()
        .map(|r| krate.join(r))
        .filter(|p| p.is_file())
        .collect();
    for dir in ["src/bin", "tests", "benches"] {
        if let Ok(entries) = fs::read_dir(krate.join(dir)) {
            let mut v: Vec<PathBuf> = entries
                .map(|e| e.expect("a directory entry").path())
                .filter(|p| p.extension().is_some_and(|e| e == "rs"))
                .collect();
            v.sort();
            roots.extend(v);
        }
    }
    roots
}

#[test]
fn no_import_cycle_between_the_files_of_a_crate() {
    let mut report = String::new();
    let mut problems = Vec::new();
    let (mut roots, mut edge_count, mut found) = (0, 0, 0);
    for krate in crates() {
        for root_file in crate_roots(&krate) {
            roots += 1;
            let edges = file_graph(&root_file, &mut problems);
            edge_count += edges.len();
            for set in cycles(&edges) {
                found += 1;
                let _ = writeln!(report, "\ncycle in the crate of {}:", rel(&root_file));
                let path: Vec<String> = a_cycle(&set, &edges).iter().map(|p| rel(p)).collect();
                let _ = writeln!(report, "  e.g. {}", path.join(" -> "));
                let _ = writeln!(report, "  files and the edges between them:");
                for f in &set {
                    let _ = writeln!(report, "    {}", rel(f));
                    for ((a, b), why) in &edges {
                        if a == f && set.contains(b) {
                            let _ = writeln!(report, "      -> {} ({why})", rel(b));
                        }
                    }
                }
            }
        }
    }
    assert!(
        roots > 10 && edge_count > 50,
        "{roots} crate roots, {edge_count} edges"
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert!(
        found == 0,
        "{found} import cycle(s) between the files of a crate:\n{report}"
    );
}

/// The resolver on a small made-up crate.
#[test]
fn the_resolver_finds_what_it_should() {
    let dir = std::env::temp_dir().join(format!("gradsync-layout-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    let files = [
        (
            "lib.rs",
            "//! crate::c::C in a comment\npub mod a;\nmod b;\nmod c;\n#[cfg(test)]\nmod tests;\n\
             pub use c::C;\npub struct Root;\n",
        ),
        ("a/mod.rs", "mod x;\npub use x::X;\n"),
        (
            "a/x.rs",
            "use crate::C;\npub struct X;\n\
             fn f() { let s = \"super::b\"; let c = '{'; let _ = crate::a::x::X; }\n",
        ),
        (
            "b.rs",
            "use crate::c::{self as cc, C as See};\npub struct B;\n\
             mod inner {\n    use super::B;\n    fn g() -> super::super::Root { todo!() }\n}\n",
        ),
        (
            "c.rs",
            "use crate::a::X;\npub struct C;\n#[cfg(test)]\nmod t { use crate::Root; }\n",
        ),
        ("tests.rs", "use crate::b::B;\n"),
    ];
    for (name, text) in files {
        let p = dir.join(name);
        fs::create_dir_all(p.parent().expect("a directory")).expect("a temp directory");
        fs::write(&p, text).expect("a temp file");
    }
    let mut problems = Vec::new();
    let edges = file_graph(&dir.join("lib.rs"), &mut problems);
    let name = |p: &PathBuf| p.strip_prefix(&dir).expect("inside").display().to_string();
    let got: BTreeSet<(String, String)> = edges.keys().map(|(a, b)| (name(a), name(b))).collect();
    let want: BTreeSet<(String, String)> = [
        ("lib.rs", "a/mod.rs"),
        ("lib.rs", "b.rs"),
        ("lib.rs", "c.rs"),
        ("a/mod.rs", "a/x.rs"),
        // Through the root's re-export to where `C` is defined.
        ("a/x.rs", "c.rs"),
        // Through `a`'s re-export: an edge to `a/mod.rs`.
        ("c.rs", "a/mod.rs"),
        ("b.rs", "c.rs"),
        // `super::super::Root` from `b::inner`.
        ("b.rs", "lib.rs"),
    ]
    .iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    assert_eq!(got, want);
    assert!(problems.is_empty(), "{problems:?}");
    let found = cycles(&edges);
    let mut names: Vec<Vec<String>> = found.iter().map(|c| c.iter().map(name).collect()).collect();
    names.sort();
    assert_eq!(
        names,
        [vec!["a/mod.rs", "a/x.rs", "c.rs"], vec!["b.rs", "lib.rs"]]
    );
    for set in &found {
        let cycle = a_cycle(set, &edges);
        assert_eq!(cycle.len(), set.len() + 1, "{cycle:?}");
        assert_eq!(cycle.first(), cycle.last());
    }
    fs::remove_dir_all(&dir).expect("the temp directory goes");
}
