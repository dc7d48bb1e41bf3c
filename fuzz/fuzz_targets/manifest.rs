//! The manifest decoder (copse::fuzz::manifest_page).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| copse::fuzz::manifest_page(data));
