//! Scratch paths for tests that hand files to the `kvoffload` binary: each
//! lives in its own temporary folder, removed when the path is dropped, so
//! test runs leave nothing in the system's temporary folder.

use std::ffi::OsStr;
use std::ops::Deref;
use std::path::{Path, PathBuf};

/// A path named `name` inside a fresh temporary folder that lives as long
/// as this value.
pub struct ScratchPath {
    path: PathBuf,
    _dir: tempfile::TempDir,
}

/// A scratch path named `name` (the folder itself when `name` is empty).
pub fn scratch(name: &str) -> ScratchPath {
    let dir = tempfile::Builder::new()
        .prefix("kvoffload-test-")
        .tempdir()
        .expect("create a temporary folder");
    ScratchPath {
        path: dir.path().join(name),
        _dir: dir,
    }
}

impl Deref for ScratchPath {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<Path> for ScratchPath {
    fn as_ref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<OsStr> for ScratchPath {
    fn as_ref(&self) -> &OsStr {
        self.path.as_os_str()
    }
}
