//! What the daemon admits as a job beyond the capture's own checks: outputs under the
//! `--allowed-output` prefixes only, inputs of at most `--max-job-bytes`, and checks in
//! progress that may take no more than `--max-spool-bytes` of memory together. Every record of
//! an input is checked before its job is queued; the check reads it record by record, and what
//! it may hold (its longest line and the ids it has seen) is taken from the last bound while
//! it runs, so that concurrent submissions cannot exhaust memory.
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context, Result};
use hslake_schemas::units::show_size;
use hslake_store::location;

/// Dataset URL prefixes jobs may write under.
#[derive(Debug)]
pub struct AllowedOutputs {
    prefixes: Vec<Prefix>,
    /// The daemon's own state directory, never an output.
    state_dir: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq)]
enum Prefix {
    /// A local directory, with symbolic links resolved.
    Local(PathBuf),
    /// An object-store URL prefix, canonical (`s3://bucket/prefix`, no trailing slash).
    Url(String),
}

impl std::fmt::Display for Prefix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Prefix::Local(p) => write!(f, "file://{}", p.display()),
            Prefix::Url(u) => f.write_str(u),
        }
    }
}

impl AllowedOutputs {
    /// The prefixes given, or by default the directory holding a local `--state` (else the
    /// current directory). Local ones must exist.
    pub fn new(given: &[String], state: &str) -> Result<Self> {
        let state_loc = location::parse(state).with_context(|| format!("--state {state}"))?;
        let state_dir = match state_loc.local_dir() {
            Some(d) => Some(resolve(&d).with_context(|| format!("--state {state}"))?),
            None => None,
        };
        let mut prefixes = vec![];
        for g in given {
            let loc = location::parse(g).with_context(|| format!("--allowed-output {g}"))?;
            prefixes.push(match loc.local_dir() {
                Some(d) => Prefix::Local(std::fs::canonicalize(&d).with_context(|| {
                    format!(
                        "--allowed-output {g}: {} must be an existing directory",
                        d.display()
                    )
                })?),
                None => Prefix::Url(loc.url),
            });
        }
        if prefixes.is_empty() {
            let default = match state_dir.as_deref().and_then(Path::parent) {
                Some(parent) => parent.to_path_buf(),
                None => std::env::current_dir()
                    .and_then(std::fs::canonicalize)
                    .context("the current directory (the default --allowed-output)")?,
            };
            prefixes.push(Prefix::Local(default));
        }
        Ok(AllowedOutputs {
            prefixes,
            state_dir,
        })
    }

    /// The prefixes, as URLs, for the log and error messages.
    pub fn describe(&self) -> String {
        let all: Vec<String> = self.prefixes.iter().map(|p| p.to_string()).collect();
        all.join(", ")
    }

    /// Refuses an output outside every prefix, or inside the state directory.
    pub fn check(&self, output: &str) -> Result<()> {
        let outside = || {
            anyhow::anyhow!(
                "output {output} is outside the outputs this daemon allows ({}); its \
                 --allowed-output flags say where jobs may write",
                self.describe()
            )
        };
        // `..` never survives URL parsing of file URLs; an object-store key keeps it, and a
        // prefix check on such a key would mean nothing.
        if output.split('/').any(|part| part == "..") {
            bail!("output {output}: \"..\" is not allowed in an output");
        }
        let loc = location::parse(output).with_context(|| format!("output {output}"))?;
        let target = match loc.local_dir() {
            Some(dir) => Prefix::Local(resolve(&dir)?),
            None => Prefix::Url(loc.url.clone()),
        };
        if let (Prefix::Local(t), Some(state)) = (&target, &self.state_dir) {
            if t.starts_with(state) {
                bail!("output {output} is inside the daemon's --state directory");
            }
        }
        let inside = self.prefixes.iter().any(|p| match (p, &target) {
            (Prefix::Local(p), Prefix::Local(t)) => t.starts_with(p),
            (Prefix::Url(p), Prefix::Url(t)) => {
                t == p
                    || t.strip_prefix(p.as_str())
                        .is_some_and(|r| r.starts_with('/'))
            }
            _ => false,
        });
        if inside {
            Ok(())
        } else {
            Err(outside())
        }
    }
}

/// `path` with symbolic links resolved as far as it exists, the rest appended: a link inside
/// an allowed directory that points out of it leads out of it.
fn resolve(path: &Path) -> Result<PathBuf> {
    let mut existing = path.to_path_buf();
    let mut rest = vec![];
    while !existing.exists() {
        match (existing.file_name(), existing.parent()) {
            (Some(name), Some(parent)) => {
                rest.push(name.to_os_string());
                existing = parent.to_path_buf();
            }
            _ => break,
        }
    }
    let mut resolved = std::fs::canonicalize(&existing)
        .with_context(|| format!("resolving {}", existing.display()))?;
    for name in rest.into_iter().rev() {
        resolved.push(name);
    }
    if resolved.components().any(|c| c == Component::ParentDir) {
        bail!("{}: \"..\" is not allowed in an output", path.display());
    }
    Ok(resolved)
}

