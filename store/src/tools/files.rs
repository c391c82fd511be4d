//! Local files that exports write (`.npy` files, trainer layouts): each created anew, never
//! through a symbolic link and never over an existing file, so that links or files planted in
//! the output directory cannot make an export write outside it or destroy what is there.
use std::fs::File;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

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
}
