//! Docs that cannot rot: every relative link in the project's Markdown
//! (README, docs/, examples/, SECURITY, CHANGELOG, ascend-sys) reaches a
//! file that exists and, with a `#fragment`, a heading of that file; every
//! `ascend-bench` command line the docs show names a real subcommand whose
//! `--help` lists each flag shown; every flag shown for the proxy
//! (`ascend-pd-proxy` / `python -m ascend_pd.proxy`) is one its argument
//! parser defines.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The Markdown files users read: the root's, docs/, examples/, ascend-sys/.
fn markdown_files() -> Vec<PathBuf> {
    let root = root();
    let mut out = Vec::new();
    for dir in [
        "",
        "docs",
        "examples",
        "examples/vllm",
        "ascend-sys",
        "configs/vllm",
        "benchmarks",
    ] {
        let Ok(entries) = std::fs::read_dir(root.join(dir)) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "md") {
                out.push(p);
            }
        }
    }
    out.sort();
    assert!(
        out.len() >= 10,
        "expected the README and the docs tree, found {out:?}"
    );
    out
}

/// Lines outside fenced code blocks, with their 1-based numbers.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push((i + 1, line));
        }
    }
    out
}

/// GitHub's anchor for a heading: lower case, punctuation other than `-`
/// and `_` dropped, spaces to `-`; a repeated anchor gets `-1`, `-2`, ...
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for (_, line) in prose_lines(text) {
        let t = line.trim_start();
        if !t.starts_with('#') {
            continue;
        }
        let title = t.trim_start_matches('#');
        if !title.starts_with(' ') {
            continue;
        }
        let slug: String = title
            .trim()
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                _ => None,
            })
            .collect();
        let n = seen.entry(slug.clone()).or_insert(0);
        out.insert(if *n == 0 {
            slug.clone()
        } else {
            format!("{slug}-{n}")
        });
        *n += 1;
    }
    out
}

/// Inline links `[text](target)` of a line, outside inline code.
fn links(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_code = false;
    let b = line.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'`' => in_code = !in_code,
            b']' if !in_code && i + 1 < b.len() && b[i + 1] == b'(' => {
                if let Some(end) = line[i + 2..].find(')') {
                    out.push(line[i + 2..i + 2 + end].trim().to_string());
                    i += 2 + end;
                }
            }
            _ => {}
        }
        i += 1;
    }
    out
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        for (n, line) in prose_lines(&text) {
            for target in links(line) {
                if target.starts_with("http://")
                    || target.starts_with("https://")
                    || target.starts_with("mailto:")
                {
                    continue;
                }
                checked += 1;
                let (path, fragment) = match target.split_once('#') {
                    Some((p, f)) => (p, Some(f)),
                    None => (target.as_str(), None),
                };
                let dest = if path.is_empty() {
                    file.clone()
                } else {
                    file.parent().unwrap().join(path)
                };
                let shown = format!(
                    "{}:{n}: ({target})",
                    file.strip_prefix(root()).unwrap().display()
                );
                if !dest.exists() {
                    broken.push(format!("{shown}: {} does not exist", dest.display()));
                    continue;
                }
                if let Some(f) = fragment {
                    let Ok(dest_text) = std::fs::read_to_string(&dest) else {
                        broken.push(format!("{shown}: a #fragment on a file that is not text"));
                        continue;
                    };
                    let known = anchors(&dest_text);
                    if !known.contains(f) {
                        broken.push(format!(
                            "{shown}: no heading with anchor #{f} (it has: {known:?})"
                        ));
                    }
                }
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} relative links found: is the docs tree there?"
    );
    assert!(
        broken.is_empty(),
        "broken links in the docs:\n{}",
        broken.join("\n")
    );
}

