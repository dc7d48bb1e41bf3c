//! File and directory helpers shared by the real devices (`uring`, `sync`), plus the request and
//! name checks that the simulator applies too, so that all three reject the same inputs.
//!
//! Invariants:
//! - A file name is a relative path of plain components (`a/b.slab`): no `.`, `..`, empty
//!   components or NUL. So a name can never escape the store directory, and one file has exactly
//!   one name (the simulator keys files by the string).
//! - When a file is created, every directory from the store root down to the file's parent is
//!   fsynced before `open_file` returns, so the new entry survives a crash. Creation is rare (a
//!   new slab class or shard), so the extra fsyncs cost nothing in steady state, and fsyncing the
//!   whole chain (not only the directories this call created) also covers a directory that a
//!   concurrent device created and has not fsynced yet.
//! - Errors carry the file name; nothing here panics on an I/O failure.

use std::fs::{self, File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use super::{AlignedBuf, DeviceError, FileId, IoRequest};
use crate::limits::{GROW_ZERO_FILL_CHUNK_BYTES, PAGE_BYTES};

/// The kernel moves at most this many bytes in one read or write (`MAX_RW_COUNT`, 2 GiB less one
/// page); a larger request would come back short, so it is rejected up front.
pub(crate) const IO_BYTES_MAX: usize = 0x7fff_f000;

/// Whether `value` is a multiple of `PAGE_BYTES`. A mask, not `%`, so it reads the same on every
/// toolchain (`u64::is_multiple_of` needs Rust 1.87; the workspace declares 1.80).
pub(crate) const fn page_aligned(value: u64) -> bool {
    const _: () = assert!(PAGE_BYTES.is_power_of_two());
    value & (PAGE_BYTES as u64 - 1) == 0
}

/// Checks that `name` is a relative path of plain components.
pub(crate) fn check_name(name: &str) -> Result<(), DeviceError> {
    let plain = |part: &str| !part.is_empty() && part != "." && part != "..";
    if name.contains('\0') || !name.split('/').all(plain) {
        return Err(DeviceError::BadRequest(format!("bad file name {name:?}")));
    }
    Ok(())
}

/// Checks a directory name for `list_files`: empty (the root) or a valid name.
pub(crate) fn check_dir(dir: &str) -> Result<(), DeviceError> {
    if dir.is_empty() {
        Ok(())
    } else {
        check_name(dir)
    }
}

/// Checks what every backend requires of a request before it touches a file: a known file,
/// page-aligned offset, a length the kernel transfers in one go, no offset overflow. (The buffer's
/// own alignment and length are guaranteed by `AlignedBuf`.)
pub(crate) fn check_request(request: &IoRequest, files_count: usize) -> Result<(), DeviceError> {
    if request.file as usize >= files_count {
        return Err(DeviceError::BadRequest(format!("unknown file id {}", request.file)));
    }
    if !page_aligned(request.offset) {
        return Err(DeviceError::BadRequest(format!(
            "offset {} is not a multiple of {PAGE_BYTES}",
            request.offset
        )));
    }
    if request.buf.len() > IO_BYTES_MAX {
        return Err(DeviceError::BadRequest(format!(
            "{} bytes in one request (at most {IO_BYTES_MAX})",
            request.buf.len()
        )));
    }
    if request.offset.checked_add(request.buf.len() as u64).is_none() {
        return Err(DeviceError::BadRequest(format!("offset {} overflows", request.offset)));
    }
    Ok(())
}

/// Describes a request for error messages: `Write of 4096 bytes at 8192 in shard-000/a.slab`.
pub(crate) fn describe(request: &IoRequest, name: &str) -> String {
    format!("{:?} of {} bytes at {} in {name}", request.kind, request.buf.len(), request.offset)
}

/// The result of a transfer that moved `done_bytes`: anything less than the whole buffer is an
/// error (the engine never reads past the end of a file, so a short read is a bug or damage).
pub(crate) fn transfer_result(
    request: &IoRequest,
    name: &str,
    done_bytes: usize,
) -> Result<(), DeviceError> {
    if done_bytes == request.buf.len() {
        Ok(())
    } else {
        Err(DeviceError::Short {
            what: describe(request, name),
            kind: request.kind,
            done: done_bytes,
            wanted: request.buf.len(),
        })
    }
}

/// Opens `root/name` for O_DIRECT reads and writes (plus `extra_flags`, e.g. O_DSYNC). With
/// `create`, a missing file is created together with its directories, durably (see the header).
pub(crate) fn open_direct(
    root: &Path,
    name: &str,
    create: bool,
    extra_flags: i32,
) -> Result<File, DeviceError> {
    check_name(name)?;
    let path = root.join(name);
    let mut options = OpenOptions::new();
    // O_CLOEXEC is std's default; it is spelled out because the contract names it.
    options.read(true).write(true).custom_flags(libc::O_DIRECT | libc::O_CLOEXEC | extra_flags);
    match options.open(&path) {
        Ok(file) => return Ok(file),
        Err(err) if create && err.kind() == ErrorKind::NotFound => {}
        Err(err) => return Err(open_error(&err, name)),
    }
    let parent = path.parent().unwrap_or(root).to_path_buf();
    let created_dirs = create_dirs(&parent)?;
    let file = options.create(true).open(&path).map_err(|err| open_error(&err, name))?;
    // The new entry lives in `parent`; the entries of the directories leading to it live in their
    // own parents. Root first, so a crash never leaves a durable child in a vanished parent.
    for dir in fsync_chain(root, &parent, created_dirs) {
        fsync_dir(&dir)?;
    }
    Ok(file)
}

fn open_error(err: &std::io::Error, name: &str) -> DeviceError {
    if err.raw_os_error() == Some(libc::EINVAL) {
        // The usual cause of EINVAL at open is a filesystem without O_DIRECT (tmpfs, some FUSE).
        DeviceError::from_errno(libc::EINVAL, format!("open {name} (O_DIRECT unsupported here?)"))
    } else {
        DeviceError::from_io(err, name)
    }
}

/// Creates `dir` and its missing ancestors; returns the outermost directory it created, if any.
fn create_dirs(dir: &Path) -> Result<Option<PathBuf>, DeviceError> {
    let mut missing = Vec::new();
    let mut cursor = Some(dir);
    while let Some(path) = cursor {
        if path.as_os_str().is_empty() || path.is_dir() {
            break;
        }
        missing.push(path.to_path_buf());
        cursor = path.parent();
    }
    let outermost = missing.last().cloned();
    for path in missing.iter().rev() {
        match fs::create_dir(path) {
            Ok(()) => {}
            // Another device (shard thread) won the race; its directory is as good as ours.
            Err(err) if err.kind() == ErrorKind::AlreadyExists => {}
            Err(err) => {
                return Err(DeviceError::from_io(&err, format!("mkdir {}", path.display())))
            }
        }
    }
    Ok(outermost)
}

/// The directories to fsync after creating a file in `parent`, outermost first: from `root` down
/// to `parent`, starting one level higher when this call created `root` itself (its entry then
/// lives in root's parent). An empty path (the parent of a relative root) means the current
/// directory.
fn fsync_chain(root: &Path, parent: &Path, created_outermost: Option<PathBuf>) -> Vec<PathBuf> {
    let top = match created_outermost {
        Some(created) if root.starts_with(&created) => {
            created.parent().map(Path::to_path_buf).unwrap_or(created)
        }
        _ => root.to_path_buf(),
    };
    let mut chain: Vec<PathBuf> = parent
        .ancestors()
        .take_while(|dir| dir.starts_with(&top))
        .map(|dir| if dir.as_os_str().is_empty() { PathBuf::from(".") } else { dir.to_path_buf() })
        .collect();
    if chain.is_empty() {
        chain.push(parent.to_path_buf());
    }
    chain.reverse();
    chain
}

/// Creates a store's directory `dir` and its missing ancestors, durably: each directory that
/// gained an entry is fsynced, outermost first, so the new store's directory survives a crash
/// (a file created in it later fsyncs only the store directory down). Returns the directories it
/// fsynced (none when `dir` existed).
pub(crate) fn create_store_dir(dir: &Path) -> Result<Vec<PathBuf>, DeviceError> {
    let Some(created) = create_dirs(dir)? else { return Ok(Vec::new()) };
    // `created` is the outermost new directory; its entry lives in its parent, and each new
    // directory below holds the entry of the next.
    let top = match created.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let mut synced = vec![top];
    synced.extend(
        dir.ancestors()
            .skip(1)
            .take_while(|ancestor| ancestor.starts_with(&created))
            .map(Path::to_path_buf)
            .collect::<Vec<_>>()
            .into_iter()
            .rev(),
    );
    for parent in &synced {
        fsync_dir(parent)?;
    }
    Ok(synced)
}

/// Creates `dir` (inside `root`, which exists) and its missing ancestors, and fsyncs every
/// directory that gained an entry, outermost first. (The RocksDB engine's instance directories.)
#[cfg(feature = "rocksdb")]
pub(crate) fn create_dirs_durably(root: &Path, dir: &Path) -> Result<(), DeviceError> {
    let Some(created) = create_dirs(dir)? else { return Ok(()) };
    for parent in fsync_chain(root, dir.parent().unwrap_or(root), Some(created)) {
        fsync_dir(&parent)?;
    }
    Ok(())
}

/// fsyncs a directory, making the entries created in it durable.
pub(crate) fn fsync_dir(dir: &Path) -> Result<(), DeviceError> {
    let what = || format!("fsync directory {}", dir.display());
    let handle = File::open(dir).map_err(|err| DeviceError::from_io(&err, what()))?;
    handle.sync_all().map_err(|err| DeviceError::from_io(&err, what()))
}

/// Names (not paths) of the regular files in `root/dir`, sorted; empty if `dir` does not exist.
pub(crate) fn list_files(root: &Path, dir: &str) -> Result<Vec<String>, DeviceError> {
    check_dir(dir)?;
    let path = root.join(dir);
    let what = || format!("list {}", path.display());
    let entries = match fs::read_dir(&path) {
        Ok(entries) => entries,
        Err(err) if err.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
        Err(err) => return Err(DeviceError::from_io(&err, what())),
    };
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|err| DeviceError::from_io(&err, what()))?;
        let file_type = entry.file_type().map_err(|err| DeviceError::from_io(&err, what()))?;
        if !file_type.is_file() {
            continue;
        }
        // A name that is not UTF-8 cannot be one of ours (the engine names files in ASCII).
        match entry.file_name().into_string() {
            Ok(name) => names.push(name),
            Err(other) => {
                tracing::warn!(name = ?other, dir = %path.display(), "skipping non-UTF-8 file name")
            }
        }
    }
    names.sort();
    Ok(names)
}

