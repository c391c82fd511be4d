//! Local files that hslake writes for the user, never through a symbolic link, never over a
//! file it was not asked to replace and never into a dataset.
//!
//! Exports (`.npy` files, trainer layouts) create each file anew ([`create_new`], [`publish`]),
//! so that links or files planted in the output directory cannot make an export write outside
//! it or destroy what is there. Single outputs (`prepare --output`, `sql --output`) are checked
//! by [`check_output`], then written by an [`OutputFile`]: under a temporary name beside the
//! output, renamed into place only when complete, so a failed or interrupted run leaves no
//! half-written output visible.
//!
//! An [`OutputFile`]'s temporary file is locked (`flock`) while its run writes it, and the kernel
//! drops the lock when the process ends however it ends; so a run that was killed or aborted
//! leaves a file no process holds, and the next run writing the same output removes it.
use std::fs::File;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use tempfile::NamedTempFile;

use crate::table::manifest::VERSIONS_DIR;

/// Create `path` for writing. Anything already at that name, a symbolic link included (even
/// one pointing nowhere), is refused with [`io::ErrorKind::AlreadyExists`] and left as it is.
pub fn create_new(path: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

/// Give the finished file `tmp` (made by [`create_new`]) its name `path`, refusing with
/// [`io::ErrorKind::AlreadyExists`] where anything is at `path` (a rename would replace it): a
/// hard link, which never replaces and never follows a link at the new name, then the
/// temporary name is removed, also when the link is refused.
pub fn publish(tmp: &Path, path: &Path) -> io::Result<()> {
    let linked = std::fs::hard_link(tmp, path);
    let removed = std::fs::remove_file(tmp);
    linked.and(removed)
}

/// Whether `path` names anything, a symbolic link that points nowhere included.
pub fn exists(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}

/// An output path refused, or an output that could not be written: the path and why.
#[derive(Debug, thiserror::Error)]
#[error("{}: {reason}", path.display())]
pub struct OutputError {
    /// The output path as given.
    pub path: PathBuf,
    /// What is wrong, and what was expected.
    pub reason: String,
}

/// What an output does to a regular file already at its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Existing {
    /// The finished output replaces it.
    Replace,
    /// The output is refused unless the user gives this flag (then [`Existing::Replace`]).
    RefuseWithout(&'static str),
}

// The folder an output goes into.
fn folder_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Whether two paths name the same file: the same device and inode where both exist (through
/// symbolic and hard links), else the same name in the same folder.
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => {
            let folder = |p: &Path| folder_of(p).canonicalize().ok();
            a.file_name().is_some() && a.file_name() == b.file_name() && {
                let fa = folder(a);
                fa.is_some() && fa == folder(b)
            }
        }
    }
}

/// The dataset folder (one holding `_hslake/`) that `dir` (a folder with links resolved) is
/// or lies in, if any.
pub fn dataset_around(dir: &Path) -> Option<&Path> {
    // `_hslake`, the folder of a dataset's own files: the first part of its versions' folder.
    let meta = VERSIONS_DIR.split('/').next().unwrap_or(VERSIONS_DIR);
    dir.ancestors().find(|d| exists(&d.join(meta)))
}

