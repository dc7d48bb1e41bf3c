//! Fuzzing the request parser (copse_server::resp::fuzz) for `COPSE_FUZZ_SECONDS` (default 5;
//! `make test` runs 60) or `COPSE_FUZZ_INPUTS` inputs; a failure prints the seed that replays it.

use copse::fuzz::{self, Budget};
use copse_server::resp::fuzz::{corpus, parse_request};

#[test]
fn fuzz_resp_request_parser() {
    let report = fuzz::run("resp-request", &corpus(), parse_request, Budget::from_env(5));
    eprintln!(
        "fuzz {}: {} inputs in {:.1} s ({:.0}/s)",
        report.target,
        report.inputs,
        report.seconds,
        report.inputs as f64 / report.seconds.max(1e-9)
    );
    if let Some(failure) = report.failure {
        panic!("{failure}");
    }
    assert!(report.inputs > 0, "the fuzz budget ran no input");
}