pub(crate) fn file_len_bytes(file: &File, name: &str) -> Result<u64, DeviceError> {
    file.metadata()
        .map(|meta| meta.len())
        .map_err(|err| DeviceError::from_io(&err, format!("fstat {name}")))
}

/// Grows `file` to `len_bytes` with allocated space that holds zeros, written rather than only
/// reserved, and makes the size durable. Returns the bytes of zeros written. Never shrinks: a
/// length at or below the current one is a no-op.
///
/// Why write the zeros: fallocate leaves *unwritten* extents, and the first write into one
/// changes the file's extent map, so every fdatasync after such writes also writes the inode
/// (ext4 without a journal writes it synchronously; with one, it commits a transaction). A
/// store that is loading writes only into new space: that made each flush two dependent device
/// writes, and loads 16-54% slower on this machine (docs/benchmarks.md, "Growing a file").
/// Written zeros make the later writes plain overwrites, at the cost of writing the new space
/// twice, sequentially, once.
pub(crate) fn grow_file(file: &File, name: &str, len_bytes: u64) -> Result<u64, DeviceError> {
    if !page_aligned(len_bytes) {
        return Err(DeviceError::BadRequest(format!(
            "grow {name} to {len_bytes} bytes: not a multiple of {PAGE_BYTES}"
        )));
    }
    let Ok(len_signed) = libc::off_t::try_from(len_bytes) else {
        return Err(DeviceError::BadRequest(format!(
            "grow {name} to {len_bytes} bytes: too large"
        )));
    };
    let old_len_bytes = file_len_bytes(file, name)?;
    if len_bytes <= old_len_bytes {
        return Ok(0);
    }
    loop {
        // SAFETY: fallocate only reads its integer arguments; `file` keeps the fd open.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len_signed) };
        if rc == 0 {
            break;
        }
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => continue,
            // Filesystems without fallocate still support a sparse extension; the space is then
            // allocated by the first write (which may fail with ENOSPC, reported per request).
            Some(libc::EOPNOTSUPP) => {
                file.set_len(len_bytes)
                    .map_err(|err| DeviceError::from_io(&err, format!("ftruncate {name}")))?;
                break;
            }
            _ => return Err(DeviceError::from_io(&err, format!("fallocate {name}"))),
        }
    }
    let zeroed = zero_fill(file, name, old_len_bytes, len_bytes)?;
    // fsync, not fdatasync: the new size and extents are metadata the next boot must see.
    file.sync_all().map_err(|err| DeviceError::from_io(&err, format!("fsync {name}")))?;
    Ok(zeroed)
}

