//! Fuzzing the request parser (copse_server::resp::fuzz) for `COPSE_FUZZ_SECONDS` (default 5;
//! `make test` runs 60) or `COPSE_FUZZ_INPUTS` inputs; a failure prints the seed that replays it.

use copse::fuzz::{self, Budget};
use copse_server::resp::fuzz::{corpus, parse_request};

#[test]
fn fuzz_resp_request_parser() {
    fuzz::run("resp-request", &corpus(), parse_request, Budget::from_env(5)).assert_clean();
}
