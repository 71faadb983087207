//! A host pool shared by the worker processes of one engine: a file (on
//! `/dev/shm`, a tmpfs) that every worker maps whole, as vLLM's
//! `SharedOffloadRegion`. With MLA KV replicated on every tensor-parallel
//! rank, one copy of each chunk serves every worker: rank 0 writes it, every
//! rank loads from it (`docs/vllm-connector.md`, "One copy of replicated MLA
//! KV").
//!
//! Every worker opens the same path with [`SharedRegion::open`]; whoever comes
//! first sizes the file, the others find it sized (the size is set by
//! `ftruncate`, which keeps bytes already written). Once every worker has
//! mapped it (the caller's barrier), one of them calls
//! [`SharedRegion::unlink`]: the mappings stay valid and the kernel frees the
//! memory when the last worker goes, however it goes.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use thiserror::Error;

use super::host_buffer::{read_raw, write_raw};

/// A shared region could not be opened or mapped.
#[derive(Debug, Error)]
pub enum SharedRegionError {
    /// Zero bytes were asked for.
    #[error("a shared host region needs at least one byte")]
    Empty,
    /// The path holds a NUL byte.
    #[error("shared host region path {0:?} holds a NUL byte")]
    BadPath(PathBuf),
    /// A system call failed.
    #[error("shared host region {path:?}: {op} failed: {source}")]
    Os {
        /// The region's path.
        path: PathBuf,
        /// The call (`open`, `ftruncate`, `mmap`, `unlink`, ...).
        op: &'static str,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },
    /// The file system holding the region (`/dev/shm`: a container's is
    /// often 64 MiB) has too little room for it.
    #[error(
        "shared host region {path:?} needs {wanted} bytes, its file system has {free} free: \
         enlarge it (a container's --shm-size) or lower cpu_bytes_to_use"
    )]
    NoRoom {
        /// The region's path.
        path: PathBuf,
        /// Bytes the region needs.
        wanted: usize,
        /// Bytes free on the file system.
        free: u64,
    },
    /// The file exists with another size: another engine's region, or one
    /// left by a run with another configuration.
    #[error(
        "shared host region {path:?} exists with {found} bytes, this engine needs {wanted}: \
         another engine uses the name, or a stale file remains (remove it)"
    )]
    SizeMismatch {
        /// The region's path.
        path: PathBuf,
        /// Bytes this worker needs.
        wanted: usize,
        /// Bytes the file has.
        found: u64,
    },
}

/// A shared, writable mapping of a whole file, page-aligned.
///
/// As with [`crate::worker::HostBuffer`], copies run through raw addresses,
/// so reading or writing the contents from Rust is `unsafe`; here other
/// processes may also write the bytes (the store writer's rank).
#[derive(Debug)]
pub struct SharedRegion {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    path: PathBuf,
}

// SAFETY: the mapping is plain bytes owned by this value (unmapped on drop);
// all access to the contents is `unsafe` or by address, under the job
// discipline of the backends.
unsafe impl Send for SharedRegion {}
// SAFETY: see `Send`; shared references expose only the address, length and path.
unsafe impl Sync for SharedRegion {}

fn os_err(path: &Path, op: &'static str) -> SharedRegionError {
    SharedRegionError::Os {
        path: path.to_path_buf(),
        op,
        source: std::io::Error::last_os_error(),
    }
}

/// Bytes free for an unprivileged writer on the file system of `fd`.
fn free_bytes(fd: libc::c_int, path: &Path) -> Result<u64, SharedRegionError> {
    // SAFETY: `vfs` is a valid out-pointer for `fstatvfs`; `fd` is open.
    let mut vfs: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstatvfs(fd, &mut vfs) } != 0 {
        return Err(os_err(path, "fstatvfs"));
    }
    Ok((vfs.f_bavail as u64).saturating_mul(vfs.f_frsize as u64))
}