/// Writes zeros over `[start, end)` of `file` (an O_DIRECT file: the buffer is page-aligned,
/// and so is `end`); returns the bytes written. A `start` inside a page (a file left short by
/// something else) begins at the next page: the part of a page already there is never
/// overwritten, and its tail reads as zeros either way.
fn zero_fill(file: &File, name: &str, start: u64, end: u64) -> Result<u64, DeviceError> {
    use std::os::unix::fs::FileExt;
    let start = start.next_multiple_of(PAGE_BYTES as u64);
    if start >= end {
        return Ok(0);
    }
    let chunk_bytes =
        usize::try_from(end - start).unwrap_or(usize::MAX).min(GROW_ZERO_FILL_CHUNK_BYTES);
    let zeros = AlignedBuf::zeroed(chunk_bytes);
    let mut at = start;
    while at < end {
        let len = usize::try_from(end - at).unwrap_or(usize::MAX).min(zeros.len());
        file.write_all_at(&zeros[..len], at)
            .map_err(|err| DeviceError::from_io(&err, format!("zero-fill {name} at {at}")))?;
        at += len as u64;
    }
    Ok(end - start)
}

/// fdatasync: the data written so far, and the metadata needed to read it back, reach stable
/// storage (the device's write cache is flushed).
pub(crate) fn sync_data(file: &File, name: &str) -> Result<(), DeviceError> {
    file.sync_data().map_err(|err| DeviceError::from_io(&err, format!("fdatasync {name}")))
}

