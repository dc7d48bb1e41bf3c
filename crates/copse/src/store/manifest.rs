//! The store manifest: one page at the top of the store that fixes what every later open must
//! agree with (shard count, key hash and engine). Spec: docs/format/manifest.md.
//!
//! It is written once, durably, when the store is created, before any shard writes a slab;
//! so a store whose manifest is missing or blank and which has no slab files was interrupted
//! during creation and is created again, while a blank manifest beside slab files is corruption.

use crate::device::{read_sync, AlignedBuf, BlockDevice, IoKind, IoRequest};
use crate::engine::factory::{file_format_version, native_files_exist, reads_file_format};
use crate::engine::placement::{
    Placement, PlacementDecision, PlacementSetting, PLACED_CLASS_COUNT,
};
use crate::engine::EngineKind;
use crate::error::OpenError;
use crate::limits::PAGE_BYTES;

pub const MANIFEST_FILE: &str = "MANIFEST";
pub const MANIFEST_MAGIC: [u8; 8] = *b"COPSEMAN";
pub const MANIFEST_FORMAT_VERSION: u32 = 4;

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
    /// The slab format of a native store; 0 for engines that keep their own files.
    pub slab_format_version: u32,
    pub engine: EngineKind,
    /// How the store was asked to place records when created (`None`: created by a build
    /// before manifest version 3, in place).
    pub placement_setting: Option<PlacementSetting>,
    /// The placement of each class, by id (multi-page classes are always in place).
    pub placements: [Placement; PLACED_CLASS_COUNT],
    /// The write probe's sequential-over-random throughput ratio, times 1000, when `auto` ran
    /// it at creation; 0 when no probe ran.
    pub probe_ratio_milli: u32,
}

impl Manifest {
    /// The manifest a new store of `shard_count` shards running `engine` is created with.
    pub fn new(shard_count: u32, engine: EngineKind) -> Manifest {
        Manifest {
            shard_count,
            key_hash: KeyHash::Xxh3Seed0Modulo,
            slab_format_version: file_format_version(engine),
            engine,
            placement_setting: Some(PlacementSetting::InPlace),
            placements: [Placement::InPlace; PLACED_CLASS_COUNT],
            probe_ratio_milli: 0,
        }
    }
}

/// Header bytes covered by the crc, by format version (version 1 had no engine field, version 2
/// no placement, version 3 placements for classes 0 to 12 only).
const MANIFEST_V1_BYTES: usize = 24;
const MANIFEST_V2_BYTES: usize = 28;
const MANIFEST_V3_BYTES: usize = 48;
const MANIFEST_BYTES: usize = 128;
const PLACEMENT_SETTING_AT: usize = 28;
/// Placements of classes 0 to 12 (the paged classes), one byte each.
const PLACEMENTS_AT: usize = 29;
const PAGED_PLACEMENTS: usize = 13;
const PROBE_AT: usize = 44;
/// Version 4: placements of classes 13 on, one byte each.
const MORE_PLACEMENTS_AT: usize = 48;
const _: () = assert!(MORE_PLACEMENTS_AT + PLACED_CLASS_COUNT - PAGED_PLACEMENTS <= MANIFEST_BYTES);

pub fn encode(manifest: &Manifest) -> AlignedBuf {
    let mut page = AlignedBuf::zeroed(PAGE_BYTES);
    page[0..8].copy_from_slice(&MANIFEST_MAGIC);
    page[8..12].copy_from_slice(&MANIFEST_FORMAT_VERSION.to_le_bytes());
    page[12..16].copy_from_slice(&manifest.shard_count.to_le_bytes());
    page[16..20].copy_from_slice(&(manifest.key_hash as u32).to_le_bytes());
    page[20..24].copy_from_slice(&manifest.slab_format_version.to_le_bytes());
    page[24..28].copy_from_slice(&(manifest.engine as u32).to_le_bytes());
    page[PLACEMENT_SETTING_AT] = manifest.placement_setting.map_or(0, |setting| setting as u8);
    for (class, placement) in manifest.placements.iter().enumerate() {
        let at = if class < PAGED_PLACEMENTS {
            PLACEMENTS_AT + class
        } else {
            MORE_PLACEMENTS_AT + class - PAGED_PLACEMENTS
        };
        page[at] = *placement as u8;
    }
    page[PROBE_AT..PROBE_AT + 4].copy_from_slice(&manifest.probe_ratio_milli.to_le_bytes());
    let crc = crc32c::crc32c(&page[0..MANIFEST_BYTES]);
    page[MANIFEST_BYTES..MANIFEST_BYTES + 4].copy_from_slice(&crc.to_le_bytes());
    page
}