/// Checks an output path before anything is written, and gives the path to write: the output's
/// folder with its links resolved, and the output's name. Refused: a directory; a symbolic link
/// (renaming into place would replace the link and leave its target as it was); a device, pipe
/// or socket; a regular file where `existing` says so; a folder that does not exist; a path
/// inside a dataset, whatever links lead there (the output could replace a shard or a manifest,
/// or add a file readers refuse); one of `inputs` (the output would replace what it is made
/// from); a URL (only local files are written here).
pub fn check_output(
    path: &Path,
    inputs: &[&Path],
    existing: Existing,
) -> Result<PathBuf, OutputError> {
    let refuse = |reason: String| {
        Err(OutputError {
            path: path.to_path_buf(),
            reason,
        })
    };
    let text = path.as_os_str().to_string_lossy();
    if text.contains("://") {
        return refuse(
            "is a URL; only a local file can be written here, expected a file path".into(),
        );
    }
    let Some(name) = path.file_name().filter(|_| !text.ends_with('/')) else {
        return refuse("names a directory; expected a file path".into());
    };
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => return refuse("is a directory; expected a file path".into()),
        Ok(m) if m.file_type().is_symlink() => {
            let target = std::fs::read_link(path)
                .map(|t| format!(" (to {})", t.display()))
                .unwrap_or_default();
            return refuse(format!(
                "is a symbolic link{target}; the output is written under a temporary name and \
                 renamed into place, which would replace the link and leave its target as it \
                 was; give the target's path or a new name"
            ));
        }
        Ok(m) if !m.is_file() => {
            return refuse(
                "is not a regular file (a device, pipe or socket); the output is written under \
                 a temporary name and renamed into place, which would replace it; expected a \
                 file path"
                    .into(),
            )
        }
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return refuse(format!("cannot inspect: {e}")),
    }
    let dir = folder_of(path);
    if !dir.is_dir() {
        return refuse(format!("the folder {} does not exist", dir.display()));
    }
    let real_dir = match dir.canonicalize() {
        Ok(d) => d,
        Err(e) => return refuse(format!("cannot resolve the folder {}: {e}", dir.display())),
    };
    if let Some(dataset) = dataset_around(&real_dir) {
        return refuse(format!(
            "is inside the dataset at {} (it holds _hslake/); a file written there could \
             replace a shard or a manifest, or add one its readers refuse; expected a path \
             outside every dataset",
            dataset.display()
        ));
    }
    if let Some(input) = inputs.iter().find(|i| same_file(path, i)) {
        return refuse(format!(
            "is the input {}; the output would replace what it is made from; expected another \
             path",
            input.display()
        ));
    }
    // Last, so that a path that may never be written is refused as such, --force or not.
    if let (Existing::RefuseWithout(flag), true) = (existing, exists(path)) {
        return refuse(format!("exists; give {flag} to replace it, or a new name"));
    }
    Ok(real_dir.join(name))
}

// What every temporary file of `name` starts with; `.tmp` ends it.
fn temporary_prefix(name: &str) -> String {
    format!(".{name}.hslake-")
}

// Removes the temporary files of `name` in `dir` that no process holds locked: left by runs that
// were killed or aborted before they could remove them.
fn remove_abandoned(dir: &Path, name: &str) {
    let prefix = temporary_prefix(name);
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let file_name = file_name.to_string_lossy();
        if !file_name.starts_with(&prefix)
            || !file_name.ends_with(".tmp")
            || !entry.file_type().is_ok_and(|t| t.is_file())
        {
            continue;
        }
        let path = entry.path();
        let Ok(file) = File::open(&path) else {
            continue;
        };
        // A run writing it now holds the lock.
        if file.try_lock().is_ok() && std::fs::remove_file(&path).is_ok() {
            tracing::info!(file = %path.display(), "removed a temporary file left by an earlier run that did not finish");
        }
    }
}

/// One output being written: a locked, hidden temporary file beside the output's path, which
/// [`OutputFile::finish`] renames into place and which dropping removes.
#[derive(Debug)]
pub struct OutputFile {
    path: PathBuf,
    tmp: NamedTempFile,
}

impl OutputFile {
    /// Starts writing `path` (a path [`check_output`] gave), after removing temporary files
    /// that earlier runs writing `path` left behind.
    pub fn create(path: &Path) -> Result<Self, OutputError> {
        let err = |reason: String| OutputError {
            path: path.to_path_buf(),
            reason,
        };
        let dir = folder_of(path);
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        remove_abandoned(&dir, &name);
        let tmp = tempfile::Builder::new()
            .prefix(&temporary_prefix(&name))
            .suffix(".tmp")
            .tempfile_in(&dir)
            .map_err(|e| {
                err(format!(
                    "cannot create a temporary file in {}: {e}",
                    dir.display()
                ))
            })?;
        // Held until the file is renamed into place or removed; another run that opens it in
        // the moment before it is taken may remove it, and this run then fails to rename it.
        tmp.as_file()
            .lock()
            .map_err(|e| err(format!("cannot lock the temporary file: {e}")))?;
        Ok(OutputFile {
            path: path.to_path_buf(),
            tmp,
        })
    }