/// `ascend-bench` command lines in a Markdown file: the text after each
/// `ascend-bench ` (continuation lines joined) up to the end of its inline
/// code, a comment or an unescaped table separator. The commands table of
/// the benchmark page names subcommands without the binary's name.
fn bench_invocations(
    file: &Path,
    text: &str,
    subcommands: &BTreeSet<String>,
) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let lines: Vec<&str> = text.lines().collect();
    let mut i = 0;
    while i < lines.len() {
        let mut line = lines[i].to_string();
        let n = i + 1;
        while line.trim_end().ends_with('\\') && i + 1 < lines.len() {
            line = format!(
                "{} {}",
                line.trim_end().trim_end_matches('\\'),
                lines[i + 1].trim()
            );
            i += 1;
        }
        i += 1;
        let mut starts: Vec<usize> = line
            .match_indices("ascend-bench ")
            .map(|(at, _)| at + "ascend-bench ".len())
            .collect();
        if file.ends_with("docs/benchmark.md") && line.starts_with("| `") {
            let first = line[3..].split_whitespace().next().unwrap_or("");
            if subcommands.contains(first.trim_end_matches('`')) {
                starts.push(3);
            }
        }
        for at in starts {
            let rest = &line[at..];
            let mut end = rest.len();
            let b = rest.as_bytes();
            for (k, &c) in b.iter().enumerate() {
                let stop = c == b'`'
                    || (c == b'|' && (k == 0 || b[k - 1] != b'\\'))
                    || (c == b'#' && k > 0 && b[k - 1] == b' ');
                if stop {
                    end = k;
                    break;
                }
            }
            out.push((n, rest[..end].to_string()));
        }
    }
    out
}

fn help_of(bin: &str, args: &[&str]) -> String {
    let out = Command::new(bin)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {bin} {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{bin} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn flags_in(text: &str) -> Vec<String> {
    text.split(|c: char| c.is_whitespace() || "[]()|,=\"'".contains(c))
        .filter(|w| {
            w.starts_with("--")
                && w.len() > 2
                && w[2..].starts_with(|c: char| c.is_ascii_lowercase())
        })
        .map(|w| w.trim_end_matches(['.', ':', ';']).to_string())
        .collect()
}

#[test]
fn every_ascend_bench_command_and_flag_the_docs_show_exists() {
    let bin = env!("CARGO_BIN_EXE_ascend-bench");
    let top = help_of(bin, &["--help"]);
    // The top-level help lists each command at two spaces of indent.
    let subcommands: BTreeSet<String> = top
        .lines()
        .filter(|l| l.starts_with("  ") && l[2..].starts_with(|c: char| c.is_ascii_lowercase()))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|w| *w != "help")
        .map(str::to_string)
        .collect();
    for must in [
        "run",
        "check-config",
        "doctor",
        "sender",
        "receiver",
        "proxy",
        "channel",
        "soak",
    ] {
        assert!(
            subcommands.contains(must),
            "ascend-bench --help lists no `{must}`: {subcommands:?}\n{top}"
        );
    }
    let mut helps: BTreeMap<String, String> = BTreeMap::new();
    let mut problems = Vec::new();
    let mut checked_flags = 0;
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        let shown = file.strip_prefix(root()).unwrap().display().to_string();
        for (n, inv) in bench_invocations(&file, &text, &subcommands) {
            let mut words = inv.split_whitespace().filter(|w| *w != "--");
            let Some(first) = words.next() else { continue };
            let first = first.trim_end_matches(['`', ',', '.', ')', ':']);
            let sub = if subcommands.contains(first) {
                Some(first.to_string())
            } else if first.starts_with("--") {
                None
            } else if first.chars().all(|c| c.is_ascii_uppercase() || c == '_') || first.is_empty()
            {
                continue; // a placeholder: `ascend-bench COMMAND --help`
            } else if first.chars().all(|c| c.is_ascii_lowercase() || c == '-') {
                problems.push(format!(
                    "{shown}:{n}: `ascend-bench {first}` is not a subcommand ({subcommands:?})"
                ));
                continue;
            } else {
                continue; // prose after the name ("ascend-bench's ...")
            };
            let help = match &sub {
                // Global flags (`--emulator`) are in the top-level help.
                Some(s) => {
                    helps
                        .entry(s.clone())
                        .or_insert_with(|| help_of(bin, &[s, "--help"]))
                        .clone()
                        + &top
                }
                None => {
                    let mut all = top.clone();
                    for s in &subcommands {
                        all.push_str(
                            helps
                                .entry(s.clone())
                                .or_insert_with(|| help_of(bin, &[s, "--help"])),
                        );
                    }
                    all
                }
            };
            for flag in flags_in(&inv) {
                checked_flags += 1;
                let listed = help
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                    .any(|w| w == flag);
                if !listed {
                    problems.push(format!(
                        "{shown}:{n}: `ascend-bench {}` shows {flag}, which its --help does not list",
                        sub.as_deref().unwrap_or("")
                    ));
                }
            }
        }
    }
    assert!(
        checked_flags > 40,
        "only {checked_flags} ascend-bench flags found in the docs"
    );
    assert!(
        problems.is_empty(),
        "the docs show what ascend-bench does not have:\n{}",
        problems.join("\n")
    );
}

