//! The store manifest: one page at the top of the store that fixes what every later open must
//! agree with (shard count and key hash). Spec: docs/format/manifest.md.
//!
//! It is written once, durably, when the store is created, before any shard writes a slab;
//! so a store whose manifest is missing or blank and which has no slab files was interrupted
//! during creation and is created again, while a blank manifest beside slab files is corruption.

use crate::device::{AlignedBuf, BlockDevice, IoKind, IoRequest};
use crate::engine::native::recovery::read_sync;
use crate::error::OpenError;
use crate::limits::PAGE_BYTES;

pub const MANIFEST_FILE: &str = "MANIFEST";
pub const MANIFEST_MAGIC: [u8; 8] = *b"COPSEMAN";
pub const MANIFEST_FORMAT_VERSION: u32 = 1;

/// How keys map to shards. persisted: never renumber.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyHash {
    /// xxh3-64 of the full key with seed 0, modulo the shard count.
    Xxh3Seed0Modulo = 1,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Manifest {
    pub shard_count: u32,
    pub key_hash: KeyHash,
    pub slab_format_version: u32,
}

const MANIFEST_BYTES: usize = 24;

pub fn encode(manifest: &Manifest) -> AlignedBuf {
    let mut page = AlignedBuf::zeroed(PAGE_BYTES);
    page[0..8].copy_from_slice(&MANIFEST_MAGIC);
    page[8..12].copy_from_slice(&MANIFEST_FORMAT_VERSION.to_le_bytes());
    page[12..16].copy_from_slice(&manifest.shard_count.to_le_bytes());
    page[16..20].copy_from_slice(&(manifest.key_hash as u32).to_le_bytes());
    page[20..24].copy_from_slice(&manifest.slab_format_version.to_le_bytes());
    let crc = crc32c::crc32c(&page[0..MANIFEST_BYTES]);
    page[MANIFEST_BYTES..MANIFEST_BYTES + 4].copy_from_slice(&crc.to_le_bytes());
    page
}

/// Decodes a manifest page. `Ok(None)`: the page is blank (creation was interrupted).
pub fn decode(page: &[u8]) -> Result<Option<Manifest>, String> {
    if page.len() < MANIFEST_BYTES + 4 {
        return Err("manifest is shorter than its header".into());
    }
    if page.iter().all(|&byte| byte == 0) {
        return Ok(None);
    }
    if page[0..8] != MANIFEST_MAGIC {
        return Err("not a copse manifest (bad magic)".into());
    }
    let stored = u32::from_le_bytes(page[MANIFEST_BYTES..MANIFEST_BYTES + 4].try_into().unwrap());
    let computed = crc32c::crc32c(&page[0..MANIFEST_BYTES]);
    if stored != computed {
        return Err(format!(
            "checksum mismatch (stored {stored:#010x}, computed {computed:#010x})"
        ));
    }
    let word = |at: usize| u32::from_le_bytes(page[at..at + 4].try_into().unwrap());
    let version = word(8);
    if version != MANIFEST_FORMAT_VERSION {
        return Err(format!(
            "unsupported manifest format version {version} (this build reads version {MANIFEST_FORMAT_VERSION})"
        ));
    }
    let key_hash = match word(16) {
        1 => KeyHash::Xxh3Seed0Modulo,
        other => return Err(format!("unknown key hash {other}")),
    };
    let slab_format_version = word(20);
    if slab_format_version != crate::engine::native::format::SLAB_FORMAT_VERSION {
        return Err(format!("unsupported slab format version {slab_format_version}"));
    }
    let shard_count = word(12);
    if shard_count == 0 || shard_count as usize > crate::limits::SHARDS_MAX {
        return Err(format!("shard count {shard_count} out of range"));
    }
    Ok(Some(Manifest { shard_count, key_hash, slab_format_version }))
}

