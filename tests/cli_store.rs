//! End-to-end: the `hslake` binary on local datasets — exit codes and messages of
//! synth, info, verify, vacuum, cp and export, including on damaged and bad input.
mod common;

use common::hslake;
use std::path::Path;
use std::process::Output;

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
fn a_shard_whose_footer_length_is_flipped_fails_sql_and_verify_without_a_panic() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ds");
    let url = format!("file://{}", dir.display());
    synth(&url);
    let file = &shards(&dir)[0];
    let mut b = std::fs::read(file).unwrap();
    // The footer's length (the 4 bytes before the closing magic) now points before the file.
    let at = b.len() - 5;
    b[at] ^= 0x80;
    std::fs::write(file, b).unwrap();
    let o = hslake(&["sql", &url, "SELECT sum(seq_len) FROM samples"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("the Parquet decoder failed"),
        "{}",
        stderr(&o)
    );
    // The scan catches the decoder's panic where it happens, so no worker thread prints one.
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
    let o = hslake(&["verify", &url]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let name = file.file_name().unwrap().to_string_lossy().to_string();
    assert!(String::from_utf8_lossy(&o.stdout).contains(&name));
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
    fails_naming(&o, "below the minimum of 3600s");
    fails_naming(&o, "--no-writers");
    assert!(orphan.exists());
    let o = hslake(&["vacuum", &b, "--grace", "0", "--no-writers"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(out.contains("deleted data/orphan.parquet"), "{out}");
    assert!(out.contains("committed vacuum version 2"), "{out}");
    assert!(!orphan.exists());
    let o = hslake(&["ls", &b, "versions"]);
    let listed = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        listed
            .lines()
            .any(|l| l.starts_with("2\t") && l.contains("\tvacuum (cutoff ")),
        "{listed}"
    );
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

#[test]
fn every_crate_of_the_read_and_write_path_is_built_at_opt_level_3() {
    // The tests' binary has the per-crate opt-levels of the build setup installs (only debug
    // assertions differ, .cargo/install.toml), so an override lost from Cargo.toml shows here.
    let o = hslake(&["--version"]);
    let out = String::from_utf8_lossy(&o.stdout);
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("opt-level of the read and write path: "))
        .unwrap_or_else(|| panic!("no opt-level line in --version: {out}"));
    let crates: Vec<(&str, &str)> = line
        .split(", ")
        .map(|c| c.rsplit_once(' ').unwrap_or((c, "")))
        .collect();
    for name in [
        "hslake-schemas",
        "hslake-store",
        "hslake-loader",
        "hslake-prepare",
    ] {
        assert!(crates.iter().any(|c| c.0 == name), "{name} missing: {out}");
    }
    let slow: Vec<_> = crates.iter().filter(|c| c.1 != "3").collect();
    assert!(
        slow.is_empty(),
        "built below opt-level 3: {slow:?}; raise them in Cargo.toml's [profile.dev.package.*]"
    );
}

#[test]
fn third_party_crates_of_the_read_and_write_path_are_raised_to_opt_level_3() {
    // Their opt-level is visible nowhere at run time, so the manifest is read instead. The list is
    // the crates the store's encode and decode loops spend their time in; dropping one of their
    // overrides made the store several times slower in the setup's build (docs/PERFORMANCE.md).
    let manifest = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
        .expect("the workspace's Cargo.toml");
    let raised = |krate: &str| {
        let table = format!("[profile.dev.package.{krate}]");
        manifest.split(table.as_str()).nth(1).is_some_and(|rest| {
            let body = rest.split("\n[").next().unwrap_or("");
            body.lines().any(|l| l.replace(' ', "") == "opt-level=3")
        })
    };
    let missing: Vec<_> = [
        "parquet",
        "arrow-array",
        "arrow-buffer",
        "arrow-data",
        "arrow-select",
        "arrow-schema",
        "zstd",
        "zstd-safe",
        "zstd-sys",
        "crc32c",
        "crc32fast",
        "half",
    ]
    .into_iter()
    .filter(|k| !raised(k))
    .collect();
    assert!(
        missing.is_empty(),
        "no [profile.dev.package.<crate>] with opt-level = 3 in Cargo.toml for {missing:?}"
    );
}

/// Flip a byte inside sample `id`'s value of `column` (bf16) in whichever shard holds it; the
/// Parquet file still parses. Returns the shard's file name and the flip.
fn flip_value(dir: &Path, column: &str, id: u64) -> (String, hslake_store::tools::corrupt::Flip) {
    for f in shards(dir) {
        if let Ok(flip) = hslake_store::tools::corrupt::flip_value_byte(&f, column, 2, id) {
            let name = f.file_name().unwrap().to_string_lossy().to_string();
            return (name, flip);
        }
    }
    panic!("no shard holds sample {id}");
}

/// 12 samples with layers 1, 3, 4 and 7 of 8 (what the speculators preset takes), row groups
/// as small as the writer makes them (`--row-group-mb 0`), for the corruption tests.
fn synth_for_corruption(url: &str) {
    let o = hslake(&[
        "synth",
        url,
        "--samples",
        "12",
        "--seq-len",
        "4:20",
        "--hidden",
        "32",
        "--layers",
        "1,3,4,7",
        "--num-layers",
        "8",
        "--seed",
        "5",
        "--row-group-mb",
        "0",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn a_flipped_byte_in_a_tensor_value_is_named_by_sql_export_and_verify() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ds");
    let url = format!("file://{}", dir.display());
    synth_for_corruption(&url);
    let out = |name: &str| tmp.path().join(name).display().to_string();
    let norms = "SELECT sample_id, tensor_norm(layer_3) AS n FROM samples ORDER BY sample_id";
    let run_all = |tag: &str| {
        [
            hslake(&["sql", &url, "--format", "csv", norms]),
            hslake(&[
                "export",
                &url,
                "--sample",
                "7",
                "--dir",
                &out(&format!("npy-{tag}")),
            ]),
            hslake(&[
                "export",
                &url,
                "--format",
                "speculators",
                "--no-progress",
                "--dir",
                &out(&format!("spec-{tag}")),
            ]),
            hslake(&["verify", &url]),
        ]
    };
    let before = run_all("before");
    for o in &before {
        assert!(o.status.success(), "{}", stderr(o));
    }

    let (file, flip) = flip_value(&dir, "layer_3", 7);
    let site = format!(
        "row group {}: row {} (sample 7) layer_3",
        flip.row_group, flip.row
    );
    let after = run_all("after");
    for (what, o) in ["sql", "export npy", "export speculators"]
        .iter()
        .zip(&after)
    {
        let err = stderr(o);
        assert!(!o.status.success(), "{what} succeeded over a flipped value");
        assert!(
            err.contains(&file) && err.contains(&site),
            "{what}: expected {file} and {site} in:\n{err}"
        );
        assert!(!err.contains("panicked"), "{what}: {err}");
    }
    let verify = String::from_utf8_lossy(&after[3].stdout).into_owned();
    assert_eq!(after[3].status.code(), Some(1));
    assert!(
        verify
            .lines()
            .any(|l| l.contains(&file) && l.contains("sample 7 layer_3")),
        "{verify}"
    );

    // What does not touch the value is unaffected: statistics, other samples, other layers.
    let sql_ok = |q: &str| {
        let o = hslake(&["sql", &url, "--format", "csv", q]);
        assert!(o.status.success(), "{q}: {}", stderr(&o));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let all = String::from_utf8_lossy(&before[0].stdout).into_owned();
    let others = sql_ok(&norms.replace("ORDER BY", "WHERE sample_id <> 7 ORDER BY"));
    let rows: Vec<&str> = others.lines().skip(1).collect();
    assert_eq!(rows.len(), 11, "{others}");
    for r in rows {
        assert!(
            all.lines().any(|l| l == r),
            "{r} differs from before the flip:\n{all}"
        );
    }
    sql_ok("SELECT count(*), sum(seq_len), max(layer_3_norm) FROM samples");
    sql_ok("SELECT max(tensor_norm(layer_4)) FROM samples");
    let o = hslake(&["export", &url, "--sample", "8", "--dir", &out("npy-8")]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn a_flipped_byte_in_input_ids_is_named_by_sql_export_and_verify() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ds");
    let url = format!("file://{}", dir.display());
    synth_for_corruption(&url);
    // A bit in the zstd-compressed input_ids pages that still decompresses, to other ids:
    // Parquet itself cannot see it.
    let shard = shards(&dir).remove(0);
    let file = shard.file_name().unwrap().to_string_lossy().to_string();
    let flip = hslake_store::tools::corrupt::flip_token_byte(&shard).unwrap();
    let id = flip.sample_id.to_string();
    let site = format!(
        "row group {}: row {} (sample {id}) input_ids/loss_mask: corrupt tokens",
        flip.row_group, flip.row
    );
    let out = |name: &str| tmp.path().join(name).display().to_string();
    let runs = [
        (
            "sql",
            hslake(&[
                "sql",
                &url,
                "--format",
                "csv",
                &format!("SELECT sample_id, input_ids FROM samples WHERE sample_id = {id}"),
            ]),
        ),
        (
            "export npy",
            hslake(&["export", &url, "--sample", &id, "--dir", &out("npy")]),
        ),
        (
            "export speculators",
            hslake(&[
                "export",
                &url,
                "--format",
                "speculators",
                "--no-progress",
                "--dir",
                &out("spec"),
            ]),
        ),
    ];
    for (what, o) in &runs {
        let err = stderr(o);
        assert!(!o.status.success(), "{what} succeeded over a flipped token");
        assert!(
            err.contains(&file) && err.contains(&site),
            "{what}: expected {file} and {site} in:\n{err}"
        );
        assert!(!err.contains("panicked"), "{what}: {err}");
    }
    let o = hslake(&["verify", &url]);
    let report = String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(o.status.code(), Some(1));
    assert!(
        report.lines().any(|l| l.contains(&file)
            && l.contains(&format!("sample {id} input_ids/loss_mask: corrupt tokens"))),
        "{report}"
    );
}

#[test]
fn format_2_datasets_still_read_in_sql_with_and_without_their_checksums() {
    // The same six samples written by the format-2 writer with zstd frame checksums and
    // without any (tests/fixtures/format2): token columns without token checksums pass, tensor
    // values decode either way.
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/format2");
    let q = "SELECT sample_id, loss_mask, input_ids, tensor_norm(layer_3) AS n FROM samples \
             ORDER BY sample_id";
    let outs: Vec<String> = ["zstd_xxh64", "no_checksums"]
        .iter()
        .map(|name| {
            let url = format!("file://{}", fixtures.join(name).display());
            let o = hslake(&["sql", &url, "--format", "json", q]);
            assert!(o.status.success(), "{name}: {}", stderr(&o));
            String::from_utf8_lossy(&o.stdout).into_owned()
        })
        .collect();
    assert_eq!(outs[0], outs[1]);
    assert_eq!(outs[0].matches("\"sample_id\"").count(), 6, "{}", outs[0]);
}

/// The command failed (exit 1) and its error says `what`.
fn fails_naming(o: &Output, what: &str) {
    assert_eq!(o.status.code(), Some(1), "{}", stderr(o));
    assert!(stderr(o).contains(what), "{what:?} not in: {}", stderr(o));
}

/// `hslake synth` of `samples` samples from `first_id` into `url`, a shard per sample, a commit
/// every `commit_every`.
fn synth_run(url: &str, first_id: u64, samples: u64, commit_every: u64) -> Output {
    hslake(&[
        "synth",
        url,
        "--samples",
        &samples.to_string(),
        "--seq-len",
        "4:12",
        "--hidden",
        "16",
        "--layers",
        "1",
        "--num-layers",
        "2",
        "--seed",
        &first_id.to_string(),
        "--first-id",
        &first_id.to_string(),
        "--shard-mb",
        "0",
        "--row-group-mb",
        "0",
        "--commit-every",
        &commit_every.to_string(),
    ])
}

/// The sample ids of the newest version, ascending.
fn sample_ids(url: &str) -> Vec<u64> {
    let o = hslake(&["ls", url, "samples"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mut ids: Vec<u64> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .skip(1)
        .map(|l| l.split('\t').next().unwrap().parse().unwrap())
        .collect();
    ids.sort_unstable();
    ids
}

/// Every committed version, by `hslake ls versions`.
fn versions(url: &str) -> Vec<String> {
    let o = hslake(&["ls", url, "versions"]);
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .skip(1)
        .map(|l| l.split('\t').next().unwrap().to_string())
        .collect()
}

#[test]
fn a_synth_loop_racing_a_vacuum_loop_loses_no_committed_sample() {
    // Issue 36, bounded: writers append while `vacuum --grace 0s --no-writers` runs in a loop.
    let tmp = tempfile::tempdir().unwrap();
    let url = format!("file://{}", tmp.path().join("ds").display());
    assert!(synth_run(&url, 0, 4, 0).status.success());
    let writing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sweeper = {
        let (url, writing) = (url.clone(), writing.clone());
        std::thread::spawn(move || {
            let mut runs = 0;
            while writing.load(std::sync::atomic::Ordering::Relaxed) {
                let o = hslake(&["vacuum", &url, "--grace", "0s", "--no-writers"]);
                assert!(o.status.success(), "{}", stderr(&o));
                runs += 1;
            }
            runs
        })
    };
    let mut landed: Vec<u64> = (0..4).collect();
    let mut attempted = landed.clone();
    for k in 1..=4u64 {
        let first = 100 * k;
        let o = synth_run(&url, first, 6, 3);
        attempted.extend(first..first + 6);
        if o.status.success() {
            landed.extend(first..first + 6);
        } else {
            // Refused by name: its shards predate a vacuum, or a vacuum already deleted them.
            let e = stderr(&o);
            assert!(
                e.contains("commit refused") || e.contains("/data/"),
                "run {k}: {e}"
            );
        }
    }
    writing.store(false, std::sync::atomic::Ordering::Relaxed);
    assert!(sweeper.join().unwrap() > 0);
    for v in versions(&url) {
        let o = hslake(&["verify", &url, "--version", &v]);
        assert!(
            o.status.success(),
            "version {v}: {}",
            String::from_utf8_lossy(&o.stdout)
        );
    }
    // Every run that exited 0 has all its samples in; a refused run at most its earlier commits.
    let held = sample_ids(&url);
    assert!(landed.iter().all(|id| held.contains(id)), "{held:?}");
    assert!(held.iter().all(|id| attempted.contains(id)), "{held:?}");
}

#[test]
fn verify_names_a_missing_shard_and_repair_commits_a_version_without_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ds");
    let url = format!("file://{}", dir.display());
    assert!(synth_run(&url, 0, 4, 2).status.success());
    assert!(synth_run(&url, 10, 2, 0).status.success());
    // Version 1 holds samples 0 and 1, one shard each; versions 1..=3 name both.
    let m: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.join("_hslake/versions/00000000000000000001.json")).unwrap(),
    )
    .unwrap();
    let lost = m["shards"][0]["path"].as_str().unwrap().to_string();
    let lost_id = m["shards"][0]["min_sample_id"].as_u64().unwrap();
    std::fs::remove_file(dir.join(&lost)).unwrap();
    let o = hslake(&["verify", &url]);
    fails_naming(&o, &format!("hslake repair {url} --drop-missing"));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        out.lines()
            .any(|l| l.contains(&lost)
                && l.contains("missing: not in storage; versions 1..=3 name it")),
        "{out}"
    );
    let o = hslake(&["repair", &url]);
    assert_eq!(o.status.code(), Some(2), "--drop-missing is required");
    let o = hslake(&["repair", &url, "--drop-missing", "--dry-run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let want = format!("would drop {lost}: 1 sample, id {lost_id} lost");
    assert!(
        String::from_utf8_lossy(&o.stdout).contains(&want),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert_eq!(versions(&url).len(), 4);
    let o = hslake(&["repair", &url, "--drop-missing"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        out.contains(&format!("dropped {lost}")) && out.contains("committed version 4"),
        "{out}"
    );
    assert!(hslake(&["verify", &url]).status.success());
    let listed = String::from_utf8_lossy(&hslake(&["ls", &url, "versions"]).stdout).into_owned();
    assert!(
        listed.contains("dropped 1 shard(s) of version 3"),
        "{listed}"
    );
    let want: Vec<u64> = [0, 1, 2, 3, 10, 11]
        .into_iter()
        .filter(|&i| i != lost_id)
        .collect();
    assert_eq!(sample_ids(&url), want);
    let o = hslake(&["repair", &url, "--drop-missing"]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("nothing to repair"));
}

#[test]
fn a_manifest_repeating_a_shard_is_refused_by_readers_and_commits_and_repair_drops_the_repeats() {
    // Issue 44: a manifest naming one shard 10^5 times made `count(*)` count it 10^5 times, and
    // `repair` found nothing to repair.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ds");
    let url = format!("file://{}", dir.display());
    assert!(synth_run(&url, 0, 4, 0).status.success());
    let head = versions(&url).len() as u64 - 1;
    let path = |v: u64| dir.join(format!("_hslake/versions/{v:020}.json"));
    let mut m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(path(head)).unwrap()).unwrap();
    let first = m["shards"][0].clone();
    let repeated = first["path"].as_str().unwrap().to_string();
    let shards = m["shards"].as_array_mut().unwrap();
    shards.extend(std::iter::repeat_n(first, 99_999));
    m["version"] = (head + 1).into();
    std::fs::write(path(head + 1), serde_json::to_vec(&m).unwrap()).unwrap();
    let named = format!("shard {repeated} is named 100000 times");

    let count = &[
        "sql",
        &url,
        "--format",
        "csv",
        "SELECT count(*) AS n FROM samples",
    ][..];
    for args in [
        &["info", &url][..],
        count,
        &[
            "export",
            &url,
            "--format",
            "speculators",
            "--dir",
            &tmp.path().join("x").display().to_string(),
        ],
    ] {
        let o = hslake(args);
        fails_naming(&o, &named);
        assert!(stderr(&o).contains("--drop-repeats"), "{}", stderr(&o));
    }
    // A commit on top is refused, and verify names the repeats.
    let o = synth_run(&url, 100, 1, 0);
    fails_naming(&o, &named);
    let o = hslake(&["verify", &url]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains(&named),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    // repair (here a dry run of --drop-missing, which HEADs every shard) keeps each shard once.
    let o = hslake(&["repair", &url, "--drop-missing", "--dry-run"]);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        out.contains(&format!(
            "would drop 99999 repeated entries of {repeated} (named 100000 times; kept once, no \
             sample lost)"
        )),
        "{out}"
    );
    assert!(!out.contains("nothing to repair"), "{out}");
    assert_eq!(versions(&url).len() as u64, head + 2);
    let o = hslake(&["repair", &url, "--drop-repeats"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        out.contains(&format!(
            "committed version {}: version {} without the 99999 repeated entries",
            head + 2,
            head + 1
        )),
        "{out}"
    );
    let o = hslake(&["verify", &url]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
    let o = hslake(count);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "n\n4");
    assert_eq!(sample_ids(&url), [0, 1, 2, 3]);
}

#[test]
fn a_manifest_larger_than_the_bound_is_refused_before_it_is_read() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ds");
    let url = format!("file://{}", dir.display());
    assert!(synth_run(&url, 0, 2, 0).status.success());
    let next = versions(&url).len();
    // Sparse: 1 GiB and one byte of nothing on disk.
    let big = std::fs::File::create(dir.join(format!("_hslake/versions/{next:020}.json"))).unwrap();
    big.set_len((1 << 30) + 1).unwrap();
    fails_naming(
        &hslake(&["info", &url]),
        "the manifest is 1073741825 bytes, more than the 1073741824 bytes a manifest may have",
    );
}

#[test]
fn the_root_of_a_filesystem_is_named_and_refused_as_a_dataset() {
    for root in ["/", "file:///", "/tmp/.."] {
        for cmd in [
            &["info", root][..],
            &["verify", root],
            &["vacuum", root, "--dry-run"],
        ] {
            fails_naming(&hslake(cmd), "file:/// is the root of a filesystem");
        }
    }
}

#[test]
fn export_never_writes_through_links_planted_in_its_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let url = format!("file://{}", tmp.path().join("ds").display());
    synth(&url);
    let outside = tmp.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let names = ["input_ids.npy", "layer_1.npy", "layer_3.npy"];
    for n in names {
        std::fs::write(outside.join(n), b"precious").unwrap();
        std::os::unix::fs::symlink(outside.join(n), out.join(n)).unwrap();
    }
    let export_into = |dir: &Path| {
        hslake(&[
            "export",
            &url,
            "--sample",
            "3",
            "--dir",
            dir.to_str().unwrap(),
        ])
    };
    let o = export_into(&out);
    fails_naming(&o, "never overwrites a file or writes through a link");
    for n in names {
        fails_naming(&o, &out.join(n).display().to_string());
        assert_eq!(std::fs::read(outside.join(n)).unwrap(), b"precious", "{n}");
    }
    // Refused before anything was written: only the planted links are there.
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), names.len());
    // A dangling link is a name that exists too.
    let out2 = tmp.path().join("out2");
    std::fs::create_dir(&out2).unwrap();
    std::os::unix::fs::symlink(tmp.path().join("nowhere"), out2.join("loss_mask.npy")).unwrap();
    fails_naming(&export_into(&out2), "loss_mask.npy");
    assert!(!tmp.path().join("nowhere").exists());
}

#[test]
fn export_refuses_a_row_whose_seq_len_disagrees_with_its_tokens() {
    use hslake_store::tools::corrupt::{claim_seq_len, rewrite_shard};
    let tmp = tempfile::tempdir().unwrap();
    let url = format!("file://{}", tmp.path().join("ds").display());
    synth(&url);
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let ds = hslake_store::Dataset::open(&url).await.unwrap();
        rewrite_shard(&ds, 0, claim_seq_len(0, u32::MAX))
            .await
            .unwrap();
    });
    let out = tmp.path().join("out");
    let o = hslake(&[
        "export",
        &url,
        "--sample",
        "0",
        "--dir",
        out.to_str().unwrap(),
    ]);
    fails_naming(
        &o,
        "(sample 0) seq_len: seq_len 4294967295, but input_ids holds",
    );
    assert!(!out.exists() || std::fs::read_dir(&out).unwrap().count() == 0);
}