/// Decodes a manifest page (format version 1 to 4). `Ok(None)`: the page is blank (creation was
/// interrupted).
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
    let word = |at: usize| u32::from_le_bytes(page[at..at + 4].try_into().unwrap());
    let version = word(8);
    let header_bytes = match version {
        1 => MANIFEST_V1_BYTES,
        2 => MANIFEST_V2_BYTES,
        3 => MANIFEST_V3_BYTES,
        MANIFEST_FORMAT_VERSION => MANIFEST_BYTES,
        // A newer format (its header verifies where this version's would) or a damaged version
        // field (nothing verifies): say which.
        _ if word(MANIFEST_BYTES) == crc32c::crc32c(&page[0..MANIFEST_BYTES]) => {
            return Err(format!(
                "unsupported manifest format version {version} (this build reads versions 1 to {MANIFEST_FORMAT_VERSION})"
            ))
        }
        _ => return Err(format!("checksum mismatch (format version field reads {version})")),
    };
    let stored = word(header_bytes);
    let computed = crc32c::crc32c(&page[0..header_bytes]);
    if stored != computed {
        return Err(format!(
            "checksum mismatch (stored {stored:#010x}, computed {computed:#010x})"
        ));
    }
    let key_hash = match word(16) {
        1 => KeyHash::Xxh3Seed0Modulo,
        other => return Err(format!("unknown key hash {other}")),
    };
    let engine = if version == 1 {
        EngineKind::Native
    } else {
        EngineKind::from_persisted(word(24))
            .ok_or_else(|| format!("unknown engine {}", word(24)))?
    };
    let slab_format_version = word(20);
    if !reads_file_format(engine, slab_format_version) {
        return Err(format!(
            "unsupported slab format version {slab_format_version} for the {engine} engine"
        ));
    }
    let shard_count = word(12);
    if shard_count == 0 || shard_count as usize > crate::limits::SHARDS_MAX {
        return Err(format!("shard count {shard_count} out of range"));
    }
    let mut manifest = Manifest::new(shard_count, engine);
    manifest.key_hash = key_hash;
    manifest.slab_format_version = slab_format_version;
    if version < 3 {
        manifest.placement_setting = None;
        return Ok(Some(manifest));
    }
    let placed_end = MORE_PLACEMENTS_AT + PLACED_CLASS_COUNT - PAGED_PLACEMENTS;
    if page[PLACEMENTS_AT + PAGED_PLACEMENTS..PROBE_AT].iter().any(|&byte| byte != 0)
        || (version >= 4 && page[placed_end..MANIFEST_BYTES].iter().any(|&byte| byte != 0))
    {
        return Err("reserved manifest bytes are not zero".into());
    }
    manifest.placement_setting = match page[PLACEMENT_SETTING_AT] {
        0 => None,
        value => Some(
            PlacementSetting::from_persisted(value)
                .ok_or_else(|| format!("unknown placement setting {value}"))?,
        ),
    };
    let recorded = if version >= 4 { PLACED_CLASS_COUNT } else { PAGED_PLACEMENTS };
    for class in 0..recorded {
        let at = if class < PAGED_PLACEMENTS {
            PLACEMENTS_AT + class
        } else {
            MORE_PLACEMENTS_AT + class - PAGED_PLACEMENTS
        };
        let value = page[at];
        manifest.placements[class] = Placement::from_persisted(value)
            .ok_or_else(|| format!("unknown placement {value} for class {class}"))?;
    }
    if version < 4 {
        // Created before the packed classes: they take the placements of the paged ones.
        crate::engine::factory::place_newer_classes(&mut manifest.placements);
    }
    if !crate::engine::factory::placements_are_valid(&manifest.placements) {
        return Err("a class that is always in place is recorded as appended".into());
    }
    if engine == EngineKind::RocksDb && manifest.placements.contains(&Placement::Append) {
        return Err("a rocksdb store cannot have append placement".into());
    }
    manifest.probe_ratio_milli = word(PROBE_AT);
    Ok(Some(manifest))
}

