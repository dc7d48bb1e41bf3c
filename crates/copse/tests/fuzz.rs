//! Fuzzing the decoders of bytes read from disk (copse::fuzz): the slab page decoder (with
//! recovery's judgement of the page) and the manifest decoder. Each target runs for
//! `COPSE_FUZZ_SECONDS` (default 5; `make test` runs 60) or `COPSE_FUZZ_INPUTS` inputs; a failure
//! prints the seed that replays it.

use copse::fuzz::{self, Budget};

const DEFAULT_SECONDS: u64 = 5;

#[test]
fn fuzz_slab_page_decoder() {
    let budget = Budget::from_env(DEFAULT_SECONDS);
    fuzz::run("slab-page", &fuzz::slab_corpus(), fuzz::slab_page, budget).assert_clean();
}

#[test]
fn fuzz_manifest_decoder() {
    let budget = Budget::from_env(DEFAULT_SECONDS);
    fuzz::run("manifest", &fuzz::manifest_corpus(), fuzz::manifest_page, budget).assert_clean();
}
