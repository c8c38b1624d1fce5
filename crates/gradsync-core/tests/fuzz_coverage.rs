//! The README says every parser of peer bytes has a property-based fuzz test. Here that is
//! checked on the sources: every `pub fn parse` of the workspace that returns a `WireError`
//! (a wire view's parsed form, or a format parsed from bytes) names a type, the view it reads
//! (`&DataHeader<T>` -> `DataHeader`) and the type it belongs to (`DataHeaderRepr`); some
//! `fn fuzz_*` test of the same crate (its sources or its `tests/`) must mention one of them.

use std::fs;
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// What a parser reads: the view of its argument (`&DataHeader<T>` -> `DataHeader`), if any,
/// and the type of the `impl` it sits in.
fn parsed_types(lines: &[&str], at: usize) -> Vec<String> {
    let sig: String = lines[at..(at + 3).min(lines.len())].concat();
    let word = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut out = Vec::new();
    if let Some((_, t)) = sig.split_once('(').and_then(|(_, a)| a.split_once(": &")) {
        let t = t.trim_start();
        if t.starts_with(|c: char| c.is_ascii_uppercase()) {
            out.push(word(t));
        }
    }
    let owner = lines[..at].iter().rev().find_map(|l| {
        // `impl<'a> ControlRepr<'a> {`, `impl Signature {`: the last type name before `{`.
        let rest = l.trim_start().strip_prefix("impl")?;
        let rest = rest.split('{').next()?.rsplit(" for ").next()?;
        rest.split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .rfind(|w| w.starts_with(|c: char| c.is_ascii_uppercase()))
            .map(str::to_string)
    });
    out.extend(owner);
    out
}

/// The text of every `fn fuzz_*` in `src`: from its name to the next `fn `.
fn fuzz_bodies(src: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = src;
    while let Some(i) = rest.find("fn fuzz_") {
        let body = &rest[i + 3..];
        let end = body.find("fn ").unwrap_or(body.len());
        out.push(body[..end].to_string());
        rest = &body[end..];
    }
    out
}

fn mentions(text: &str, word: &str) -> bool {
    text.match_indices(word).any(|(i, _)| {
        let before = text[..i].chars().next_back();
        let after = text[i + word.len()..].chars().next();
        let ident = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
        !ident(before) && !ident(after)
    })
}

#[test]
fn every_parser_of_peer_bytes_has_a_fuzz_test() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut crates: Vec<PathBuf> = fs::read_dir(root.join("crates"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("src").is_dir())
        .collect();
    crates.sort();
    let mut parsers = 0;
    let mut missing = Vec::new();
    for c in &crates {
        let mut files = Vec::new();
        rust_files(&c.join("src"), &mut files);
        let mut tests = Vec::new();
        rust_files(&c.join("tests"), &mut tests);
        files.sort();
        let sources: Vec<(PathBuf, String)> = files
            .into_iter()
            .map(|f| {
                let s = fs::read_to_string(&f).unwrap();
                (f, s)
            })
            .collect();
        let fuzz: Vec<String> = sources
            .iter()
            .map(|(_, s)| s.clone())
            .chain(tests.iter().map(|f| fs::read_to_string(f).unwrap()))
            .flat_map(|s| fuzz_bodies(&s))
            .collect();
        for (file, src) in &sources {
            let lines: Vec<&str> = src.lines().collect();
            for (i, l) in lines.iter().enumerate() {
                if !l.trim_start().starts_with("pub fn parse") {
                    continue;
                }
                let sig: String = lines[i..(i + 3).min(lines.len())].concat();
                if !sig.contains("WireError") {
                    continue;
                }
                parsers += 1;
                let types = parsed_types(&lines, i);
                assert!(
                    !types.is_empty(),
                    "{}:{}: cannot tell what it parses",
                    file.display(),
                    i + 1
                );
                if !fuzz.iter().any(|b| types.iter().any(|t| mentions(b, t))) {
                    missing.push(format!("{}:{} parses {types:?}", file.display(), i + 1));
                }
            }
        }
    }
    assert!(
        parsers >= 10,
        "found only {parsers} parsers: is the scan broken?"
    );
    assert!(
        missing.is_empty(),
        "parsers of peer bytes without a fuzz_* test naming what they parse:\n{}",
        missing.join("\n")
    );
}
