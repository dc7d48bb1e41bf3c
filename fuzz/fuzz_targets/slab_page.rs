//! The slab page decoder and recovery's judgement of a page (copse::fuzz::slab_page).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| copse::fuzz::slab_page(data));