#[test]
fn every_proxy_flag_the_docs_show_exists() {
    let src = std::fs::read_to_string(root().join("python/ascend_pd/proxy.py")).unwrap();
    let mut problems = Vec::new();
    let mut checked = 0;
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        let shown = file.strip_prefix(root()).unwrap().display().to_string();
        let mut joined = String::new();
        let mut first_line = 0;
        for (i, line) in text.lines().enumerate() {
            if joined.is_empty() {
                first_line = i + 1;
            }
            joined.push_str(line.trim_end().trim_end_matches('\\'));
            joined.push(' ');
            if line.trim_end().ends_with('\\') {
                continue;
            }
            for name in ["ascend-pd-proxy ", "ascend_pd.proxy "] {
                for (at, _) in joined.match_indices(name) {
                    let rest = &joined[at + name.len()..];
                    let rest = &rest[..rest.find(['`', '#']).unwrap_or(rest.len())];
                    for flag in flags_in(rest) {
                        if flag == "--help" {
                            continue; // argparse's own
                        }
                        checked += 1;
                        if !src.contains(&format!("\"{flag}\"")) {
                            problems.push(format!("{shown}:{first_line}: the proxy has no {flag}"));
                        }
                    }
                }
            }
            joined.clear();
        }
    }
    assert!(checked >= 3, "only {checked} proxy flags found in the docs");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// benchmarks/README.md: every `--flag` it shows in inline code or a code
/// block is the engine benchmark's (benchmarks/engine_bench.py) or one of
/// the `vllm serve` flags it runs the engines with (tests/vllm/serve_env.py).
#[test]
fn every_engine_bench_flag_the_docs_show_exists() {
    let src = std::fs::read_to_string(root().join("benchmarks/engine_bench.py")).unwrap()
        + &std::fs::read_to_string(root().join("tests/vllm/serve_env.py")).unwrap();
    let text = std::fs::read_to_string(root().join("benchmarks/README.md")).unwrap();
    let mut problems = Vec::new();
    let mut checked = 0;
    let mut in_block = false;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
            continue;
        }
        let code: Vec<&str> = if in_block {
            vec![line]
        } else {
            line.split('`').skip(1).step_by(2).collect()
        };
        for part in code {
            for flag in flags_in(part) {
                if flag == "--help" {
                    continue;
                }
                checked += 1;
                let quoted = format!("\"{flag}\"");
                if !src.contains(&quoted) && !src.contains(&format!("{flag} ")) {
                    problems.push(format!(
                        "benchmarks/README.md:{}: engine_bench.py has no {flag}",
                        i + 1
                    ));
                }
            }
        }
    }
    assert!(
        checked >= 5,
        "only {checked} flags found in benchmarks/README.md"
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
