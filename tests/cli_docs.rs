//! The documentation against the code: every flag reference in `docs/guide/` is the `--help`
//! output of the built binary, every command has one, and every relative link in the README and
//! `docs/` leads to a file.
//!
//! A reference is a marked block in a page:
//!
//! ````text
//! <!-- hslake capture --help -->
//! ```text
//! (the output of `hslake capture --help`)
//! ```
//! <!-- end -->
//! ````
//!
//! `HSLAKE_BLESS_DOCS=1 cargo test --test cli_docs` rewrites every block from the binary.
#![cfg(all(feature = "capture", feature = "sql"))]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const END: &str = "<!-- end -->";
const BLESS: &str = "HSLAKE_BLESS_DOCS=1 cargo test --test cli_docs";

/// Runs the binary with `args` as a user at a 100-column terminal would, without HSLAKE_*
/// variables (clap prints an `env` flag's current value in the help).
fn help_text(args: &[&str]) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hslake"));
    cmd.args(args).env("COLUMNS", "100");
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("HSLAKE_") {
            cmd.env_remove(k);
        }
    }
    let out = cmd.output().expect("run hslake");
    assert!(
        out.status.success(),
        "hslake {}: exit {:?}: {}",
        args.join(" "),
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("help is UTF-8")
}

/// Every Markdown file the docs test covers: the README and everything under `docs/`.
fn pages() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.expect("directory entry").path())
            .collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|e| e == "md") {
                out.push(p);
            }
        }
    }
    let mut out = vec![Path::new(ROOT).join("README.md")];
    walk(&Path::new(ROOT).join("docs"), &mut out);
    out
}

fn relative(p: &Path) -> String {
    p.strip_prefix(ROOT).unwrap_or(p).display().to_string()
}

/// One marked block: the command it documents and where its fenced text sits in the page.
struct Block {
    args: Vec<String>,
    /// Byte range of the lines between the marker and `<!-- end -->`.
    body: std::ops::Range<usize>,
}

/// The page's marked blocks, or an error naming the line of a malformed one.
fn blocks(text: &str) -> Result<Vec<Block>, String> {
    let mut found = Vec::new();
    let mut open: Option<(usize, Vec<String>, usize)> = None;
    let mut pos = 0;
    for (n, line) in text.split_inclusive('\n').enumerate() {
        let start = pos;
        pos += line.len();
        let t = line.trim();
        if let Some(inner) = t
            .strip_prefix("<!-- hslake ")
            .and_then(|s| s.strip_suffix("-->"))
        {
            if let Some((at, ..)) = open {
                return Err(format!(
                    "line {}: block opened at line {at} has no {END}",
                    n + 1
                ));
            }
            let args = inner.split_whitespace().map(String::from).collect();
            open = Some((n + 1, args, pos));
        } else if t == END {
            let Some((_, args, body_start)) = open.take() else {
                return Err(format!("line {}: {END} without a block", n + 1));
            };
            found.push(Block {
                args,
                body: body_start..start,
            });
        }
    }
    match open {
        Some((at, ..)) => Err(format!("line {at}: block has no {END}")),
        None => Ok(found),
    }
}

fn fenced(help: &str) -> String {
    format!("```text\n{}```\n", help)
}

#[test]
fn guide_flag_references_match_the_binary_s_help() {
    let bless = std::env::var_os("HSLAKE_BLESS_DOCS").is_some_and(|v| v == "1");
    let mut stale = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("read page");
        let found = blocks(&text).unwrap_or_else(|e| panic!("{}: {e}", relative(&page)));
        let mut rewritten = String::new();
        let mut copied = 0;
        for b in &found {
            let want = fenced(&help_for(&b.args));
            if text[b.body.clone()] != want {
                stale.push(format!("{}: hslake {}", relative(&page), b.args.join(" ")));
            }
            rewritten.push_str(&text[copied..b.body.start]);
            rewritten.push_str(&want);
            copied = b.body.end;
        }
        rewritten.push_str(&text[copied..]);
        if bless && rewritten != text {
            std::fs::write(&page, rewritten).expect("write page");
        }
    }
    assert!(
        bless || stale.is_empty(),
        "flag references out of date with the binary's --help:\n  {}\nregenerate them with `{BLESS}`",
        stale.join("\n  ")
    );
}

/// The subcommands a help text lists under `Commands:`, without clap's own `help`.
fn subcommands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| l.trim() != "Commands:")
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(String::from)
        .collect()
}

/// The `--help` text of every visible command, keyed by its arguments (`jobs submit --help`),
/// found by walking the `Commands:` lists from the top (the GPU commands' through `hslake`, so
/// from `hslake-gpu`). Each level's commands run at once, and both tests share the walk, since
/// every run of a GPU command pays libtorch's start-up.
fn every_help() -> &'static BTreeMap<String, String> {
    static HELP: OnceLock<BTreeMap<String, String>> = OnceLock::new();
    HELP.get_or_init(|| {
        let mut all = BTreeMap::new();
        let mut level: Vec<Vec<String>> = vec![vec![]];
        while !level.is_empty() {
            let texts: Vec<(Vec<String>, String)> = std::thread::scope(|scope| {
                let running: Vec<_> = level
                    .iter()
                    .map(|path| {
                        scope.spawn(move || {
                            let mut args: Vec<&str> = path.iter().map(String::as_str).collect();
                            args.push("--help");
                            (path.clone(), help_text(&args))
                        })
                    })
                    .collect();
                running
                    .into_iter()
                    .map(|h| h.join().expect("help thread"))
                    .collect()
            });
            level = Vec::new();
            for (path, text) in texts {
                for sub in subcommands(&text) {
                    let mut next = path.clone();
                    next.push(sub);
                    level.push(next);
                }
                if !path.is_empty() {
                    all.insert(format!("{} --help", path.join(" ")), text);
                }
            }
        }
        all
    })
}

