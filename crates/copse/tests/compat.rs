//! Stores written by older builds. A store whose slab files are format 2 (record magic, no
//! header check) opens and reads; new records go into its old files in format 2 and into new
//! files in this build's format; the store checks clean, and the manifest says this build's
//! format from then on. (The frozen stores of earlier builds, paged classes and all, are opened
//! by `fixtures.rs`.)

use std::collections::BTreeMap;
use std::path::Path;

use copse::engine::native::format::class_of_file_name;
use copse::engine::native::format::{
    decode_slab_header, decode_slot, encode_record, encode_slab_header, Loc, RecordLayout,
    SizeClass, Slot, SLAB_FORMAT_VERSION,
};
use copse::interfaces::check::{check_store, CheckOptions};
use copse::limits::PAGE_BYTES;
use copse::store::manifest::{self, MANIFEST_FILE};
use copse::{Db, EngineKind, Options};

fn options() -> Options {
    Options { shards: 2, show_progress: false, engine: EngineKind::Native, ..Options::default() }
}

/// The slab files of a store: path relative to the store, shard, class.
fn slab_files(dir: &Path) -> Vec<(String, u32, u8)> {
    let mut files = Vec::new();
    for shard_entry in std::fs::read_dir(dir).unwrap() {
        let shard_name = shard_entry.unwrap().file_name().into_string().unwrap();
        let Some(shard) = shard_name.strip_prefix("shard-").and_then(|n| n.parse().ok()) else {
            continue;
        };
        for entry in std::fs::read_dir(dir.join(&shard_name)).unwrap() {
            let name = entry.unwrap().file_name().into_string().unwrap();
            if let Some(class) = class_of_file_name(&name) {
                files.push((format!("{shard_name}/{name}"), shard, class));
            }
        }
    }
    files.sort();
    files
}

/// The format version in a slab file's header page.
fn file_version(dir: &Path, file: &str) -> u32 {
    let image = std::fs::read(dir.join(file)).unwrap();
    decode_slab_header(&image).unwrap().format_version
}

/// Rewrites a closed store as format 2 wrote it: every slab header says version 2, every
/// record carries the magic instead of the header check, and the manifest says version 2.
fn rewrite_as_format_2(dir: &Path) {
    for (file, shard, class_id) in slab_files(dir) {
        let path = dir.join(&file);
        let mut image = std::fs::read(&path).unwrap();
        let mut header = decode_slab_header(&image).unwrap();
        assert_eq!(header.format_version, SLAB_FORMAT_VERSION);
        header.format_version = 2;
        encode_slab_header(&mut image[..PAGE_BYTES], &header);
        let class = SizeClass::get(class_id);
        let slot_bytes = class.slot_bytes as usize;
        for slot in 0..class.slots_in_file(image.len() as u64) {
            let start = class.page_of_slot(slot) as usize * PAGE_BYTES + class.offset_in_page(slot);
            let bytes = &mut image[start..start + slot_bytes];
            let loc = Loc::new(class_id, slot, 0);
            let record = match decode_slot(bytes, RecordLayout::HeaderCrc, shard, loc, slot_bytes) {
                Ok(Slot::Empty) => continue,
                Ok(Slot::Record { header, key, value }) => (header, key.to_vec(), value.to_vec()),
                Err(defect) => panic!("{file} slot {slot}: {defect}"),
            };
            let (header, key, value) = record;
            let layout = RecordLayout::Magic;
            let (kind, seq, aux) = (header.kind, header.seq, header.aux);
            encode_record(bytes, layout, shard, loc, kind, seq, aux, &key, &value);
        }
        std::fs::write(&path, image).unwrap();
    }
    let mut old = manifest::read_manifest(dir).unwrap().unwrap();
    old.slab_format_version = 2;
    std::fs::write(dir.join(MANIFEST_FILE), manifest::encode(&old).to_vec()).unwrap();
}