impl SharedRegion {
    /// Opens (creating it if absent) the file at `path`, sizes it to `len`
    /// bytes if it is empty, maps it shared and allocates its pages. An
    /// existing file of another non-zero size is refused
    /// ([`SharedRegionError::SizeMismatch`]), as is a file system without
    /// room for it ([`SharedRegionError::NoRoom`]); bytes already in the
    /// file are kept.
    pub fn open(path: &Path, len: usize) -> Result<Self, SharedRegionError> {
        if len == 0 {
            return Err(SharedRegionError::Empty);
        }
        let c_path = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| SharedRegionError::BadPath(path.to_path_buf()))?;
        // SAFETY: `c_path` is a valid NUL-terminated string; the flags and mode
        // are plain integers.
        let fd = unsafe {
            libc::open(
                c_path.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_CLOEXEC,
                0o600 as libc::c_uint,
            )
        };
        if fd < 0 {
            return Err(os_err(path, "open"));
        }
        let mapped = Self::size_and_map(fd, path, len);
        // SAFETY: `fd` is the descriptor opened above, closed once; the
        // mapping (if any) stays valid without it.
        unsafe { libc::close(fd) };
        if let Err(SharedRegionError::NoRoom { .. }) = &mapped {
            // The file was empty (nothing mapped it yet, and every opener
            // would find no room either): leave nothing behind.
            // SAFETY: `c_path` is a valid NUL-terminated string.
            unsafe { libc::unlink(c_path.as_ptr()) };
        }
        let ptr = mapped?;
        Ok(Self {
            ptr,
            len,
            path: path.to_path_buf(),
        })
    }

    fn size_and_map(
        fd: libc::c_int,
        path: &Path,
        len: usize,
    ) -> Result<std::ptr::NonNull<u8>, SharedRegionError> {
        let wanted = libc::off_t::try_from(len).map_err(|_| SharedRegionError::SizeMismatch {
            path: path.to_path_buf(),
            wanted: len,
            found: 0,
        })?;
        // SAFETY: `st` is a valid out-pointer for `fstat`; `fd` is open.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            return Err(os_err(path, "fstat"));
        }
        if st.st_size == 0 {
            // A tmpfs hands out pages as they are first touched, and a touch
            // past its room kills the process (SIGBUS): refuse up front.
            let free = free_bytes(fd, path)?;
            if free < len as u64 {
                return Err(SharedRegionError::NoRoom {
                    path: path.to_path_buf(),
                    wanted: len,
                    free,
                });
            }
            // Two workers may both find it empty: both set the same size,
            // which keeps any byte the other has written since.
            // SAFETY: `fd` is open for writing.
            if unsafe { libc::ftruncate(fd, wanted) } != 0 {
                return Err(os_err(path, "ftruncate"));
            }
        } else if st.st_size != wanted {
            return Err(SharedRegionError::SizeMismatch {
                path: path.to_path_buf(),
                wanted: len,
                found: st.st_size as u64,
            });
        }
        // SAFETY: a fresh shared mapping of `len` bytes of an open file of at
        // least that size; the kernel chooses the address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_err(path, "mmap"));
        }
        // Every page allocated now (Linux 5.14+), so that a file system
        // filled by someone else since the check above is an error here, not
        // a SIGBUS in a copy later; bytes already written are kept. Older
        // kernels refuse the advice (EINVAL): the pages come on first touch.
        // SAFETY: the mapping just made, `len` bytes.
        if unsafe { libc::madvise(p, len, libc::MADV_POPULATE_WRITE) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINVAL) {
                // SAFETY: the mapping just made, unmapped once on this path.
                unsafe { libc::munmap(p, len) };
                return Err(SharedRegionError::Os {
                    path: path.to_path_buf(),
                    op: "madvise(MADV_POPULATE_WRITE)",
                    source: e,
                });
            }
        }
        std::ptr::NonNull::new(p.cast::<u8>()).ok_or_else(|| os_err(path, "mmap"))
    }

    /// The default path of an engine's region: `/dev/shm/kvoffload_<name>.mmap`,
    /// with every character of `name` outside `[A-Za-z0-9._-]` made `_`.
    pub fn default_path(name: &str) -> PathBuf {
        let clean: String = name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        PathBuf::from(format!("/dev/shm/kvoffload_{clean}.mmap"))
    }

    /// Removes the file's name (once every worker has mapped it). The
    /// mappings stay valid; a name already gone is not an error.
    pub fn unlink(&self) -> Result<(), SharedRegionError> {
        let c_path = CString::new(self.path.as_os_str().as_bytes())
            .map_err(|_| SharedRegionError::BadPath(self.path.clone()))?;
        // SAFETY: `c_path` is a valid NUL-terminated string.
        if unsafe { libc::unlink(c_path.as_ptr()) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::NotFound {
                return Err(SharedRegionError::Os {
                    path: self.path.clone(),
                    op: "unlink",
                    source: e,
                });
            }
        }
        Ok(())
    }

    /// Address of byte 0 (page-aligned).
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (regions are never empty).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Copies `data` to `offset`.
    ///
    /// # Safety
    /// No in-flight job, here or in another process, may read or write these bytes.
    ///
    /// # Panics
    /// If the range is out of bounds (a test-helper contract).
    pub unsafe fn write(&self, offset: usize, data: &[u8]) {
        // SAFETY: the mapping's live bytes; no concurrent access (caller contract).
        unsafe { write_raw(self.ptr, self.len, offset, data) }
    }

    /// Copies `len` bytes from `offset` into a vector.
    ///
    /// # Safety
    /// No in-flight job, here or in another process, may write these bytes.
    ///
    /// # Panics
    /// If the range is out of bounds.
    pub unsafe fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        // SAFETY: the mapping's live bytes; no concurrent writer (caller contract).
        unsafe { read_raw(self.ptr, self.len, offset, len) }
    }
}