/// A real device's count of the write completions `reap` handed out, and how far its flushes
/// covered them (`BlockDevice::write_completions_reaped` / `_durable`).
#[derive(Default)]
pub(crate) struct FlushLedger {
    reaped: u64,
    durable: u64,
}

impl FlushLedger {
    /// Hands `ready` completions out to `out`, counting the writes among them.
    pub(crate) fn hand_out(
        &mut self,
        ready: impl Iterator<Item = super::IoCompletion>,
        out: &mut Vec<super::IoCompletion>,
    ) {
        for completion in ready {
            self.reaped += u64::from(completion.kind == super::IoKind::Write);
            out.push(completion);
        }
    }

    /// `flush` under `FlushPerRound`: syncs the marked files (every write handed out so far
    /// completed before now, so its file is marked), then counts everything handed out before
    /// as durable.
    pub(crate) fn flush(
        &mut self,
        files: &[OpenFile],
        dirty: &mut [bool],
        observer: Option<&dyn super::IoObserver>,
    ) -> Result<(), DeviceError> {
        let covered = self.reaped;
        sync_marked_files(files, dirty, observer)?;
        assert!(covered >= self.durable, "flush coverage went backwards");
        self.durable = covered;
        Ok(())
    }

    pub(crate) fn reaped(&self) -> u64 {
        self.reaped
    }

    /// A background flush that began when `reaped` was `covered` has ended well (a flush in
    /// place may have covered more meanwhile: coverage never goes back).
    pub(crate) fn covered_in_background(&mut self, covered: u64) {
        assert!(covered <= self.reaped, "a flush covered writes not yet reaped");
        self.durable = self.durable.max(covered);
    }

    /// Under `Dsync` a completed write is durable at once.
    pub(crate) fn durable(&self, durability: super::WriteDurability) -> u64 {
        match durability {
            super::WriteDurability::Dsync => self.reaped,
            super::WriteDurability::FlushPerRound => self.durable,
        }
    }
}