    /// A handle of the temporary file to write the output through.
    pub fn file(&self) -> Result<File, OutputError> {
        self.tmp.reopen().map_err(|e| OutputError {
            path: self.path.clone(),
            reason: format!("cannot open the temporary file: {e}"),
        })
    }

    /// Where the output is being written until it is finished.
    pub fn temporary_path(&self) -> &Path {
        self.tmp.path()
    }

    /// Syncs `file` (the output, written through [`OutputFile::file`]) and gives the temporary
    /// file the output's name, over a regular file there only where `existing` says so (a file
    /// that appeared since [`check_output`] is then refused, and left as it is). The temporary
    /// file is removed when this fails.
    pub fn finish(self, file: File, existing: Existing) -> Result<(), OutputError> {
        let OutputFile { path, tmp } = self;
        let err = |reason: String| OutputError {
            path: path.clone(),
            reason,
        };
        file.sync_all()
            .map_err(|e| err(format!("cannot write: {e}")))?;
        match existing {
            Existing::Replace => tmp
                .persist(&path)
                .map(drop)
                .map_err(|e| err(format!("cannot rename into place: {}", e.error))),
            Existing::RefuseWithout(flag) => tmp.persist_noclobber(&path).map(drop).map_err(|e| {
                if e.error.kind() == io::ErrorKind::AlreadyExists {
                    err(format!(
                        "appeared while the output was written; give {flag} to replace it, or a \
                         new name"
                    ))
                } else {
                    err(format!("cannot rename into place: {}", e.error))
                }
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_existing_names_and_links_without_touching_their_targets() {
        let d = tempfile::tempdir().unwrap();
        let outside = d.path().join("outside");
        std::fs::write(&outside, b"precious").unwrap();
        let link = d.path().join("a.npy");
        std::os::unix::fs::symlink(&outside, &link).unwrap();
        let dangling = d.path().join("b.npy");
        std::os::unix::fs::symlink(d.path().join("nowhere"), &dangling).unwrap();
        for p in [&link, &dangling, &outside] {
            let err = create_new(p).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::AlreadyExists, "{}", p.display());
            assert!(exists(p));
        }
        assert!(!d.path().join("nowhere").exists());
        let tmp = d.path().join("c.tmp");
        std::io::Write::write_all(&mut create_new(&tmp).unwrap(), b"new").unwrap();
        let err = publish(&tmp, &link).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&outside).unwrap(), b"precious");
        assert!(!exists(&tmp), "the refused temporary file is gone");
        std::io::Write::write_all(&mut create_new(&tmp).unwrap(), b"new").unwrap();
        publish(&tmp, &d.path().join("c")).unwrap();
        assert!(!exists(&tmp));
        assert_eq!(std::fs::read(d.path().join("c")).unwrap(), b"new");
    }

    #[test]
    fn refuses_outputs_a_finished_file_cannot_replace() {
        let dir = tempfile::tempdir().unwrap();
        let err = |p: &Path, inputs: &[&Path]| {
            check_output(p, inputs, Existing::Replace)
                .unwrap_err()
                .to_string()
        };
        assert!(err(dir.path(), &[]).ends_with("is a directory; expected a file path"));
        let target = dir.path().join("t.jsonl");
        std::fs::write(&target, "x").unwrap();
        let link = dir.path().join("l.jsonl");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let e = err(&link, &[]);
        assert!(e.contains("is a symbolic link (to "), "{e}");
        let e = err(&dir.path().join("missing/o.jsonl"), &[]);
        assert!(e.ends_with("missing does not exist"), "{e}");
        let e = err(&target, &[&link]);
        assert!(e.contains("is the input"), "{e}");
        let e = err(Path::new("/dev/null"), &[]);
        assert!(e.contains("is not a regular file"), "{e}");
        let e = err(Path::new("s3://bucket/out.parquet"), &[]);
        assert!(e.contains("is a URL"), "{e}");
        let real = dir.path().canonicalize().unwrap();
        let new = dir.path().join("new.jsonl");
        assert_eq!(
            check_output(&new, &[&target], Existing::Replace).unwrap(),
            real.join("new.jsonl")
        );
        check_output(&target, &[], Existing::Replace).unwrap();
        let e = check_output(&target, &[], Existing::RefuseWithout("--force"))
            .unwrap_err()
            .to_string();
        assert!(
            e.ends_with("exists; give --force to replace it, or a new name"),
            "{e}"
        );
    }

    #[test]
    fn refuses_output_inside_a_dataset_also_through_a_linked_folder() {
        let dir = tempfile::tempdir().unwrap();
        let ds = dir.path().join("ds");
        std::fs::create_dir_all(ds.join("_hslake/versions")).unwrap();
        std::fs::create_dir_all(ds.join("data")).unwrap();
        let linked = dir.path().join("linked");
        std::os::unix::fs::symlink(ds.join("data"), &linked).unwrap();
        // A live shard: refused as inside the dataset, whether or not replacing is allowed.
        std::fs::write(ds.join("data/shard.parquet"), "PAR1").unwrap();
        let real = ds.canonicalize().unwrap();
        for p in [
            ds.join("data/shard.parquet"),
            ds.join("_hslake/versions/00000000000000000002.json"),
            ds.join("out.csv"),
            linked.join("shard.parquet"),
        ] {
            for existing in [Existing::Replace, Existing::RefuseWithout("--force")] {
                let e = check_output(&p, &[], existing).unwrap_err().to_string();
                let want = format!("is inside the dataset at {} ", real.display());
                assert!(e.contains(&want), "{} {existing:?}: {e}", p.display());
            }
        }
        check_output(&dir.path().join("out.csv"), &[], Existing::Replace).unwrap();
    }

    #[test]
    fn same_file_follows_links_and_compares_names_of_files_not_yet_written() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        std::fs::write(&a, "x").unwrap();
        let hard = dir.path().join("h");
        std::fs::hard_link(&a, &hard).unwrap();
        assert!(same_file(&a, &hard));
        let new = dir.path().join("n");
        let sub = dir.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        assert!(same_file(&new, &sub.join("../n")));
        assert!(!same_file(&new, &a));
    }

