//! Writes the seed corpora of the cargo-fuzz targets (fuzz/): one file per valid encoding that
//! the in-tree fuzzer starts from, under DIR/slab_page, DIR/manifest and DIR/resp_request.
//! Existing files are kept, so a corpus that libFuzzer grew survives a rerun.
//!
//! Usage: cargo run -p copse-server --example fuzz_corpus -- DIR

use std::path::PathBuf;

fn main() -> std::io::Result<()> {
    let Some(dir) = std::env::args_os().nth(1).map(PathBuf::from) else {
        eprintln!("usage: fuzz_corpus DIR");
        std::process::exit(2);
    };
    let corpora = [
        ("slab_page", copse::fuzz::slab_corpus()),
        ("manifest", copse::fuzz::manifest_corpus()),
        ("resp_request", copse_server::resp::fuzz::corpus()),
    ];
    for (target, inputs) in corpora {
        let target_dir = dir.join(target);
        std::fs::create_dir_all(&target_dir)?;
        for (i, input) in inputs.iter().enumerate() {
            std::fs::write(target_dir.join(format!("seed-{i:04}")), input)?;
        }
        println!("{}: {} seed inputs", target_dir.display(), inputs.len());
    }
    Ok(())
}
