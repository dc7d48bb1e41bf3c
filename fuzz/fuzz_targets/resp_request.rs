//! The RESP request parser (copse_server::resp::fuzz::parse_request).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| copse_server::resp::fuzz::parse_request(data));