/// The help text a block documents: from the shared walk, or run for itself when the block
/// names something the walk does not list (a hidden command, or a flag other than `--help`).
fn help_for(args: &[String]) -> String {
    match every_help().get(&args.join(" ")) {
        Some(text) => text.clone(),
        None => help_text(&args.iter().map(String::as_str).collect::<Vec<_>>()),
    }
}

#[test]
fn every_visible_command_has_a_flag_reference_in_the_guide() {
    let mut documented = BTreeSet::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("read page");
        for b in blocks(&text).unwrap_or_else(|e| panic!("{}: {e}", relative(&page))) {
            documented.insert(b.args.join(" "));
        }
    }
    let missing: Vec<String> = every_help()
        .keys()
        .filter(|k| !documented.contains(*k))
        .map(|k| format!("hslake {k}"))
        .collect();
    assert!(
        missing.is_empty(),
        "commands without a flag reference in docs/guide/ (add a marked block to the page of \
         their command group, then run `{BLESS}`):\n  {}",
        missing.join("\n  ")
    );
}

/// Relative links in a Markdown text as (file, anchor): `](file#anchor)`, skipping URLs and
/// fenced code. A link to an anchor of the page itself has an empty file.
fn relative_links(text: &str) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    let mut in_fence = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence {
            continue;
        }
        let mut rest = line;
        while let Some(i) = rest.find("](") {
            rest = &rest[i + 2..];
            let Some(j) = rest.find(')') else { break };
            let target = rest[..j].trim();
            rest = &rest[j..];
            if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (file, anchor) = match target.split_once('#') {
                Some((f, a)) => (f, Some(a.to_string())),
                None => (target, None),
            };
            out.push((file.to_string(), anchor));
        }
    }
    out
}

/// The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as
/// hyphens, a repeated heading numbered from `-1`.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeMap::<String, usize>::new();
    let mut out = BTreeSet::new();
    let mut in_fence = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
        }
        let Some(title) = line.strip_prefix('#').filter(|_| !in_fence) else {
            continue;
        };
        let slug: String = title
            .trim_start_matches('#')
            .trim()
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
            .map(|c| if c == ' ' { '-' } else { c })
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

#[test]
fn every_relative_link_in_the_docs_leads_to_a_file_and_heading() {
    let mut broken = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("read page");
        let dir = page.parent().expect("page has a folder");
        for (file, anchor) in relative_links(&text) {
            let target = if file.is_empty() {
                page.clone()
            } else {
                dir.join(&file)
            };
            let shown = match &anchor {
                Some(a) => format!("{file}#{a}"),
                None => file.clone(),
            };
            if !target.exists() {
                broken.push(format!("{}: {shown}: no such file", relative(&page)));
                continue;
            }
            let Some(anchor) = anchor else { continue };
            let heads = if target.is_dir() {
                BTreeSet::new()
            } else {
                anchors(&std::fs::read_to_string(&target).expect("read link target"))
            };
            if !heads.contains(&anchor) {
                broken.push(format!("{}: {shown}: no such heading", relative(&page)));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "links to nothing:\n  {}",
        broken.join("\n  ")
    );
}

mod parsing {
    use super::*;

    #[test]
    fn a_block_without_its_end_marker_is_refused_by_line() {
        let err = blocks("x\n<!-- hslake ls --help -->\n```text\n```\n")
            .err()
            .expect("refused");
        assert!(err.contains("line 2"), "{err}");
    }

    #[test]
    fn a_block_s_body_is_the_text_between_its_markers() {
        let text = "a\n<!-- hslake jobs ls --help -->\n```text\nold\n```\n<!-- end -->\nb\n";
        let found = blocks(text).expect("parsed");
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].args, ["jobs", "ls", "--help"]);
        assert_eq!(&text[found[0].body.clone()], "```text\nold\n```\n");
    }

    #[test]
    fn links_in_code_and_urls_are_not_checked() {
        let text = "[a](guide/x.md#y) [b](https://e.org/z)\n```\n[c](nowhere.md)\n```\n";
        assert_eq!(
            relative_links(text),
            [("guide/x.md".to_string(), Some("y".to_string()))]
        );
    }

    #[test]
    fn headings_get_github_s_anchors() {
        let text =
            "# SQL: hslake vs. DuckDB\n## `hslake prepare`\n## Notes\n## Notes\n```\n# x\n```\n";
        let want = ["hslake-prepare", "notes", "notes-1", "sql-hslake-vs-duckdb"];
        assert_eq!(anchors(text).into_iter().collect::<Vec<_>>(), want);
    }
}
