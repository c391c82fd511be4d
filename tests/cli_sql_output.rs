//! End-to-end: `hslake sql --output` never overwrites what it reads. A path inside a dataset (a
//! live shard, the next manifest, either through a linked folder), a symbolic link and an
//! existing file without `--force` are refused by name before the query runs: the dataset still
//! verifies clean and nothing is left behind. With `--force` an ordinary file is replaced whole,
//! and a query that fails leaves no output.
#![cfg(feature = "sql")]

mod common;

use common::hslake;
use std::path::{Path, PathBuf};
use std::process::Output;

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A small dataset at `dir`, three shards: its URL.
fn synth(dir: &Path) -> String {
    let url = format!("file://{}", dir.display());
    let o = hslake(&[
        "synth",
        &url,
        "--samples",
        "12",
        "--seq-len",
        "3:6",
        "--hidden",
        "8",
        "--layers",
        "1",
        "--commit-every",
        "4",
        "--shard-mb",
        "0",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    url
}

/// Every entry under `dir` (links not followed) with its bytes, sorted.
fn listing(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let m = std::fs::symlink_metadata(&p).unwrap();
        if m.is_dir() {
            out.push((p.clone(), Vec::new()));
            out.extend(listing(&p));
        } else if m.is_symlink() {
            out.push((
                p.clone(),
                std::fs::read_link(&p)
                    .unwrap()
                    .into_os_string()
                    .into_encoded_bytes(),
            ));
        } else {
            out.push((p.clone(), std::fs::read(&p).unwrap()));
        }
    }
    out.sort();
    out
}

fn sql_to(url: &str, output: &Path, extra: &[&str]) -> Output {
    let out = output.to_str().unwrap();
    hslake(
        &[
            &[
                "sql",
                url,
                "SELECT sample_id FROM samples ORDER BY sample_id",
                "-o",
                out,
            ][..],
            extra,
        ]
        .concat(),
    )
}

#[test]
fn refuses_output_inside_a_dataset_through_links_and_over_existing_files() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = tmp.path().join("ds");
    let url = synth(&ds);
    let shard = std::fs::read_dir(ds.join("data"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .min()
        .unwrap();
    let versions = ds.join("_hslake/versions");
    let newest = std::fs::read_dir(&versions)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .max()
        .unwrap();
    let next: u64 = newest.trim_end_matches(".json").parse::<u64>().unwrap() + 1;
    let next_manifest = versions.join(format!("{next:020}.json"));
    let precious = tmp.path().join("precious.csv");
    std::fs::write(&precious, "precious").unwrap();
    let link = tmp.path().join("link.csv");
    std::os::unix::fs::symlink(&precious, &link).unwrap();
    let linked_data = tmp.path().join("linked-data");
    std::os::unix::fs::symlink(ds.join("data"), &linked_data).unwrap();
    let linked_versions = tmp.path().join("linked-versions");
    std::os::unix::fs::symlink(&versions, &linked_versions).unwrap();
    let inside = format!(
        "is inside the dataset at {} (it holds _hslake/)",
        ds.canonicalize().unwrap().display()
    );
    let before = listing(tmp.path());

    let shard_name = shard.file_name().unwrap();
    let manifest_name = next_manifest.file_name().unwrap();
    for (output, why, even_with_force) in [
        (shard.clone(), inside.as_str(), true),
        (next_manifest.clone(), &inside, true),
        (linked_data.join(shard_name), &inside, true),
        (linked_versions.join(manifest_name), &inside, true),
        (ds.join("results.csv"), &inside, true),
        (link.clone(), "is a symbolic link (to ", true),
        (
            precious.clone(),
            "exists; give --force to replace it",
            false,
        ),
    ] {
        let flags: &[&[&str]] = match even_with_force {
            true => &[&[], &["--force"]],
            false => &[&[]],
        };
        for extra in flags {
            let o = sql_to(&url, &output, extra);
            let err = stderr(&o);
            assert_eq!(
                o.status.code(),
                Some(1),
                "{} {extra:?}: {err}",
                output.display()
            );
            let named = format!("--output {}: ", output.display());
            assert!(
                err.contains(&named) && err.contains(why),
                "{} {extra:?}: expected {why:?} in {err}",
                output.display()
            );
        }
    }
    // Nothing written, nothing left behind, the dataset as it was.
    assert_eq!(listing(tmp.path()), before);
    let o = hslake(&["verify", &url]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn force_replaces_an_ordinary_file_whole_and_a_failed_query_leaves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let url = synth(&tmp.path().join("ds"));
    let out_dir = tmp.path().join("out");
    std::fs::create_dir(&out_dir).unwrap();
    let out = out_dir.join("ids.csv");
    std::fs::write(
        &out,
        "old contents that are longer than the result will be, to see them go\n".repeat(50),
    )
    .unwrap();
    let o = sql_to(&url, &out, &["--format", "csv", "--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let ids: Vec<String> = (0..12).map(|i| i.to_string()).collect();
    assert_eq!(
        std::fs::read_to_string(&out).unwrap(),
        format!("sample_id\n{}\n", ids.join("\n"))
    );
    // A new name needs no --force; a query that fails leaves no file, temporary or not.
    let new = out_dir.join("new.parquet");
    let o = sql_to(&url, &new, &["--format", "parquet"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let failed = out_dir.join("failed.csv");
    let o = hslake(&[
        "sql",
        &url,
        "SELECT no_such_column FROM samples",
        "-o",
        failed.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let mut names: Vec<String> = std::fs::read_dir(&out_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["ids.csv", "new.parquet"]);
    let o = hslake(&["verify", &url]);
    assert!(o.status.success(), "{}", stderr(&o));
}
