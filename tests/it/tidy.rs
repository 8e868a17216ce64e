//! Project rules checked as tests: the crate arrows point one way, no test is
//! switched off, and the executor stays in pieces a reader can hold.

use std::path::{Path, PathBuf};

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// Internal (`meshplan-*`) dependencies of a crate, read from its manifest.
fn internal_deps(crate_dir: &str) -> Vec<String> {
    let text = std::fs::read_to_string(format!("{ROOT}/{crate_dir}/Cargo.toml")).expect("manifest");
    let mut deps = Vec::new();
    let mut in_deps = false;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_deps = line == "[dependencies]"
                || line.starts_with("[dependencies.")
                || line == "[dev-dependencies]";
            continue;
        }
        if in_deps {
            if let Some((name, _)) = line.split_once('=') {
                let name = name.trim();
                if name.starts_with("meshplan") || ["cudarc", "good_lp"].contains(&name) {
                    deps.push(name.to_string());
                }
            }
        }
    }
    deps
}

#[test]
fn dependency_arrows_point_one_way() {
    let allowed: &[(&str, &[&str])] = &[
        ("ir", &[]),
        ("cost_model", &["meshplan-ir"]),
        (
            "planner",
            &["meshplan-ir", "meshplan-cost-model", "good_lp"],
        ),
        ("kernels", &["cudarc"]),
        (
            "executor",
            &[
                "meshplan-ir",
                "meshplan-kernels",
                "meshplan-launch",
                "cudarc",
            ],
        ),
        ("launch", &[]),
        ("viz", &["meshplan-ir", "meshplan-cost-model"]),
        ("export", &["meshplan-ir"]),
    ];
    for (dir, ok) in allowed {
        for dep in internal_deps(dir) {
            assert!(
                ok.contains(&dep.as_str()),
                "{dir}/Cargo.toml depends on `{dep}`: only {ok:?} are allowed (ARCHITECTURE.md)"
            );
        }
    }
}

/// The `[dependencies]` entry of `name` in a crate's manifest, joined onto one line.
fn dependency_entry(crate_dir: &str, name: &str) -> Option<String> {
    let text = std::fs::read_to_string(format!("{ROOT}/{crate_dir}/Cargo.toml")).expect("manifest");
    let start = text.find(&format!("\n{name} = "))?;
    let rest = &text[start + 1..];
    // An inline table may span lines up to its closing brace.
    let end = if rest[name.len() + 3..].trim_start().starts_with('{') {
        rest.find('}').map_or(rest.len(), |i| i + 1)
    } else {
        rest.find('\n').unwrap_or(rest.len())
    };
    Some(rest[..end].split_whitespace().collect::<Vec<_>>().join(" "))
}

#[test]
fn cudarc_is_optional_and_stays_below_the_planner() {
    // The default build must not pull cudarc: only the `cuda` features bring it in.
    let entry = dependency_entry("kernels", "cudarc").expect("kernels depends on cudarc");
    assert!(entry.contains("optional = true"), "{entry}");
    assert!(entry.contains("default-features = false"), "{entry}");
    assert!(
        entry.contains("\"dynamic-loading\""),
        "loaded at run time: {entry}"
    );
    if let Some(entry) = dependency_entry("executor", "cudarc") {
        assert!(entry.contains("optional = true"), "executor: {entry}");
    }
    for dir in ["ir", "cost_model", "planner", "viz", "export", "."] {
        assert!(
            dependency_entry(dir, "cudarc").is_none(),
            "{dir}/Cargo.toml names cudarc: only kernels/ and executor/ may, behind `cuda`"
        );
    }
    // The binary and the executor forward the features to the kernels.
    let root = std::fs::read_to_string(format!("{ROOT}/Cargo.toml")).expect("manifest");
    assert!(
        root.contains("cuda = [\"meshplan-executor/cuda\"]"),
        "root forwards `cuda`"
    );
    let exec = std::fs::read_to_string(format!("{ROOT}/executor/Cargo.toml")).expect("manifest");
    assert!(
        exec.contains("cuda = [\"meshplan-kernels/cuda\"]"),
        "executor forwards `cuda`"
    );
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.file_name().is_some_and(|n| n == "target" || n == ".git") {
            continue;
        }
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn no_test_is_ignored_or_expects_a_panic() {
    let mut files = Vec::new();
    rust_files(Path::new(ROOT), &mut files);
    assert!(files.len() > 10, "found the sources");
    // Spelled in pieces so this file does not trip its own check.
    let banned = [concat!("#[", "ignore"), concat!("#[", "should_panic")];
    for f in files {
        let text = std::fs::read_to_string(&f).expect("source");
        for b in banned {
            assert!(
                !text.contains(b),
                "{} contains `{b}`: a test that does not run proves nothing",
                f.display()
            );
        }
    }
}

/// Whether `line` opens a function item (`fn`, after visibility and qualifiers).
fn opens_fn(line: &str) -> bool {
    let t = line.trim_start();
    let Some((head, _)) = t.split_once("fn ") else {
        return false;
    };
    (head.split_whitespace())
        .all(|w| w.starts_with("pub") || matches!(w, "const" | "unsafe" | "async" | "extern"))
}

/// Functions of `text` longer than `most` lines, as (first line, length): a body
/// runs from the signature to the closing brace at the signature's indent;
/// declarations without a body (a trait's) are skipped.
fn long_fns(text: &str, most: usize) -> Vec<(usize, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if !opens_fn(line) {
            continue;
        }
        let end_of = |j: &usize| {
            let l = lines[*j].trim_end();
            l.ends_with('{') || l.ends_with(';')
        };
        let Some(open) = (i..lines.len()).find(end_of) else {
            continue;
        };
        if lines[open].trim_end().ends_with(';') {
            continue;
        }
        let indent = &line[..line.len() - line.trim_start().len()];
        let close = format!("{indent}}}");
        if let Some(end) = (open..lines.len()).find(|&j| lines[j] == close) {
            if end - i + 1 > most {
                out.push((i + 1, end - i + 1));
            }
        }
    }
    out
}

#[test]
fn executor_files_and_functions_stay_small() {
    // One executor a newcomer can hold in their head: no file of it over 800 lines,
    // no function over 100.
    let mut files = Vec::new();
    rust_files(&Path::new(ROOT).join("executor/src"), &mut files);
    assert!(files.len() > 40, "found the executor's sources");
    let mut over = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).expect("source");
        let n = text.lines().count();
        if n > 800 {
            over.push(format!("{}: {n} lines", f.display()));
        }
        for (at, len) in long_fns(&text, 100) {
            over.push(format!("{}:{at}: a function of {len} lines", f.display()));
        }
    }
    assert!(over.is_empty(), "split these:\n{}", over.join("\n"));
    // The measure finds what it must: a body over the limit, not a declaration.
    let body = format!(
        "    pub(crate) fn f(\n        x: u8,\n    ) -> u8 {{\n{}    }}\n",
        "        x;\n".repeat(99)
    );
    assert_eq!(long_fns(&body, 100), [(1, 103)]);
    assert!(long_fns("    fn g(&self) -> u8;\n}\n", 1).is_empty());
}

#[test]
fn every_topology_loads() {
    let dir = format!("{ROOT}/topologies");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).expect("topologies/").flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "yaml") {
            let c =
                meshplan_cost_model::load_cluster(&p, None).unwrap_or_else(|err| panic!("{err}"));
            assert!(c.gpus() >= 1);
            n += 1;
        }
    }
    assert!(n >= 6, "six shipped topologies, found {n}");
}
