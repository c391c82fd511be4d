//! End-to-end: the two binaries. `hslake` does not link libtorch; its GPU commands run in
//! `hslake-gpu` beside it, with that binary's help, errors and exit codes, also through a
//! symbolic link; without `hslake-gpu` they fail with an error saying where it was looked for.
#![cfg(feature = "capture")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const LIGHT: &str = env!("CARGO_BIN_EXE_hslake");
const GPU: &str = env!("CARGO_BIN_EXE_hslake-gpu");

/// Runs `bin` with `args` at a fixed terminal width, without HSLAKE_* variables (clap prints
/// an `env` flag's current value in the help) and without logs (their lines carry the time),
/// so that two runs print the same.
fn run(bin: &Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(bin);
    cmd.args(args).env("COLUMNS", "100");
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("HSLAKE_") {
            cmd.env_remove(k);
        }
    }
    cmd.env("HSLAKE_LOG", "off");
    cmd.output()
        .unwrap_or_else(|e| panic!("run {}: {e}", bin.display()))
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The shared libraries the dynamic loader maps for `bin`, as `ldd` lists them (a library it
/// cannot find is listed too, as "not found").
fn loaded_libraries(bin: &str) -> Vec<String> {
    let out = Command::new("ldd")
        .arg(bin)
        .output()
        .expect("run ldd (glibc's; needed for this test)");
    assert!(out.status.success(), "ldd {bin}: {}", text(&out.stderr));
    text(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(String::from)
        .collect()
}

fn is_torch(lib: &str) -> bool {
    lib.starts_with("libtorch") || lib.starts_with("libc10")
}

#[test]
fn the_light_binary_loads_no_libtorch_and_the_gpu_binary_does() {
    let light = loaded_libraries(LIGHT);
    let torch: Vec<_> = light.iter().filter(|l| is_torch(l)).collect();
    assert!(torch.is_empty(), "hslake loads {torch:?}");
    // The same check finds libtorch where it is, so it cannot pass by reading nothing.
    let gpu = loaded_libraries(GPU);
    for want in ["libtorch_cpu.so", "libtorch_cuda.so", "libc10.so"] {
        assert!(
            gpu.iter().any(|l| l == want),
            "hslake-gpu lacks {want}: {gpu:?}"
        );
    }
}

#[test]
fn gpu_commands_show_the_gpu_binary_s_own_help() {
    for args in [
        &["capture", "--help"][..],
        &["help", "capture"],
        &["serve-capture", "--help"],
        &["serve-capture", "-h"],
        &["debug", "prefill", "--help"],
    ] {
        let via = run(Path::new(LIGHT), args);
        let direct = run(Path::new(GPU), args);
        assert!(
            direct.status.success(),
            "hslake-gpu {args:?}: {}",
            text(&direct.stderr)
        );
        assert_eq!(
            via.status.code(),
            Some(0),
            "hslake {args:?}: {}",
            text(&via.stderr)
        );
        assert_eq!(text(&via.stdout), text(&direct.stdout), "{args:?}");
        assert!(text(&via.stdout).contains("Usage: hslake "), "{args:?}");
    }
}

/// A `Commands:` line of a help text for `name`.
fn command_line(help: &str, name: &str) -> Option<String> {
    help.lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .map(|l| l.trim().to_string())
}

#[test]
fn the_light_help_lists_the_gpu_commands_as_the_gpu_binary_does() {
    let light = text(&run(Path::new(LIGHT), &["--help"]).stdout);
    let gpu = text(&run(Path::new(GPU), &["--help"]).stdout);
    for name in ["capture", "serve-capture"] {
        let listed = command_line(&light, name);
        assert!(listed.is_some(), "hslake --help lacks {name}:\n{light}");
        assert_eq!(listed, command_line(&gpu, name), "{name}");
    }
    // The GPU checks stay hidden, as before the split.
    assert_eq!(command_line(&light, "debug"), None, "{light}");
    assert_eq!(command_line(&gpu, "debug"), None, "{gpu}");
}

#[test]
fn exit_codes_and_errors_are_the_gpu_binary_s() {
    let tmp = tempfile::tempdir().unwrap();
    let output = format!("file://{}", tmp.path().join("ds").display());
    let missing_model = tmp.path().join("no-model");
    let missing_model = missing_model.to_str().unwrap();
    for (args, code) in [
        // A usage error: clap's exit code.
        (vec!["capture", "--no-such-flag"], 2),
        (vec!["serve-capture", "--shutdown-timeout", "1e308"], 2),
        // A run that fails: the command's own error and exit code.
        (
            vec![
                "capture",
                "--model",
                missing_model,
                "--input",
                "no-input.jsonl",
                "--output",
                &output,
                "--layers",
                "0",
                "--no-progress",
            ],
            1,
        ),
    ] {
        let via = run(Path::new(LIGHT), &args);
        let direct = run(Path::new(GPU), &args);
        assert_eq!(
            direct.status.code(),
            Some(code),
            "hslake-gpu {args:?}: {}",
            text(&direct.stderr)
        );
        assert_eq!(
            via.status.code(),
            Some(code),
            "hslake {args:?}: {}",
            text(&via.stderr)
        );
        assert_eq!(text(&via.stderr), text(&direct.stderr), "{args:?}");
    }
}

/// A copy of the light binary, alone in a fresh folder of the target directory (a hard link
/// where the file system allows).
fn lone_light_binary() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let bin = dir.path().join("hslake");
    if std::fs::hard_link(LIGHT, &bin).is_err() {
        std::fs::copy(LIGHT, &bin).unwrap();
    }
    (dir, bin)
}

#[test]
fn without_the_gpu_binary_a_gpu_command_says_where_it_looked_and_how_to_build_it() {
    let (dir, bin) = lone_light_binary();
    let looked = std::fs::canonicalize(dir.path())
        .unwrap()
        .join("hslake-gpu");
    for args in [
        &["capture", "--help"][..],
        &["serve-capture"],
        &["help", "capture"],
    ] {
        let o = run(&bin, args);
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains(&looked.display().to_string()),
            "{args:?}: {err}"
        );
        assert!(
            err.contains("cargo build --bin hslake-gpu"),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    // The other commands do not need it.
    let o = run(&bin, &["--version"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
}

#[cfg(unix)]
#[test]
fn through_a_symbolic_link_the_gpu_binary_beside_the_real_file_runs() {
    let dir = tempfile::tempdir().unwrap();
    let link = dir.path().join("hslake");
    std::os::unix::fs::symlink(LIGHT, &link).unwrap();
    let o = run(&link, &["capture", "--help"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    assert_eq!(
        text(&o.stdout),
        text(&run(Path::new(GPU), &["capture", "--help"]).stdout)
    );
}