    fn write_output(path: &Path, text: &str, existing: Existing) -> Result<(), OutputError> {
        let out = OutputFile::create(path)?;
        let mut f = out.file()?;
        std::io::Write::write_all(&mut f, text.as_bytes()).unwrap();
        out.finish(f, existing)
    }

    #[test]
    fn an_output_appears_only_when_finished_and_replaces_only_where_allowed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("o.csv");
        let out = OutputFile::create(&path).unwrap();
        std::io::Write::write_all(&mut out.file().unwrap(), b"half").unwrap();
        assert!(!exists(&path));
        drop(out);
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "nothing left"
        );
        write_output(&path, "one", Existing::RefuseWithout("--force")).unwrap();
        // A file that appeared after the check is not replaced without the flag.
        let e = write_output(&path, "two", Existing::RefuseWithout("--force"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("appeared while the output was written; give --force"),
            "{e}"
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "one");
        write_output(&path, "three", Existing::Replace).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "three");
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temporary files"
        );
    }

    #[test]
    fn removes_temporary_files_no_running_writer_holds() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.jsonl");
        let running = OutputFile::create(&path).unwrap();
        // What a killed run leaves: its file, no lock.
        let abandoned = dir.path().join(".s.jsonl.hslake-dead00.tmp");
        std::fs::write(&abandoned, "partial").unwrap();
        let second = OutputFile::create(&path).unwrap();
        assert!(!abandoned.exists());
        assert!(
            running.temporary_path().exists(),
            "a running writer's file is kept"
        );
        let f = second.file().unwrap();
        second.finish(f, Existing::Replace).unwrap();
        drop(running);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