/// fdatasyncs every file marked in `dirty` (a write to it completed since its last fdatasync
/// began), clearing each mark before its call, and tells `observer` when each begins and ends.
/// On a failure the file stays marked and the error is returned. The real devices' `flush`.
pub(crate) fn sync_marked_files(
    files: &[OpenFile],
    dirty: &mut [bool],
    observer: Option<&dyn super::IoObserver>,
) -> Result<(), DeviceError> {
    for (open, dirty) in files.iter().zip(dirty.iter_mut()) {
        if !*dirty {
            continue;
        }
        // Cleared before the call: nothing completes meanwhile (the device's thread is here).
        *dirty = false;
        if let Some(observer) = observer {
            observer.sync_started(&open.name);
        }
        let synced = sync_data(&open.file, &open.name);
        if let Some(observer) = observer {
            observer.sync_finished(&open.name, synced.is_ok());
        }
        if let Err(err) = synced {
            *dirty = true;
            return Err(err);
        }
    }
    Ok(())
}

/// An open file of a real device and the name it was opened under (for error messages).
pub(crate) struct OpenFile {
    pub(crate) file: File,
    pub(crate) name: String,
}

/// Opens (or finds already open) `name` in a device's file table; returns its id. One name has one
/// id per device, so the device holds one descriptor per file however often the engine opens it.
pub(crate) fn open_in_table(
    table: &mut Vec<OpenFile>,
    root: &Path,
    name: &str,
    create: bool,
    extra_flags: i32,
) -> Result<FileId, DeviceError> {
    check_name(name)?;
    if let Some(index) = table.iter().position(|open| open.name == name) {
        return Ok(index as FileId);
    }
    let Ok(id) = FileId::try_from(table.len()) else {
        return Err(DeviceError::BadRequest("too many open files".into()));
    };
    let file = open_direct(root, name, create, extra_flags)?;
    table.push(OpenFile { file, name: name.to_string() });
    Ok(id)
}

/// `open_in_table`, telling `observer` of a file newly opened (with its length).
pub(crate) fn open_observed(
    table: &mut Vec<OpenFile>,
    root: &Path,
    name: &str,
    create: bool,
    extra_flags: i32,
    observer: Option<&dyn super::IoObserver>,
) -> Result<FileId, DeviceError> {
    let opened_before = table.len();
    let id = open_in_table(table, root, name, create, extra_flags)?;
    if let (Some(observer), true) = (observer, table.len() > opened_before) {
        observer.file_opened(name, file_len_bytes(&table[id as usize].file, name)?);
    }
    Ok(id)
}

/// `grow_file` of a file of the table, telling `observer` of the size made durable and counting
/// the zeros it wrote in `stats` (device writes like any other: the write amplification counts
/// them).
pub(crate) fn grow_observed(
    table: &[OpenFile],
    file: FileId,
    len_bytes: u64,
    observer: Option<&dyn super::IoObserver>,
    stats: &mut super::DeviceStats,
) -> Result<(), DeviceError> {
    let open = lookup(table, file)?;
    let zeroed = grow_file(&open.file, &open.name, len_bytes)?;
    stats.count_zero_fill(zeroed);
    if let Some(observer) = observer {
        observer.file_grown(&open.name, len_bytes);
    }
    Ok(())
}

