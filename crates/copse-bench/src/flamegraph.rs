//! Flame graphs of a profile (`copse bench flamegraph`, `make profile`): `perf script` reads the
//! samples `perf record -g` wrote, inferno folds the stacks and draws the SVG. Nothing of the
//! profile is interpreted here; the graph is what perf recorded.

use std::io::{BufReader, Cursor};
use std::path::Path;
use std::process::Command;

use inferno::collapse::perf::{Folder, Options as FoldOptions};
use inferno::collapse::Collapse;
use inferno::flamegraph::{self, Options};

/// Draws the flame graph of `perf_data` (a `perf record -g` file) into `svg`.
pub fn flamegraph_of_perf_data(perf_data: &Path, svg: &Path, title: &str) -> Result<(), String> {
    let output = Command::new("perf")
        .arg("script")
        .arg("-i")
        .arg(perf_data)
        .output()
        .map_err(|err| format!("cannot run `perf script` (is linux-perf installed?): {err}"))?;
    if !output.status.success() {
        return Err(format!(
            "`perf script -i {}` failed: {}",
            perf_data.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    let image = flamegraph_of_perf_script(&output.stdout, title)?;
    std::fs::write(svg, image).map_err(|err| format!("cannot write {}: {err}", svg.display()))
}

/// The SVG flame graph of `perf script` output. An error if it holds no stack.
pub fn flamegraph_of_perf_script(perf_script: &[u8], title: &str) -> Result<Vec<u8>, String> {
    let mut folded = Vec::new();
    Folder::from(FoldOptions::default())
        .collapse(BufReader::new(Cursor::new(perf_script)), &mut folded)
        .map_err(|err| format!("cannot fold the stacks: {err}"))?;
    if folded.is_empty() {
        return Err("the profile holds no stack samples".into());
    }
    let mut options = Options::default();
    options.title = title.to_string();
    options.count_name = "samples".to_string();
    let mut svg = Vec::new();
    flamegraph::from_reader(&mut options, Cursor::new(folded), &mut svg)
        .map_err(|err| format!("cannot draw the flame graph: {err}"))?;
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two samples of `perf script` output, as perf prints them (innermost frame first).
    const PERF_SCRIPT: &str = "\
copse-shard-0  4242 1000.000001:   1001001 cpu-clock:
\t    55d0c0a01000 copse::engine::native::index::Index::get+0x10 (/usr/bin/copse)
\t    55d0c0a02000 copse::shard::run+0x20 (/usr/bin/copse)
\t    7f0000001000 start_thread+0x30 (/usr/lib/libc.so.6)

copse-shard-0  4242 1000.001002:   1001001 cpu-clock:
\t    55d0c0a03000 crc32c::crc32c+0x10 (/usr/bin/copse)
\t    55d0c0a02000 copse::shard::run+0x20 (/usr/bin/copse)
\t    7f0000001000 start_thread+0x30 (/usr/lib/libc.so.6)

";

    #[test]
    fn a_perf_script_becomes_a_flame_graph_naming_its_frames() {
        let svg = flamegraph_of_perf_script(PERF_SCRIPT.as_bytes(), "shard profile").unwrap();
        let svg = String::from_utf8(svg).unwrap();
        assert!(svg.starts_with("<?xml"), "{}", &svg[..80.min(svg.len())]);
        assert!(svg.contains("shard profile"));
        for frame in ["Index::get", "crc32c", "copse::shard::run", "start_thread"] {
            assert!(svg.contains(frame), "{frame} missing from the graph");
        }
    }

    #[test]
    fn a_profile_without_stacks_is_an_error() {
        let err = flamegraph_of_perf_script(b"", "empty").unwrap_err();
        assert!(err.contains("no stack"), "{err}");
    }
}
