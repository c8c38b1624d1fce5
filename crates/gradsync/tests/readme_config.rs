//! The README's configuration table against the code.
//!
//! Every `GRADSYNC_*` environment variable that the code reads must have a row in the table
//! under `## Configuration` of the README, and every row must name a variable that something
//! reads. "Read" means: the name is a string literal of its own (what `std::env::var`,
//! `os.environ.get`, clap's `env = ...` and the `Env` helpers of `config.rs` take) in
//!
//! - the non-test Rust sources of every crate: `src/` (without `#[cfg(test)]` items and the
//!   files of `#[cfg(test)] mod x;`, such as `tests.rs`), `build.rs`, `benches/` and
//!   `examples/` (a build or benchmark setting is something a user sets too); `crates/*/tests`
//!   are left out;
//! - the Python package's own modules (`crates/gradsync-py`, its `python-source` directory),
//!   not its tests.
//!
//! Messages and docs that mention a variable (`"set GRADSYNC_STORE_PORT"`) do not count as
//! reads. A name the code puts together at run time (`format!("GRADSYNC_{x}")`, a
//! `"GRADSYNC_IB_"` prefix, `concat!`, an f-string) cannot be seen as a literal: such a site
//! fails the test until [`BUILT_NAMES`] lists the names it makes.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Variables that appear as literals in the code but are not configuration, with the reason.
/// Each must be absent from the table and still present in the code.
const NOT_CONFIGURATION: &[(&str, &str)] = &[
    // `gradsync launch` (crates/gradsync-cli/src/launch.rs) sets `GRADSYNC_LAUNCHED=1` in
    // every rank's environment, as a marker next to RANK, WORLD_SIZE, ...; nothing in gradsync
    // or its Python package reads it, so setting it changes nothing.
    (
        "GRADSYNC_LAUNCHED",
        "set by `gradsync launch` for its ranks; read by nothing",
    ),
];

/// Names put together at run time, which no literal spells out: (a path suffix of the file
/// that builds them, the names it can make). Empty while every name is a literal.
const BUILT_NAMES: &[(&str, &[&str])] = &[];

const PREFIX: &str = "GRADSYNC_";

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("workspace root")
}

// ------------------------------------------------------------------------------------------
// Lexing

/// A string literal: its text between the quotes (escapes left as written) and where it
/// starts.
#[derive(Debug)]
struct Literal {
    text: String,
    offset: usize,
}

/// A source with comments and string literals blanked out (newlines kept), so that brackets
/// can be matched, and the literals that were blanked.
struct Lexed {
    masked: Vec<u8>,
    literals: Vec<Literal>,
}

/// A byte of a variable name after the prefix.
fn is_name_byte(b: u8) -> bool {
    b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_'
}

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

fn blank(masked: &mut [u8], range: std::ops::Range<usize>) {
    for b in &mut masked[range] {
        if *b != b'\n' {
            *b = b' ';
        }
    }
}

/// Length of the UTF-8 character that starts with `b`.
fn utf8_len(b: u8) -> usize {
    match b {
        0xf0..=0xff => 4,
        0xe0..=0xef => 3,
        0xc0..=0xdf => 2,
        _ => 1,
    }
}