fn small(i: usize) -> Vec<u8> {
    format!("small-{i:04}").into_bytes()
}

#[test]
fn a_format_2_store_opens_reads_and_takes_writes_in_both_formats() {
    let dir = tempfile::tempdir().unwrap();
    let mut model: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    {
        let db = Db::open(dir.path(), options()).unwrap();
        for i in 0..200 {
            db.put(format!("k{i:03}").as_bytes(), &small(i)).unwrap();
            model.insert(format!("k{i:03}").into_bytes(), small(i));
        }
        db.put(b"big", &[9u8; 50_000]).unwrap();
        model.insert(b"big".to_vec(), vec![9u8; 50_000]);
        db.delete(b"k007").unwrap();
        model.remove(&b"k007"[..]);
        db.close().unwrap();
    }
    rewrite_as_format_2(dir.path());
    let old_files = slab_files(dir.path());
    assert!(old_files.iter().all(|(file, _, _)| file_version(dir.path(), file) == 2));

    {
        let db = Db::open(dir.path(), options()).unwrap();
        for (key, value) in &model {
            assert_eq!(db.get(key).unwrap().as_ref(), Some(value), "{key:?}");
        }
        assert_eq!(db.get(b"k007").unwrap(), None, "a deleted key came back");
        // Same sizes: into the old (format 2) files. A new size: a new file, in this build's
        // format.
        for i in 0..200 {
            let key = format!("k{i:03}").into_bytes();
            let value = small(i + 1000);
            db.put(&key, &value).unwrap();
            model.insert(key, value);
        }
        db.put(b"medium", &[5u8; 300]).unwrap();
        model.insert(b"medium".to_vec(), vec![5u8; 300]);
        db.close().unwrap();
    }
    let upgraded = manifest::read_manifest(dir.path()).unwrap().unwrap();
    assert_eq!(upgraded.slab_format_version, SLAB_FORMAT_VERSION);
    for (file, _, _) in slab_files(dir.path()) {
        let expected =
            if old_files.iter().any(|(old, _, _)| *old == file) { 2 } else { SLAB_FORMAT_VERSION };
        assert_eq!(file_version(dir.path(), &file), expected, "{file}");
    }
    assert!(slab_files(dir.path()).len() > old_files.len(), "no new class file was created");

    let report = check_store(dir.path(), &CheckOptions::default()).unwrap();
    assert!(report.is_clean(), "{:#?}", report.problems);
    assert_eq!(report.live_keys, model.len() as u64);
    let db = Db::open(dir.path(), options()).unwrap();
    for (key, value) in &model {
        assert_eq!(db.get(key).unwrap().as_ref(), Some(value), "{key:?}");
    }
    db.close().unwrap();
}

/// Freezes a format-2 fixture for `fixtures.rs`: a copy of the frozen format-3 fixture
/// `native-in-place-v0.1`, rewritten as format 2 wrote it (no build older than format 3 is at
/// hand, so the rewrite above stands in for one). Ignored, run by hand once:
/// `cargo test --release -p copse --test compat -- --ignored freeze_format_2_fixture`.
#[test]
#[ignore]
fn freeze_format_2_fixture() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("fixtures");
    let from = fixtures.join("native-in-place-v0.1");
    let to = fixtures.join("native-in-place-format2");
    assert!(!to.exists(), "{} exists: fixtures are never rewritten", to.display());
    let status = std::process::Command::new("cp").arg("-r").arg(&from).arg(&to).status().unwrap();
    assert!(status.success());
    rewrite_as_format_2(&to.join("store"));
    let settings = std::fs::read_to_string(to.join("fixture.txt")).unwrap();
    let settings = settings.replace(
        "written_by: ",
        "written_by: native-in-place-v0.1 rewritten as format 2 by compat.rs, from ",
    );
    std::fs::write(to.join("fixture.txt"), settings).unwrap();
}