/// Reads the manifest, or creates it (durably) with `shard_count` if the store is new.
pub fn open_or_create(
    device: &mut dyn BlockDevice,
    shard_count: u32,
    create_if_missing: bool,
    describe: &str,
) -> Result<Manifest, OpenError> {
    let existing = match device.open_file(MANIFEST_FILE, false) {
        Ok(file) => {
            let bytes = device.file_len_bytes(file)?;
            if bytes >= PAGE_BYTES as u64 {
                let page = read_sync(device, file, 0, PAGE_BYTES)?;
                decode(&page).map_err(OpenError::CorruptManifest)?
            } else {
                None
            }
        }
        Err(crate::device::DeviceError::NotFound { .. }) => None,
        Err(err) => return Err(err.into()),
    };
    if let Some(manifest) = existing {
        if manifest.shard_count != shard_count {
            return Err(OpenError::ShardCountMismatch {
                path: describe.to_string(),
                found: manifest.shard_count,
                requested: shard_count,
            });
        }
        return Ok(manifest);
    }
    // Any shard directory counts, whatever the requested count: a store created with more shards
    // and a lost manifest must not be taken for a new store.
    let has_slabs = (0..crate::limits::SHARDS_MAX as u32).any(|shard| {
        device
            .list_files(&crate::engine::native::format::shard_dir(shard))
            .map(|files| !files.is_empty())
            .unwrap_or(false)
    });
    if has_slabs {
        return Err(OpenError::CorruptManifest(
            "manifest is missing or blank but slab files exist".into(),
        ));
    }
    if !create_if_missing {
        return Err(OpenError::NotFound(describe.to_string()));
    }
    let manifest = Manifest {
        shard_count,
        key_hash: KeyHash::Xxh3Seed0Modulo,
        slab_format_version: crate::engine::native::format::SLAB_FORMAT_VERSION,
    };
    let file = device.open_file(MANIFEST_FILE, true)?;
    device.grow_file(file, PAGE_BYTES as u64)?;
    device.submit(vec![IoRequest {
        token: 0,
        file,
        offset: 0,
        kind: IoKind::Write,
        buf: encode(&manifest),
    }])?;
    let mut done = Vec::new();
    device.reap(1, &mut done)?;
    for completion in done {
        completion.result?;
    }
    device.flush()?;
    Ok(manifest)
}

/// The shard count recorded in the manifest of the store in `path`; `None` if there is no
/// manifest yet (no store, or its creation was interrupted). For tools that open an existing
/// store without being told its shard count (`copse` without `--shards`).
///
/// Reads with `std::fs`, not through a device: the manifest is metadata, one small page read once
/// before the store opens, so it needs neither O_DIRECT nor the simulated device. It takes no
/// lock; `Db::open` then checks the count again under the lock.
pub fn read_shard_count(path: &std::path::Path) -> Result<Option<u32>, OpenError> {
    let manifest_path = path.join(MANIFEST_FILE);
    let bytes = match std::fs::read(&manifest_path) {
        Ok(bytes) => bytes,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(err) => {
            return Err(OpenError::Device(crate::device::DeviceError::from_io(
                &err,
                manifest_path.display().to_string(),
            )))
        }
    };
    if bytes.len() < PAGE_BYTES {
        // As in `open_or_create`: a short manifest is one whose creation did not finish.
        return Ok(None);
    }
    let manifest = decode(&bytes[..PAGE_BYTES]).map_err(OpenError::CorruptManifest)?;
    Ok(manifest.map(|manifest| manifest.shard_count))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_count_is_read_from_the_manifest_file() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read_shard_count(dir.path()).unwrap(), None);
        let manifest = Manifest {
            shard_count: 3,
            key_hash: KeyHash::Xxh3Seed0Modulo,
            slab_format_version: crate::engine::native::format::SLAB_FORMAT_VERSION,
        };
        let path = dir.path().join(MANIFEST_FILE);
        std::fs::write(&path, &encode(&manifest)[..]).unwrap();
        assert_eq!(read_shard_count(dir.path()).unwrap(), Some(3));
        std::fs::write(&path, vec![0u8; PAGE_BYTES]).unwrap();
        assert_eq!(read_shard_count(dir.path()).unwrap(), None);
        let mut damaged = encode(&manifest).to_vec();
        damaged[12] ^= 1;
        std::fs::write(&path, damaged).unwrap();
        assert!(matches!(read_shard_count(dir.path()), Err(OpenError::CorruptManifest(_))));
    }

    #[test]
    fn manifest_round_trips_and_detects_damage() {
        let manifest = Manifest {
            shard_count: 4,
            key_hash: KeyHash::Xxh3Seed0Modulo,
            slab_format_version: crate::engine::native::format::SLAB_FORMAT_VERSION,
        };
        let page = encode(&manifest);
        assert_eq!(decode(&page).unwrap(), Some(manifest));
        assert_eq!(decode(&[0u8; PAGE_BYTES]).unwrap(), None);
        for byte in 0..MANIFEST_BYTES + 4 {
            let mut damaged = page.to_vec();
            damaged[byte] ^= 0x10;
            assert!(decode(&damaged).is_err(), "damage at byte {byte} went unnoticed");
        }
    }
}