/// Reads the manifest, or creates it (durably) with `shard_count` if the store is new.
///
/// `engine_files_exist`: the caller found files of an engine that keeps its own (RocksDB
/// instances under `rocksdb/`, which a device does not list), so a missing manifest is a lost
/// one, as with slab files.
pub fn open_or_create(
    device: &mut dyn BlockDevice,
    shard_count: u32,
    engine: EngineKind,
    create_if_missing: bool,
    describe: &str,
    engine_files_exist: bool,
    decide_placement: &mut dyn FnMut() -> Result<PlacementDecision, OpenError>,
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
        if manifest.engine != engine {
            return Err(OpenError::EngineMismatch {
                path: describe.to_string(),
                found: manifest.engine,
                requested: engine,
            });
        }
        if manifest.slab_format_version < Manifest::new(shard_count, engine).slab_format_version {
            // The slabs of an older native store are read as they are, but this build may write
            // record kinds the older format lacks: mark the store so an older build refuses it
            // rather than reading those records as damage.
            let upgraded = Manifest {
                slab_format_version: Manifest::new(shard_count, engine).slab_format_version,
                ..manifest
            };
            write_manifest(device, &upgraded)?;
            tracing::info!(
                from = manifest.slab_format_version,
                to = upgraded.slab_format_version,
                "store upgraded to the current slab format"
            );
            return Ok(upgraded);
        }
        return Ok(manifest);
    }
    // Any shard directory counts, whatever the requested count: a store created with more shards
    // and a lost manifest must not be taken for a new store.
    if native_files_exist(device) {
        return Err(OpenError::CorruptManifest(
            "manifest is missing or blank but slab files exist".into(),
        ));
    }
    if engine_files_exist {
        return Err(OpenError::CorruptManifest(format!(
            "manifest is missing or blank but {}/ holds RocksDB instances",
            crate::engine::ROCKSDB_DIR
        )));
    }
    if !create_if_missing {
        return Err(OpenError::NotFound(describe.to_string()));
    }
    let mut manifest = Manifest::new(shard_count, engine);
    if engine == EngineKind::Native {
        let decision = decide_placement()?;
        manifest.placement_setting = Some(decision.setting);
        manifest.placements = decision.placements;
        manifest.probe_ratio_milli = decision.probe_ratio_milli;
    }
    write_manifest(device, &manifest)?;
    Ok(manifest)
}

/// Writes the manifest page in place and makes it durable. Every field lies in the page's first
/// 512 bytes, so a write torn at sector boundaries leaves the old page or the new one.
fn write_manifest(device: &mut dyn BlockDevice, manifest: &Manifest) -> Result<(), OpenError> {
    const _: () = assert!(MANIFEST_BYTES + 4 <= 512);
    let file = device.open_file(MANIFEST_FILE, true)?;
    if device.file_len_bytes(file)? < PAGE_BYTES as u64 {
        device.grow_file(file, PAGE_BYTES as u64)?;
    }
    device.submit(vec![IoRequest {
        token: 0,
        file,
        offset: 0,
        kind: IoKind::Write,
        buf: encode(manifest),
    }])?;
    let mut done = Vec::new();
    device.reap(1, &mut done)?;
    for completion in done {
        completion.result?;
    }
    device.flush()?;
    Ok(())
}