/// Looks up a file id for the non-I/O calls (`grow_file`, `file_len_bytes`).
pub(crate) fn lookup(table: &[OpenFile], file: FileId) -> Result<&OpenFile, DeviceError> {
    table
        .get(file as usize)
        .ok_or_else(|| DeviceError::BadRequest(format!("unknown file id {file}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The extents of `file` (offset, length, flags) through the FIEMAP ioctl; `None` where the
    /// file system does not map extents this way.
    fn extents(file: &File) -> Option<Vec<(u64, u64, u32)>> {
        // struct fiemap (32 bytes) and struct fiemap_extent (56 bytes), linux/fiemap.h.
        #[repr(C)]
        struct Extent {
            logical: u64,
            physical: u64,
            length: u64,
            reserved64: [u64; 2],
            flags: u32,
            reserved: [u32; 3],
        }
        #[repr(C)]
        struct Map {
            start: u64,
            length: u64,
            flags: u32,
            mapped_extents: u32,
            extent_count: u32,
            reserved: u32,
            extents: [Extent; 64],
        }
        const FS_IOC_FIEMAP: libc::c_ulong = 0xC020_660B;
        const FIEMAP_FLAG_SYNC: u32 = 1;
        // SAFETY: `Map` is plain integers, for which all zeros is a valid value.
        let mut map: Map = unsafe { std::mem::zeroed() };
        map.length = u64::MAX;
        map.flags = FIEMAP_FLAG_SYNC;
        map.extent_count = 64;
        // SAFETY: FS_IOC_FIEMAP reads the header of `map` and writes at most `extent_count`
        // extents into it; `map` lives across the call and `file` keeps the fd open.
        let rc = unsafe { libc::ioctl(file.as_raw_fd(), FS_IOC_FIEMAP, &mut map as *mut Map) };
        if rc != 0 {
            return None;
        }
        let mapped = (map.mapped_extents as usize).min(64);
        Some(map.extents[..mapped].iter().map(|e| (e.logical, e.length, e.flags)).collect())
    }

    /// A grown file's new space is written zeros, not unwritten extents: a write into an
    /// unwritten extent changes the extent map, and each fdatasync after it then writes the
    /// inode too (docs/durability.md, "Growing a file"). Fails with the zero-fill removed on a
    /// file system that allocates unwritten extents (ext4, XFS).
    #[test]
    fn growth_leaves_no_unwritten_extent() {
        const FIEMAP_EXTENT_UNWRITTEN: u32 = 0x800;
        let dir = tempfile::tempdir().unwrap();
        let file = match open_direct(dir.path(), "grown.slab", true, 0) {
            Ok(file) => file,
            Err(err) => {
                eprintln!("skipping: no O_DIRECT in the temp dir: {err}");
                return;
            }
        };
        let len_bytes = 3 * GROW_ZERO_FILL_CHUNK_BYTES as u64 + 5 * PAGE_BYTES as u64;
        assert_eq!(grow_file(&file, "grown.slab", len_bytes).unwrap(), len_bytes);
        assert_eq!(grow_file(&file, "grown.slab", 2 * PAGE_BYTES as u64).unwrap(), 0);
        let grown = len_bytes + 4 * PAGE_BYTES as u64;
        assert_eq!(grow_file(&file, "grown.slab", grown).unwrap(), 4 * PAGE_BYTES as u64);
        let Some(extents) = extents(&file) else {
            eprintln!("skipping the extent check: FIEMAP unsupported here");
            return;
        };
        assert!(!extents.is_empty(), "a grown file has its space allocated");
        let covered: u64 = extents.iter().map(|&(_, length, _)| length).sum();
        assert!(covered >= grown, "extents cover {covered} of {grown} bytes");
        for (offset, length, flags) in extents {
            assert_eq!(
                flags & FIEMAP_EXTENT_UNWRITTEN,
                0,
                "the extent at {offset} ({length} bytes) is unwritten"
            );
        }
        assert!(std::fs::read(dir.path().join("grown.slab")).unwrap().iter().all(|&b| b == 0));
    }

    #[test]
    fn names() {
        for good in ["a", "a/b.slab", "shard-000/class-04.slab"] {
            assert!(check_name(good).is_ok(), "{good}");
        }
        for bad in ["", "/a", "a/", "a//b", "./a", "a/../b", "..", "a\0b"] {
            assert!(matches!(check_name(bad), Err(DeviceError::BadRequest(_))), "{bad:?}");
        }
        assert!(check_dir("").is_ok());
        assert!(check_dir("..").is_err());
    }

    /// Issue 20, finding 7: a new store's directory was created with `create_dir_all` and its
    /// parent never fsynced, so a crash could lose the whole new store's entry.
    #[test]
    fn a_new_store_directory_is_fsynced_into_its_parent() {
        let root = tempfile::tempdir().unwrap();
        let store = root.path().join("a").join("b").join("store");
        let synced = create_store_dir(&store).unwrap();
        assert!(store.is_dir());
        let expected: Vec<PathBuf> =
            vec![root.path().to_path_buf(), root.path().join("a"), root.path().join("a").join("b")];
        assert_eq!(synced, expected, "every directory that gained an entry, outermost first");
        assert_eq!(create_store_dir(&store).unwrap(), Vec::<PathBuf>::new(), "nothing new");
        let sibling = root.path().join("a").join("other");
        assert_eq!(create_store_dir(&sibling).unwrap(), vec![root.path().join("a")]);
    }

    #[test]
    fn fsync_chain_covers_created_dirs() {
        let root = Path::new("/r/store");
        let parent = Path::new("/r/store/a/b");
        let plain = fsync_chain(root, parent, Some(PathBuf::from("/r/store/a")));
        assert_eq!(
            plain,
            vec![PathBuf::from("/r/store"), PathBuf::from("/r/store/a"), parent.to_path_buf()]
        );
        let root_created = fsync_chain(root, parent, Some(PathBuf::from("/r/store")));
        assert_eq!(root_created.first(), Some(&PathBuf::from("/r")));
        assert_eq!(root_created.last(), Some(&parent.to_path_buf()));
        let nothing_created = fsync_chain(root, root, None);
        assert_eq!(nothing_created, vec![root.to_path_buf()]);
        let relative = fsync_chain(Path::new("data"), Path::new("data/x"), Some("data".into()));
        assert_eq!(relative, vec![PathBuf::from("."), "data".into(), "data/x".into()]);
    }
}

/// Checks shared by the real devices' tests.
#[cfg(test)]
pub(crate) mod testing {
    use std::path::Path;

    use crate::device::{AlignedBuf, BlockDevice, DeviceError, IoCompletion, IoKind, IoRequest};
    use crate::limits::PAGE_BYTES;

    const PAGE: u64 = PAGE_BYTES as u64;

    fn pattern(seed: u8, len_bytes: usize) -> AlignedBuf {
        let mut buf = AlignedBuf::zeroed(len_bytes);
        for (i, b) in buf.iter_mut().enumerate() {
            *b = seed.wrapping_mul(31) ^ (i as u8) ^ (i >> 9) as u8;
        }
        buf
    }

    fn reap_all(device: &mut dyn BlockDevice) -> Vec<IoCompletion> {
        let mut out = Vec::new();
        while device.in_flight() > 0 {
            let before = out.len();
            device.reap(1, &mut out).unwrap();
            assert!(out.len() > before, "reap(1) returned nothing");
        }
        out.sort_by_key(|c| c.token);
        out
    }

    /// Open, grow, write, flush, read back, errors and listing, on a device over `root` that
    /// already has exactly one file open: `probe-direct` at the root.
    pub(crate) fn round_trip(device: &mut dyn BlockDevice, root: &Path) {
        let name = "shard-000/class-04.slab";
        assert_eq!(
            device.open_file(name, false).unwrap_err(),
            DeviceError::NotFound { name: name.into() }
        );
        assert!(matches!(device.open_file("../escape", true), Err(DeviceError::BadRequest(_))));
        let file = device.open_file(name, true).unwrap();
        assert!(root.join(name).is_file());
        assert_eq!(device.open_file(name, false).unwrap(), file, "one id per name");
        assert_eq!(device.file_len_bytes(file).unwrap(), 0);

        device.grow_file(file, 8 * PAGE).unwrap();
        assert_eq!(device.file_len_bytes(file).unwrap(), 8 * PAGE);
        device.grow_file(file, 4 * PAGE).unwrap();
        assert_eq!(device.file_len_bytes(file).unwrap(), 8 * PAGE, "grow never shrinks");
        assert!(matches!(device.grow_file(file, 8 * PAGE + 512), Err(DeviceError::BadRequest(_))));
        assert!(matches!(device.grow_file(99, 8 * PAGE), Err(DeviceError::BadRequest(_))));
        assert_eq!(std::fs::read(root.join(name)).unwrap(), vec![0u8; 8 * PAGE_BYTES]);

        // Pages 0..4: one single-page write each for 0, 1, and one two-page write for 2..4.
        let writes = vec![
            IoRequest {
                token: 0,
                file,
                offset: 0,
                kind: IoKind::Write,
                buf: pattern(1, PAGE_BYTES),
            },
            IoRequest {
                token: 1,
                file,
                offset: PAGE,
                kind: IoKind::Write,
                buf: pattern(2, PAGE_BYTES),
            },
            IoRequest {
                token: 2,
                file,
                offset: 2 * PAGE,
                kind: IoKind::Write,
                buf: pattern(3, 2 * PAGE_BYTES),
            },
        ];
        device.submit(writes).unwrap();
        let done = reap_all(device);
        assert_eq!(done.iter().map(|c| c.token).collect::<Vec<_>>(), vec![0, 1, 2]);
        for completion in &done {
            assert_eq!(completion.result, Ok(()), "token {}", completion.token);
            assert_eq!(completion.kind, IoKind::Write);
        }
        assert_eq!(done[2].offset, 2 * PAGE);
        device.flush().unwrap();

        let on_disk = std::fs::read(root.join(name)).unwrap();
        assert_eq!(&on_disk[..PAGE_BYTES], &pattern(1, PAGE_BYTES)[..]);
        assert_eq!(&on_disk[2 * PAGE_BYTES..4 * PAGE_BYTES], &pattern(3, 2 * PAGE_BYTES)[..]);
        assert_eq!(&on_disk[4 * PAGE_BYTES..], &vec![0u8; 4 * PAGE_BYTES][..]);

        let reads = vec![
            IoRequest {
                token: 10,
                file,
                offset: 0,
                kind: IoKind::Read,
                buf: AlignedBuf::zeroed(4 * PAGE_BYTES),
            },
            IoRequest {
                token: 11,
                file,
                offset: PAGE,
                kind: IoKind::Read,
                buf: AlignedBuf::zeroed(PAGE_BYTES),
            },
            // Past the end: the engine never does this, so it is an error, not a zero fill.
            IoRequest {
                token: 12,
                file,
                offset: 8 * PAGE,
                kind: IoKind::Read,
                buf: AlignedBuf::zeroed(PAGE_BYTES),
            },
            IoRequest {
                token: 13,
                file,
                offset: 7 * PAGE,
                kind: IoKind::Read,
                buf: AlignedBuf::zeroed(2 * PAGE_BYTES),
            },
            IoRequest {
                token: 14,
                file,
                offset: 100,
                kind: IoKind::Read,
                buf: AlignedBuf::zeroed(PAGE_BYTES),
            },
            IoRequest {
                token: 15,
                file: 77,
                offset: 0,
                kind: IoKind::Write,
                buf: AlignedBuf::zeroed(PAGE_BYTES),
            },
        ];
        device.submit(reads).unwrap();
        let done = reap_all(device);
        assert_eq!(done.len(), 6);
        done[0].result.clone().unwrap();
        let mut expected = Vec::new();
        expected.extend_from_slice(&pattern(1, PAGE_BYTES));
        expected.extend_from_slice(&pattern(2, PAGE_BYTES));
        expected.extend_from_slice(&pattern(3, 2 * PAGE_BYTES));
        assert_eq!(&done[0].buf[..], &expected[..]);
        done[1].result.clone().unwrap();
        assert_eq!(&done[1].buf[..], &pattern(2, PAGE_BYTES)[..]);
        assert!(
            matches!(
                done[2].result,
                Err(DeviceError::Short { kind: IoKind::Read, done: 0, wanted: 4096, .. })
            ),
            "{:?}",
            done[2].result
        );
        assert!(
            matches!(done[3].result, Err(DeviceError::Short { done: 4096, wanted: 8192, .. })),
            "{:?}",
            done[3].result
        );
        assert!(matches!(done[4].result, Err(DeviceError::BadRequest(_))), "{:?}", done[4].result);
        assert!(matches!(done[5].result, Err(DeviceError::BadRequest(_))), "{:?}", done[5].result);

        assert_eq!(device.list_files("shard-000").unwrap(), vec!["class-04.slab".to_string()]);
        assert_eq!(device.list_files("").unwrap(), vec!["probe-direct".to_string()], "no dirs");
        assert_eq!(device.list_files("missing").unwrap(), Vec::<String>::new());
        device.open_file("shard-000/a.slab", true).unwrap();
        assert_eq!(device.list_files("shard-000").unwrap(), vec!["a.slab", "class-04.slab"]);

        let stats = device.stats();
        // Three data writes of four pages, and the growth's zero-fill of eight pages (one write).
        assert_eq!((stats.writes, stats.bytes_written), (3 + 1, (4 + 8) * PAGE));
        assert_eq!((stats.reads, stats.bytes_read), (2, 5 * PAGE));
        assert_eq!(stats.flushes, 1);
    }
}