fn lex_rust(src: &str) -> Lexed {
    let s = src.as_bytes();
    let mut masked = s.to_vec();
    let mut literals = Vec::new();
    let mut i = 0;
    while i < s.len() {
        let c = s[i];
        let prev = if i > 0 { s[i - 1] } else { b' ' };
        if c == b'/' && s.get(i + 1) == Some(&b'/') {
            let end = s[i..]
                .iter()
                .position(|&b| b == b'\n')
                .map_or(s.len(), |p| i + p);
            blank(&mut masked, i..end);
            i = end;
        } else if c == b'/' && s.get(i + 1) == Some(&b'*') {
            let (mut j, mut depth) = (i + 2, 1);
            while j < s.len() && depth > 0 {
                if s[j] == b'/' && s.get(j + 1) == Some(&b'*') {
                    depth += 1;
                    j += 2;
                } else if s[j] == b'*' && s.get(j + 1) == Some(&b'/') {
                    depth -= 1;
                    j += 2;
                } else {
                    j += 1;
                }
            }
            blank(&mut masked, i..j);
            i = j;
        } else if c == b'r' && raw_string_start(s, i) {
            // r"..." / r#"..."# (also after b or c).
            let hashes = s[i + 1..].iter().take_while(|&&b| b == b'#').count();
            let open = i + 1 + hashes; // the quote
            let mut close = vec![b'"'];
            close.extend(std::iter::repeat_n(b'#', hashes));
            let end = s[open + 1..]
                .windows(close.len())
                .position(|w| w == close.as_slice())
                .map_or(s.len(), |p| open + 1 + p);
            literals.push(Literal {
                text: src[open + 1..end].to_string(),
                offset: open,
            });
            let stop = (end + close.len()).min(s.len());
            blank(&mut masked, i..stop);
            i = stop;
        } else if c == b'"' {
            let mut j = i + 1;
            while j < s.len() && s[j] != b'"' {
                j += if s[j] == b'\\' { 2 } else { 1 };
            }
            let end = j.min(s.len());
            literals.push(Literal {
                text: src[i + 1..end].to_string(),
                offset: i,
            });
            let stop = (end + 1).min(s.len());
            blank(&mut masked, i..stop);
            i = stop;
        } else if c == b'\''
            && (!is_ident(prev) || (prev == b'b' && (i < 2 || !is_ident(s[i - 2]))))
        {
            // A char literal ('x', '"', '\'', '\u{..}') or a lifetime / label ('a).
            if s.get(i + 1) == Some(&b'\\') {
                let end = s[i + 3..]
                    .iter()
                    .position(|&b| b == b'\'')
                    .map_or(s.len(), |p| i + 3 + p);
                blank(&mut masked, i..(end + 1).min(s.len()));
                i = end + 1;
            } else if let Some(&next) = s.get(i + 1) {
                let after = i + 1 + utf8_len(next);
                if s.get(after) == Some(&b'\'') {
                    blank(&mut masked, i..after + 1);
                    i = after + 1;
                } else {
                    i += 1;
                }
            } else {
                i += 1;
            }
        } else {
            i += 1;
        }
    }
    Lexed { masked, literals }
}

/// Whether the `r` at `i` opens a raw string (`r"`, `r#"`, `br"`, `cr#"`).
fn raw_string_start(s: &[u8], i: usize) -> bool {
    let before_ok = |k: usize| k == 0 || !is_ident(s[k - 1]);
    let prefix_ok = before_ok(i) || (i > 0 && matches!(s[i - 1], b'b' | b'c') && before_ok(i - 1));
    let hashes = s[i + 1..].iter().take_while(|&&b| b == b'#').count();
    prefix_ok && s.get(i + 1 + hashes) == Some(&b'"')
}

fn lex_python(src: &str) -> Lexed {
    let s = src.as_bytes();
    let mut masked = s.to_vec();
    let mut literals = Vec::new();
    let mut i = 0;
    while i < s.len() {
        let c = s[i];
        if c == b'#' {
            let end = s[i..]
                .iter()
                .position(|&b| b == b'\n')
                .map_or(s.len(), |p| i + p);
            blank(&mut masked, i..end);
            i = end;
        } else if c == b'"' || c == b'\'' {
            // Prefixes (r, b, f, u, rb, fr, ...) need no special care: a backslash never ends
            // a literal, raw or not.
            let triple = s.get(i + 1) == Some(&c) && s.get(i + 2) == Some(&c);
            let quote_len = if triple { 3 } else { 1 };
            let mut j = i + quote_len;
            let end = loop {
                if j >= s.len() {
                    break s.len();
                }
                if s[j] == b'\\' {
                    j += 2;
                } else if s[j] == c
                    && (!triple || (s.get(j + 1) == Some(&c) && s.get(j + 2) == Some(&c)))
                {
                    break j;
                } else if s[j] == b'\n' && !triple {
                    break j; // an unterminated one-line string: stop at the line's end
                } else {
                    j += 1;
                }
            };
            literals.push(Literal {
                text: src[(i + quote_len).min(end)..end].to_string(),
                offset: i,
            });
            let stop = (end + quote_len).min(s.len());
            blank(&mut masked, i..stop);
            i = stop;
        } else {
            i += 1;
        }
    }
    Lexed { masked, literals }
}

// ------------------------------------------------------------------------------------------
// Test-only Rust code

