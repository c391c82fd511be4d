//! End-to-end: the `hslake` binary on local datasets — exit codes and messages of
//! synth, info, verify, vacuum, cp and export, including on damaged and bad input.
use std::path::Path;
use std::process::{Command, Output};

fn hslake(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hslake"))
        .args(args)
        .env("HSLAKE_LOG", "warn")
        .output()
        .expect("run hslake")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn synth(url: &str) {
    let o = hslake(&[
        "synth",
        url,
        "--samples",
        "30",
        "--seq-len",
        "4:20",
        "--hidden",
        "32",
        "--layers",
        "1,3",
        "--seed",
        "5",
        "--shard-mb",
        "0",
        "--row-group-mb",
        "0",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
}

fn shards(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir.join("data"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    v.sort();
    v
}

#[test]
fn verify_exits_nonzero_naming_flipped_and_truncated_shards() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ds");
    let url = format!("file://{}", dir.display());
    synth(&url);
    assert!(hslake(&["verify", &url]).status.success());
    let files = shards(&dir);
    assert!(files.len() >= 2);
    let mut b = std::fs::read(&files[0]).unwrap();
    let mid = b.len() / 2;
    b[mid] ^= 1;
    std::fs::write(&files[0], b).unwrap();
    let t = std::fs::read(&files[1]).unwrap();
    std::fs::write(&files[1], &t[..t.len() - 7]).unwrap();
    let o = hslake(&["verify", &url]);
    assert_eq!(o.status.code(), Some(1));
    let out = String::from_utf8_lossy(&o.stdout);
    for f in &files[..2] {
        let name = f.file_name().unwrap().to_string_lossy().to_string();
        assert!(
            out.lines().any(|l| l.contains(&name)),
            "{name} not named in:\n{out}"
        );
    }
    assert!(
        out.contains("checksum mismatch") && out.contains("truncated"),
        "{out}"
    );
}

#[test]
fn bad_input_gets_a_clear_error_and_no_panic() {
    let tmp = tempfile::tempdir().unwrap();
    let url = format!("file://{}", tmp.path().join("nothing").display());
    let o = hslake(&["info", &url]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("not an hslake dataset"),
        "{}",
        stderr(&o)
    );
    let o = hslake(&["synth", &url, "--samples", "1", "--dtype", "int4"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("unknown dtype \"int4\""),
        "{}",
        stderr(&o)
    );
    let o = hslake(&["synth", &url, "--samples", "1", "--seq-len", "9:3"]);
    assert!(stderr(&o).contains("MIN <= MAX"), "{}", stderr(&o));
    for o in [
        hslake(&["info", "ftp://host/x"]),
        hslake(&["verify", "s3://ab/x"]),
    ] {
        assert_eq!(o.status.code(), Some(1));
        assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
    }
}

#[test]
fn info_reports_counts_and_newer_manifests_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ds");
    let url = format!("file://{}", dir.display());
    synth(&url);
    let o = hslake(&["info", &url, "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["samples"], 30);
    assert_eq!(
        v["schema"]["points"],
        serde_json::json!(["layer_1", "layer_3"])
    );
    assert!(v["compression_ratio"].as_f64().unwrap() > 0.0);
    assert!(v["bytes"].as_u64().unwrap() > 0);
    let stats = v["layer_stats"].as_array().unwrap();
    assert_eq!(stats.len(), 2);
    assert_eq!(stats[1]["point"], "layer_3");
    assert!(stats[0]["mean_token_norm"].as_f64().unwrap() > 0.0);
    assert_eq!(stats[0]["nan_count"], 0);
    let newest = dir.join("_hslake/versions/00000000000000000001.json");
    let mut m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&newest).unwrap()).unwrap();
    m["format_version"] = 9.into();
    std::fs::write(&newest, serde_json::to_vec(&m).unwrap()).unwrap();
    let o = hslake(&["info", &url]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("manifest format version 9 is newer"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn cp_and_back_then_vacuum_removes_only_orphans() {
    let tmp = tempfile::tempdir().unwrap();
    let a = format!("file://{}", tmp.path().join("a").display());
    let b = format!("file://{}", tmp.path().join("b").display());
    synth(&a);
    assert!(hslake(&["cp", &a, &b]).status.success());
    assert!(hslake(&["verify", &b]).status.success());
    let o = hslake(&["cp", &a, &b]);
    assert!(stderr(&o).contains("already exists"), "{}", stderr(&o));
    let orphan = tmp.path().join("b/data/orphan.parquet");
    std::fs::write(&orphan, b"half a shard").unwrap();
    let o = hslake(&["vacuum", &b, "--grace", "0"]);
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stdout).contains("deleted data/orphan.parquet"));
    assert!(!orphan.exists());
    assert_eq!(
        shards(&tmp.path().join("b")).len(),
        shards(&tmp.path().join("a")).len()
    );
    assert!(hslake(&["verify", &b]).status.success());
    let out = tmp.path().join("x");
    assert!(hslake(&[
        "export",
        &b,
        "--sample",
        "7",
        "--dir",
        out.to_str().unwrap()
    ])
    .status
    .success());
    assert!(out.join("layer_3.npy").exists());
}

#[test]
fn version_names_the_build_profile_and_opt_level() {
    let o = hslake(&["--version"]);
    assert!(o.status.success());
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.starts_with("hslake 0."), "{out}");
    assert!(
        out.contains("profile ") && out.contains("opt-level "),
        "{out}"
    );
}