/// The shard count recorded in the manifest of the store in `path`; `None` if there is no
/// manifest yet (no store, or its creation was interrupted). For tools that open an existing
/// store without being told its shard count (`copse` without `--shards`).
///
/// Reads with `std::fs`, not through a device: the manifest is metadata, one small page read once
/// before the store opens, so it needs neither O_DIRECT nor the simulated device. It takes no
/// lock; `Db::open` then checks the count again under the lock.
pub fn read_manifest(path: &std::path::Path) -> Result<Option<Manifest>, OpenError> {
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
    decode(&bytes[..PAGE_BYTES]).map_err(OpenError::CorruptManifest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::native::format::SLAB_FORMAT_VERSION;

    #[test]
    fn manifest_is_read_from_its_file() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read_manifest(dir.path()).unwrap(), None);
        let manifest = Manifest::new(3, EngineKind::RocksDb);
        let path = dir.path().join(MANIFEST_FILE);
        std::fs::write(&path, &encode(&manifest)[..]).unwrap();
        assert_eq!(read_manifest(dir.path()).unwrap(), Some(manifest));
        std::fs::write(&path, vec![0u8; PAGE_BYTES]).unwrap();
        assert_eq!(read_manifest(dir.path()).unwrap(), None);
        let mut damaged = encode(&manifest).to_vec();
        damaged[12] ^= 1;
        std::fs::write(&path, damaged).unwrap();
        assert!(matches!(read_manifest(dir.path()), Err(OpenError::CorruptManifest(_))));
    }

    /// A version-1 manifest (written before the engine field existed) still opens, as native.
    #[test]
    fn version_1_manifest_reads_as_a_native_store() {
        let mut page = vec![0u8; PAGE_BYTES];
        page[0..8].copy_from_slice(&MANIFEST_MAGIC);
        page[8..12].copy_from_slice(&1u32.to_le_bytes());
        page[12..16].copy_from_slice(&4u32.to_le_bytes());
        page[16..20].copy_from_slice(&1u32.to_le_bytes());
        page[20..24].copy_from_slice(&1u32.to_le_bytes());
        let crc = crc32c::crc32c(&page[0..24]);
        page[24..28].copy_from_slice(&crc.to_le_bytes());
        // The bytes of docs/format/manifest.md's version-1 example.
        assert_eq!(&page[24..28], &[0xbb, 0x69, 0x21, 0x0e]);
        let expected = Manifest {
            slab_format_version: 1,
            placement_setting: None,
            ..Manifest::new(4, EngineKind::Native)
        };
        assert_eq!(decode(&page).unwrap(), Some(expected));
    }

    /// A version-3 manifest (docs/format/manifest.md's former worked example: `auto` appending
    /// the paged classes 0 to 11) reads with the packed classes placed as their paged
    /// counterparts: packed slots up to 2,048 bytes append (their counterparts are among classes
    /// 0 to 11), larger ones stay in place (class 12), and the multi-page classes are in place.
    #[test]
    fn a_version_3_manifest_places_the_packed_classes_as_their_paged_counterparts() {
        let mut page = vec![0u8; PAGE_BYTES];
        page[0..8].copy_from_slice(&MANIFEST_MAGIC);
        for (at, word) in [(8, 3u32), (12, 4), (16, 1), (20, 3), (24, 1), (44, 5123)] {
            page[at..at + 4].copy_from_slice(&word.to_le_bytes());
        }
        page[PLACEMENT_SETTING_AT] = PlacementSetting::Auto as u8;
        for class in 0..13 {
            page[PLACEMENTS_AT + class] = if class < 12 { 2 } else { 1 };
        }
        let crc = crc32c::crc32c(&page[0..48]);
        page[48..52].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(&page[48..52], &[0xe6, 0x12, 0x7e, 0xa0], "the former worked example");
        let manifest = decode(&page).unwrap().unwrap();
        let placements = manifest.placements;
        let append = |class: usize| placements[class] == Placement::Append;
        assert!((0..12).all(append) && !append(12));
        assert!((13..36).all(|class| !append(class)), "multi-page classes are in place");
        // Packed slots of up to 2,048 bytes (classes 36 to 71) fit class 11's slots; larger
        // ones (2,336 to 4,096 bytes) only class 12's whole page.
        assert!((36..=71).all(append));
        assert!((72..=75).all(|class| !append(class)));
    }

    /// A store of slab format 1 opens, keeps its items, and is marked as slab format 2 (so an
    /// older build, which would read Part records as damage, refuses it from then on).
    #[test]
    fn a_slab_version_1_store_is_upgraded_at_open() {
        use crate::{Db, Options};
        let dir = tempfile::tempdir().unwrap();
        let options = || Options { shards: 2, show_progress: false, ..Options::default() };
        let db = Db::open(dir.path(), options()).unwrap();
        db.put(b"kept", b"value").unwrap();
        db.close().unwrap();
        let old = Manifest { slab_format_version: 1, ..Manifest::new(2, EngineKind::Native) };
        std::fs::write(dir.path().join(MANIFEST_FILE), encode(&old).to_vec()).unwrap();
        assert_eq!(read_manifest(dir.path()).unwrap(), Some(old));
        let db = Db::open(dir.path(), options()).unwrap();
        assert_eq!(db.get(b"kept").unwrap(), Some(b"value".to_vec()));
        db.close().unwrap();
        let upgraded = read_manifest(dir.path()).unwrap().unwrap();
        assert_eq!(upgraded.slab_format_version, SLAB_FORMAT_VERSION);
        assert_eq!(upgraded, Manifest::new(2, EngineKind::Native));
        // A slab version this build does not know is refused.
        let newer = Manifest { slab_format_version: SLAB_FORMAT_VERSION + 1, ..old };
        assert!(decode(&encode(&newer)).unwrap_err().contains("unsupported slab format version"));
    }

    const MANIFEST_EXAMPLE_20_52: [u8; 32] = [
        5, 0, 0, 0, 1, 0, 0, 0, 3, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1, 0, 0, 0x03, 0x14, 0, 0,
        1, 1, 1, 1,
    ];
    const MANIFEST_EXAMPLE_124_132: [u8; 8] = [0, 0, 0, 0, 0x68, 0xa0, 0x8b, 0x28];

    #[test]
    fn manifest_round_trips_and_detects_damage() {
        let manifest = Manifest::new(4, EngineKind::Native);
        let page = encode(&manifest);
        assert_eq!(decode(&page).unwrap(), Some(manifest));
        // The worked example of docs/format/manifest.md: auto placement that appends the
        // packed classes 36 to 74 (slots up to 3,264 bytes) after a probe measured sequential
        // writes 5.123 times faster than random ones; the paged classes, which a new store
        // does not use, are appended up to class 11 as the same probe would have them.
        let mut auto = manifest;
        auto.placement_setting = Some(PlacementSetting::Auto);
        auto.placements[..12].fill(Placement::Append);
        auto.placements[36..75].fill(Placement::Append);
        auto.probe_ratio_milli = 5123;
        let example = encode(&auto);
        assert_eq!(decode(&example).unwrap(), Some(auto));
        assert_eq!(&example[20..52], &MANIFEST_EXAMPLE_20_52);
        assert_eq!(&example[124..132], &MANIFEST_EXAMPLE_124_132);
        let rocks = Manifest::new(4, EngineKind::RocksDb);
        assert_eq!(decode(&encode(&rocks)).unwrap(), Some(rocks));
        assert_eq!(decode(&[0u8; PAGE_BYTES]).unwrap(), None);
        // A flipped version bit reads as damage, not as a store from a newer build.
        let mut version_flipped = page.to_vec();
        version_flipped[8] ^= 0x04;
        assert!(decode(&version_flipped).unwrap_err().contains("checksum mismatch"));
        for byte in 0..MANIFEST_BYTES + 4 {
            let mut damaged = page.to_vec();
            damaged[byte] ^= 0x10;
            assert!(decode(&damaged).is_err(), "damage at byte {byte} went unnoticed");
        }
    }
}