/// The byte ranges of `#[cfg(test)]` items (and `#[cfg(all(test, ...))]`), and the names of
/// the `#[cfg(test)] mod name;` declarations among them.
fn test_items(masked: &[u8]) -> (Vec<std::ops::Range<usize>>, Vec<String>) {
    let text = String::from_utf8_lossy(masked);
    let compact: Vec<(usize, u8)> = masked
        .iter()
        .enumerate()
        .filter(|(_, b)| !b.is_ascii_whitespace())
        .map(|(i, &b)| (i, b))
        .collect();
    let bytes: Vec<u8> = compact.iter().map(|&(_, b)| b).collect();
    let mut ranges = Vec::new();
    let mut files = Vec::new();
    // `#![cfg(test)]`: the whole file is test code.
    if find(&bytes, b"#![cfg(test)]").is_some() {
        return (std::iter::once(0..masked.len()).collect(), files);
    }
    for pat in [&b"#[cfg(test)]"[..], &b"#[cfg(all(test,"[..]] {
        let mut from = 0;
        while let Some(p) = find(&bytes[from..], pat).map(|p| from + p) {
            from = p + pat.len();
            let start = compact[p].0;
            // The end of the attribute: its closing bracket.
            let open = start + masked[start..].iter().position(|&b| b == b'[').unwrap_or(0);
            let attr_end = match_bracket(masked, open, b'[', b']');
            let (end, item) = item_end(masked, attr_end);
            let words: Vec<&str> = text[item.clone()].split_whitespace().collect();
            // `mod name;` (possibly `pub mod`, `pub(crate) mod`).
            if let Some(k) = words.iter().position(|w| *w == "mod")
                && let Some(name) = words.get(k + 1)
                && masked[end - 1] == b';'
            {
                files.push(name.trim_end_matches(';').to_string());
            }
            ranges.push(start..end);
        }
    }
    (ranges, files)
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The index just past the bracket that closes the one at `open` (which holds `l`).
fn match_bracket(s: &[u8], open: usize, l: u8, r: u8) -> usize {
    let mut depth = 0usize;
    for (k, &b) in s.iter().enumerate().skip(open) {
        if b == l {
            depth += 1;
        } else if b == r {
            depth -= 1;
            if depth == 0 {
                return k + 1;
            }
        }
    }
    s.len()
}

/// The end of the item that starts at `from` (after one attribute): further attributes are
/// skipped, then the item ends at its first `;` outside brackets or with the block its first
/// `{` opens. Also returns the item's own text range (without attributes).
fn item_end(s: &[u8], mut from: usize) -> (usize, std::ops::Range<usize>) {
    loop {
        while from < s.len() && s[from].is_ascii_whitespace() {
            from += 1;
        }
        if s.get(from) == Some(&b'#') {
            let open = from + s[from..].iter().position(|&b| b == b'[').unwrap_or(0);
            from = match_bracket(s, open, b'[', b']');
        } else {
            break;
        }
    }
    let mut depth = 0i64;
    for k in from..s.len() {
        match s[k] {
            b'(' | b'[' => depth += 1,
            b')' | b']' => depth -= 1,
            b';' if depth == 0 => return (k + 1, from..k + 1),
            b'{' if depth == 0 => {
                let end = match_bracket(s, k, b'{', b'}');
                return (end, from..end);
            }
            _ => {}
        }
    }
    (s.len(), from..s.len())
}

// ------------------------------------------------------------------------------------------
// Collecting the names

/// What the sources say about `GRADSYNC_*` names.
#[derive(Default)]
struct Found {
    /// Name -> where it is first read (`path:line`).
    read: BTreeMap<String, String>,
    /// Sites that build a name at run time (`path:line: literal`).
    built: Vec<(String, String)>,
    /// Files scanned.
    files: usize,
}

fn line_of(src: &str, offset: usize) -> usize {
    src[..offset].bytes().filter(|&b| b == b'\n').count() + 1
}

impl Found {
    fn add(&mut self, root: &Path, path: &Path, src: &str, literals: &[Literal]) {
        let rel = path
            .strip_prefix(root)
            .unwrap_or(path)
            .display()
            .to_string();
        self.files += 1;
        for lit in literals {
            let site = format!("{rel}:{}", line_of(src, lit.offset));
            let t = lit.text.as_str();
            if let Some(rest) = t.strip_prefix(PREFIX)
                && rest.bytes().all(is_name_byte)
            {
                if rest.is_empty() || rest.ends_with('_') {
                    // A prefix: the rest of the name comes from elsewhere.
                    self.built.push((rel.clone(), format!("{site}: {t:?}")));
                } else {
                    self.read.entry(t.to_string()).or_insert(site);
                }
                continue;
            }
            // A name completed by a placeholder: `GRADSYNC_{x}`, `GRADSYNC_IB_%s`.
            let mut from = 0;
            while let Some(p) = t[from..].find(PREFIX).map(|p| from + p) {
                let tail = &t[p + PREFIX.len()..];
                let name_len = tail.bytes().take_while(|&b| is_name_byte(b)).count();
                if matches!(tail.as_bytes().get(name_len), Some(b'{' | b'%')) {
                    self.built.push((rel.clone(), format!("{site}: {t:?}")));
                    break;
                }
                from = p + PREFIX.len();
            }
        }
    }
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// The files a `#[cfg(test)] mod name;` in `file` stands for: `name.rs`, `name/mod.rs` and
/// everything under `name/`, next to `file` (for `lib.rs`, `main.rs`, `mod.rs`) or in the
/// directory named after it.
fn test_module_paths(file: &Path, name: &str) -> Vec<PathBuf> {
    let parent = file.parent().unwrap_or(Path::new("."));
    let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or("");
    let dir = if matches!(stem, "lib" | "main" | "mod") {
        parent.to_path_buf()
    } else {
        parent.join(stem)
    };
    vec![dir.join(format!("{name}.rs")), dir.join(name)]
}

fn scan_rust_crate(root: &Path, krate: &Path, found: &mut Found) {
    let mut files = Vec::new();
    for sub in ["src", "benches", "examples"] {
        rust_files(&krate.join(sub), &mut files);
    }
    if krate.join("build.rs").is_file() {
        files.push(krate.join("build.rs"));
    }
    // Pass 1: which files are test modules.
    let mut lexed = Vec::new();
    let mut test_paths: Vec<PathBuf> = Vec::new();
    for f in files {
        let src = fs::read_to_string(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let lx = lex_rust(&src);
        let (ranges, mods) = test_items(&lx.masked);
        for m in mods {
            test_paths.extend(test_module_paths(&f, &m));
        }
        lexed.push((f, src, lx, ranges));
    }
    // Pass 2: the literals outside test code.
    for (f, src, lx, ranges) in lexed {
        let is_test_file = f.file_name().is_some_and(|n| n == "tests.rs")
            || test_paths.iter().any(|t| f.starts_with(t));
        if is_test_file {
            continue;
        }
        let literals: Vec<Literal> = lx
            .literals
            .into_iter()
            .filter(|l| !ranges.iter().any(|r| r.contains(&l.offset)))
            .collect();
        found.add(root, &f, &src, &literals);
    }
}

/// The Python package's source directory: `python-source` of `[tool.maturin]`, else the
/// crate directory itself.
fn python_source(pkg: &Path) -> PathBuf {
    let toml = fs::read_to_string(pkg.join("pyproject.toml")).unwrap_or_default();
    toml.lines()
        .filter_map(|l| l.trim().strip_prefix("python-source"))
        .filter_map(|rest| rest.trim().strip_prefix('='))
        .map(|v| pkg.join(v.trim().trim_matches('"').trim_matches('\'')))
        .next()
        .unwrap_or_else(|| pkg.to_path_buf())
}

fn scan_python_package(root: &Path, pkg: &Path, found: &mut Found) {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = fs::read_dir(dir) else {
            return;
        };
        let mut entries: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        entries.sort();
        for p in entries {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if p.is_dir() {
                if name != "tests" && name != "__pycache__" && !name.starts_with('.') {
                    walk(&p, out);
                }
            } else if name.ends_with(".py")
                && !name.starts_with("test_")
                && !name.ends_with("_test.py")
                && name != "conftest.py"
            {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(&python_source(pkg), &mut files);
    assert!(
        !files.is_empty(),
        "no Python modules under {}",
        pkg.display()
    );
    for f in files {
        let src = fs::read_to_string(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let lx = lex_python(&src);
        found.add(root, &f, &src, &lx.literals);
    }
}

fn names_in_code(root: &Path) -> Found {
    let mut found = Found::default();
    let mut crates: Vec<PathBuf> = fs::read_dir(root.join("crates"))
        .expect("crates/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("Cargo.toml").is_file())
        .collect();
    crates.sort();
    for krate in &crates {
        scan_rust_crate(root, krate, &mut found);
    }
    scan_python_package(root, &root.join("crates/gradsync-py"), &mut found);
    found
}

// ------------------------------------------------------------------------------------------
// The README's table

/// The variables of the first table under `## Configuration`, in order, with their lines.
fn names_in_readme(readme: &str) -> Result<Vec<(String, usize)>, String> {
    let mut lines = readme.lines().enumerate();
    lines
        .by_ref()
        .find(|(_, l)| l.trim_end() == "## Configuration")
        .ok_or("README.md has no `## Configuration` section")?;
    let mut rows = Vec::new();
    let mut in_table = false;
    for (n, line) in lines {
        let line = line.trim();
        if line.starts_with("## ") || line.starts_with("# ") {
            break;
        }
        if !line.starts_with('|') {
            if in_table {
                break;
            }
            continue;
        }
        in_table = true;
        rows.push((n + 1, line));
    }
    if rows.len() < 3 {
        return Err("the `## Configuration` section has no table with rows".into());
    }
    let sep = rows[1].1;
    if !sep.chars().all(|c| matches!(c, '|' | '-' | ':' | ' ')) {
        return Err(format!(
            "line {}: expected the table's separator row, found {sep}",
            rows[1].0
        ));
    }
    let mut names = Vec::new();
    for &(n, row) in &rows[2..] {
        let first = row
            .trim_start_matches('|')
            .split('|')
            .next()
            .unwrap_or("")
            .trim();
        let name = first.strip_prefix('`').and_then(|f| f.strip_suffix('`'));
        match name {
            Some(v)
                if v.strip_prefix(PREFIX)
                    .is_some_and(|r| !r.is_empty() && r.bytes().all(is_name_byte)) =>
            {
                names.push((v.to_string(), n));
            }
            _ => {
                return Err(format!(
                    "README.md line {n}: the first column should be one `GRADSYNC_...` name in backticks, found {first:?}"
                ));
            }
        }
    }
    Ok(names)
}

// ------------------------------------------------------------------------------------------
// The tests

#[test]
fn readme_configuration_table_lists_exactly_the_variables_the_code_reads() {
    let root = workspace_root();
    let readme = fs::read_to_string(root.join("README.md")).expect("README.md");
    let table = names_in_readme(&readme).unwrap_or_else(|e| panic!("{e}"));
    let found = names_in_code(&root);
    assert!(
        found.files > 20,
        "only {} source files scanned",
        found.files
    );
    assert!(
        found.read.contains_key("GRADSYNC_TIMEOUT"),
        "the scan found no GRADSYNC_TIMEOUT: the scanner is broken, not the README"
    );

    let mut problems = Vec::new();

    let mut in_table = BTreeMap::new();
    for (name, line) in &table {
        if let Some(first) = in_table.insert(name.clone(), *line) {
            problems.push(format!(
                "{name} has two rows in the table (lines {first} and {line})"
            ));
        }
    }

    let mut read = found.read.clone();
    // Names built at run time.
    let built_files: BTreeSet<&str> = found.built.iter().map(|(f, _)| f.as_str()).collect();
    for (file, site) in &found.built {
        if !BUILT_NAMES.iter().any(|(f, _)| file.ends_with(f)) {
            problems.push(format!(
                "{site}: a GRADSYNC_ name is built at run time here; list the names it can make in BUILT_NAMES"
            ));
        }
    }
    for (file, names) in BUILT_NAMES {
        if !built_files.iter().any(|f| f.ends_with(file)) {
            problems.push(format!(
                "BUILT_NAMES lists {file}, which builds no GRADSYNC_ name any more"
            ));
        }
        for n in *names {
            read.entry(n.to_string())
                .or_insert_with(|| format!("built in {file}"));
        }
    }

    for (name, why) in NOT_CONFIGURATION {
        if read.remove(*name).is_none() {
            problems.push(format!(
                "{name} is excluded as not configuration ({why}) but the code no longer names it: drop it from NOT_CONFIGURATION"
            ));
        }
        if let Some(line) = in_table.get(*name) {
            problems.push(format!(
                "{name} is in the table (README.md line {line}) but excluded as not configuration ({why})"
            ));
        }
    }

    for (name, site) in &read {
        if !in_table.contains_key(name) {
            problems.push(format!(
                "{name} is read ({site}) but has no row in the README's configuration table"
            ));
        }
    }
    for (name, line) in &in_table {
        let excluded = NOT_CONFIGURATION.iter().any(|(n, _)| n == name);
        if !read.contains_key(name) && !excluded {
            problems.push(format!(
                "{name} has a row in the configuration table (README.md line {line}) but nothing reads it"
            ));
        }
    }

    assert!(
        problems.is_empty(),
        "the README's configuration table and the code disagree:\n  {}",
        problems.join("\n  ")
    );
}

/// The scanner itself: literals after tricky tokens, comments, test-only items.
#[test]
fn scanner_sees_literals_and_skips_comments_and_test_code() {
    let src = r####"
// "GRADSYNC_IN_LINE_COMMENT"
/* "GRADSYNC_IN_BLOCK" /* nested "GRADSYNC_NESTED" */ still comment */
fn f<'a>(x: &'a str) -> char {
    let q = '"';
    let e = '\'';
    let _ = std::env::var("GRADSYNC_ONE");
    let _ = r#"GRADSYNC_RAW"#;
    let _ = b"GRADSYNC_BYTES";
    let _ = "say \"GRADSYNC_QUOTED\"";
    let _ = format!("GRADSYNC_{}", x);
    let _ = "set GRADSYNC_MENTIONED to fix it";
    q
}
#[cfg(test)]
mod tests {
    fn g() { let _ = "GRADSYNC_IN_TEST"; let _ = '}'; }
}
#[cfg(test)]
fn helper() -> &'static str { "GRADSYNC_TEST_FN" }
#[cfg(test)]
mod more;
const AFTER: &str = "GRADSYNC_AFTER";
"####;
    let lx = lex_rust(src);
    let (ranges, mods) = test_items(&lx.masked);
    assert_eq!(mods, vec!["more".to_string()]);
    let live: Vec<&str> = lx
        .literals
        .iter()
        .filter(|l| !ranges.iter().any(|r| r.contains(&l.offset)))
        .map(|l| l.text.as_str())
        .collect();
    let mut found = Found::default();
    let lits: Vec<Literal> = lx
        .literals
        .iter()
        .filter(|l| !ranges.iter().any(|r| r.contains(&l.offset)))
        .map(|l| Literal {
            text: l.text.clone(),
            offset: l.offset,
        })
        .collect();
    found.add(Path::new("/"), Path::new("/x.rs"), src, &lits);
    let read: Vec<&str> = found.read.keys().map(String::as_str).collect();
    assert_eq!(
        read,
        [
            "GRADSYNC_AFTER",
            "GRADSYNC_BYTES",
            "GRADSYNC_ONE",
            "GRADSYNC_RAW"
        ],
        "{live:?}"
    );
    assert_eq!(found.built.len(), 1, "{:?}", found.built);

    let py = r#"
import os
# os.environ.get("GRADSYNC_COMMENTED")
"""Docs: set ``GRADSYNC_DOC`` to ..."""
HOST = os.environ.get("GRADSYNC_PY_ONE") or os.environ.get('GRADSYNC_PY_TWO')
s = r"\"GRADSYNC_NOT_ALONE"
t = f"GRADSYNC_{name}"
"#;
    let lx = lex_python(py);
    let mut found = Found::default();
    found.add(Path::new("/"), Path::new("/x.py"), py, &lx.literals);
    let read: Vec<&str> = found.read.keys().map(String::as_str).collect();
    assert_eq!(read, ["GRADSYNC_PY_ONE", "GRADSYNC_PY_TWO"]);
    assert_eq!(found.built.len(), 1, "{:?}", found.built);

    let readme = "# x\n## Configuration\n\n| variable | default | meaning |\n|---|---|---|\n| `GRADSYNC_A` | `1` | a |\n| `GRADSYNC_B` | unset | b |\n\nafter\n## Next\n| `GRADSYNC_C` | | |\n";
    let names: Vec<String> = names_in_readme(readme)
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, ["GRADSYNC_A", "GRADSYNC_B"]);
}