/// Memory the checks of job inputs in progress may take, against `--max-spool-bytes`.
pub struct SpoolBudget {
    limit: u64,
    used: Mutex<u64>,
}

/// Bytes taken from the budget until dropped (moved into the check, so a client that hangs
/// up does not free them while the check still runs).
pub struct Spooled {
    budget: Arc<SpoolBudget>,
    bytes: u64,
}

impl Drop for Spooled {
    fn drop(&mut self) {
        let mut used = self.budget.used.lock().unwrap_or_else(|p| p.into_inner());
        *used -= self.bytes;
    }
}

impl SpoolBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: u64) -> Arc<Self> {
        Arc::new(SpoolBudget {
            limit,
            used: Mutex::new(0),
        })
    }

    /// Takes `bytes` from the budget, or says why not.
    pub fn take(self: &Arc<Self>, bytes: u64) -> Result<Spooled, String> {
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        if used.saturating_add(bytes) > self.limit {
            return Err(format!(
                "the checks of job inputs in progress may take {} of memory already, and \
                 checking this input may take {}, which would pass --max-spool-bytes {}; retry \
                 later",
                show_size(*used),
                show_size(bytes),
                show_size(self.limit)
            ));
        }
        *used += bytes;
        Ok(Spooled {
            budget: self.clone(),
            bytes,
        })
    }

    /// Bytes taken now.
    #[cfg(test)]
    pub fn used(&self) -> u64 {
        *self.used.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(p: &Path) -> String {
        format!("file://{}", p.display())
    }

    #[test]
    fn outputs_must_lie_under_an_allowed_prefix() {
        let tmp = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(tmp.path()).unwrap();
        let allowed = root.join("allowed");
        std::fs::create_dir_all(allowed.join("sub")).unwrap();
        std::fs::create_dir_all(root.join("elsewhere")).unwrap();
        std::os::unix::fs::symlink(root.join("elsewhere"), allowed.join("link")).unwrap();
        let given = [url(&allowed), "s3://bucket/captures".to_string()];
        let a = AllowedOutputs::new(&given, &url(&root.join("state"))).unwrap();
        for ok in [
            url(&allowed.join("ds")),
            url(&allowed.join("sub/new/ds")),
            allowed.join("plain-path").display().to_string(),
            "s3://bucket/captures/run1".into(),
            "s3://bucket/captures".into(),
        ] {
            a.check(&ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for bad in [
            "file:///".to_string(),
            url(&root.join("elsewhere/ds")),
            url(&allowed.join("link/ds")),
            format!("file://{}/../elsewhere", allowed.display()),
            "s3://bucket/capturesX/run".into(),
            "s3://bucket/captures/../other".into(),
            "s3://other/captures/run".into(),
            "memory://x".into(),
        ] {
            let e = a.check(&bad).unwrap_err().to_string();
            assert!(e.contains("outside") || e.contains("\"..\""), "{bad}: {e}");
        }
    }

    #[test]
    fn the_default_is_the_state_directory_s_parent_minus_the_state_itself() {
        let tmp = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(tmp.path()).unwrap();
        let state = root.join("state");
        std::fs::create_dir_all(&state).unwrap();
        let a = AllowedOutputs::new(&[], &state.display().to_string()).unwrap();
        assert_eq!(a.describe(), url(&root));
        a.check(&url(&root.join("ds"))).unwrap();
        let e = a.check(&url(&state.join("jobs"))).unwrap_err().to_string();
        assert!(e.contains("inside the daemon's --state"), "{e}");
        let e = AllowedOutputs::new(&[url(&root.join("missing"))], &url(&state))
            .unwrap_err()
            .to_string();
        assert!(e.contains("must be an existing directory"), "{e}");
    }

    #[test]
    fn the_spool_budget_refuses_past_its_limit_until_bytes_are_given_back() {
        let b = SpoolBudget::new(100);
        let first = b.take(60).unwrap();
        let e = b.take(50).err().unwrap();
        assert!(e.contains("--max-spool-bytes 100B"), "{e}");
        let _second = b.take(40).unwrap();
        assert_eq!(b.used(), 100);
        drop(first);
        assert_eq!(b.used(), 40);
        b.take(60).unwrap();
    }
}
