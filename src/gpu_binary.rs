//! The GPU commands (`capture`, `serve-capture` and the hidden `debug`) live in a second
//! binary, `hslake-gpu`, the only one that links libtorch: loading libtorch costs every process
//! about 0.6 s, which the other commands should not pay. `hslake` lists those commands in its
//! help and, given one, replaces itself with `hslake-gpu` (exec), so that flags, help, output,
//! signals and the exit code are the GPU binary's own.
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

/// The GPU binary's file name; it is looked for beside the `hslake` executable.
pub const NAME: &str = "hslake-gpu";

/// The one-line help of `capture`, shown by both binaries.
pub const CAPTURE_ABOUT: &str =
    "Run a Hugging Face checkpoint over tokenized samples and write chosen layers' hidden states";
/// The one-line help of `serve-capture`, shown by both binaries.
pub const SERVE_CAPTURE_ABOUT: &str =
    "Keep a model loaded and run capture jobs submitted over HTTP (the capture daemon)";
/// The one-line help of the hidden `debug`.
pub const DEBUG_ABOUT: &str = "GPU checks and measurements of the capture forward";

/// The subcommands the GPU binary has.
pub const COMMANDS: [&str; 3] = ["capture", "serve-capture", "debug"];

/// Whether `args` (the command line without the program name) asks for a GPU command:
/// `capture …`, or `help capture …` for its help.
pub fn is_gpu_command(args: &[OsString]) -> bool {
    let is_gpu = |a: Option<&OsString>| a.is_some_and(|a| COMMANDS.iter().any(|c| a == *c));
    match args.first() {
        Some(first) if first == "help" => is_gpu(args.get(1)),
        first => is_gpu(first),
    }
}

/// The arguments of a GPU command as `hslake` takes them: everything after the command's name,
/// unparsed, for `hslake-gpu` to parse (its `--help` included).
#[derive(clap::Args, Debug)]
pub struct Forwarded {
    /// The GPU command's arguments.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 0..)]
    pub args: Vec<OsString>,
}

/// Where `hslake-gpu` must be for the executable at `exe`: beside it, after resolving
/// symbolic links, so that a link to `hslake` on PATH still finds its GPU binary.
pub fn beside(exe: &Path) -> PathBuf {
    let real = std::fs::canonicalize(exe).unwrap_or_else(|_| exe.to_path_buf());
    real.with_file_name(NAME)
}

/// Runs `args` in `hslake-gpu` in place of this process. It returns only when that cannot be
/// done, with an error naming where the binary was looked for and how to get it.
pub fn exec(args: &[OsString]) -> anyhow::Error {
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => {
            return anyhow::anyhow!(
                "cannot find the hslake executable's own path ({e}), beside which {NAME}, the \
                 binary of the GPU commands, is looked for"
            )
        }
    };
    let gpu = beside(&exe);
    if !gpu.is_file() {
        return missing(&gpu, args.first().map(OsString::as_os_str));
    }
    let mut cmd = std::process::Command::new(&gpu);
    cmd.args(args);
    let e = run_in_place(cmd);
    anyhow::anyhow!("cannot run {}: {e}", gpu.display())
}

/// The error for a GPU command when `gpu` does not exist.
fn missing(gpu: &Path, command: Option<&OsStr>) -> anyhow::Error {
    let command = command.map_or_else(String::new, |c| format!(" {}", c.to_string_lossy()));
    anyhow::anyhow!(
        "`hslake{command}` runs in {NAME}, the binary that links libtorch, but there is no {}; \
         expected it beside hslake. Build both with `cargo build --bins` (scripts/setup.sh does), \
         or only it with `cargo build --bin {NAME}`, and keep it in the same folder as hslake",
        gpu.display()
    )
}

#[cfg(unix)]
fn run_in_place(mut cmd: std::process::Command) -> std::io::Error {
    use std::os::unix::process::CommandExt;
    cmd.exec()
}

/// Without exec, the child runs to its end and its exit code becomes this process's.
#[cfg(not(unix))]
fn run_in_place(mut cmd: std::process::Command) -> std::io::Error {
    match cmd.status() {
        Ok(status) => std::process::exit(status.code().unwrap_or(1)),
        Err(e) => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<OsString> {
        a.iter().map(OsString::from).collect()
    }

    #[test]
    fn gpu_commands_and_their_help_are_recognised_and_nothing_else() {
        for gpu in [
            &["capture", "--model", "m"][..],
            &["serve-capture"],
            &["debug", "prefill"],
            &["help", "capture"],
            &["help", "debug", "prefill"],
        ] {
            assert!(is_gpu_command(&args(gpu)), "{gpu:?}");
        }
        for light in [
            &[][..],
            &["help"],
            &["ls", "capture"],
            &["jobs", "submit"],
            &["--help", "capture"],
            &["captures"],
        ] {
            assert!(!is_gpu_command(&args(light)), "{light:?}");
        }
    }

    #[cfg(unix)]
    #[test]
    fn the_gpu_binary_is_looked_for_beside_the_real_file_of_a_link() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("install");
        std::fs::create_dir(&real).unwrap();
        std::fs::write(real.join("hslake"), b"").unwrap();
        let link = dir.path().join("hslake");
        std::os::unix::fs::symlink(real.join("hslake"), &link).unwrap();
        let want = std::fs::canonicalize(&real).unwrap().join(NAME);
        assert_eq!(beside(&link), want);
        assert_eq!(beside(&real.join("hslake")), want);
    }
}