impl Drop for SharedRegion {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `open`, of exactly `len` bytes, unmapped once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_path(tag: &str) -> PathBuf {
        std::env::temp_dir().join(format!(
            "kvoffload-shared-region-{tag}-{}.mmap",
            std::process::id()
        ))
    }

    #[test]
    fn two_mappings_of_one_path_see_each_others_bytes_and_survive_the_unlink() {
        let path = temp_path("two");
        let a = SharedRegion::open(&path, 10_000).unwrap();
        let b = SharedRegion::open(&path, 10_000).unwrap();
        assert_ne!(a.addr(), b.addr());
        assert_eq!(a.addr() % 4096, 0);
        a.unlink().unwrap();
        assert!(!path.exists());
        // SAFETY: no jobs exist.
        unsafe {
            assert!(b.read(0, 10_000).iter().all(|&x| x == 0));
            a.write(9_990, &[1, 2, 3]);
            assert_eq!(b.read(9_990, 3), vec![1, 2, 3]);
            b.write(0, &[9]);
            assert_eq!(a.read(0, 1), vec![9]);
        }
        // A second unlink (another worker's) is not an error.
        b.unlink().unwrap();
    }

    #[test]
    fn a_later_opener_keeps_the_bytes_already_written() {
        let path = temp_path("keep");
        let a = SharedRegion::open(&path, 8192).unwrap();
        // SAFETY: no jobs exist.
        unsafe { a.write(5000, &[42]) };
        let b = SharedRegion::open(&path, 8192).unwrap();
        a.unlink().unwrap();
        // SAFETY: no jobs exist.
        assert_eq!(unsafe { b.read(5000, 1) }, vec![42]);
    }

    #[test]
    fn bad_sizes_and_paths_are_typed_errors() {
        let path = temp_path("size");
        let a = SharedRegion::open(&path, 8192).unwrap();
        let e = SharedRegion::open(&path, 4096).unwrap_err();
        assert!(
            matches!(
                e,
                SharedRegionError::SizeMismatch {
                    wanted: 4096,
                    found: 8192,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("stale file"), "{e}");
        a.unlink().unwrap();
        assert!(matches!(
            SharedRegion::open(&path, 0),
            Err(SharedRegionError::Empty)
        ));
        let missing = Path::new("/nonexistent-kvoffload-dir/region.mmap");
        let e = SharedRegion::open(missing, 4096).unwrap_err();
        assert!(matches!(e, SharedRegionError::Os { op: "open", .. }), "{e}");
        let nul = Path::new("bad\0name");
        assert!(matches!(
            SharedRegion::open(nul, 4096),
            Err(SharedRegionError::BadPath(_))
        ));
    }

    #[test]
    fn a_file_system_without_room_is_refused_before_anything_is_touched() {
        let path = temp_path("room");
        let probe = SharedRegion::open(&path, 4096).unwrap();
        probe.unlink().unwrap();
        drop(probe);
        let c = CString::new(std::env::temp_dir().as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid path and out-pointer.
        let mut vfs: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut vfs) }, 0);
        let free = (vfs.f_bavail as u64) * (vfs.f_frsize as u64);
        let too_much = usize::try_from(free + (1 << 30)).unwrap();
        let e = SharedRegion::open(&path, too_much).unwrap_err();
        assert!(matches!(e, SharedRegionError::NoRoom { .. }), "{e}");
        assert!(e.to_string().contains("--shm-size"), "{e}");
        assert!(!path.exists(), "the empty file is not left behind");
    }

    #[test]
    fn default_paths_are_on_dev_shm_with_a_clean_name() {
        assert_eq!(
            SharedRegion::default_path("engine 1/a:b"),
            PathBuf::from("/dev/shm/kvoffload_engine_1_a_b.mmap")
        );
    }
}
