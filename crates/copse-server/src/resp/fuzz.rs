//! The fuzz target of the request parser (the driver is `copse::fuzz::run`; the test is
//! `tests/fuzz.rs`; docs/reliability.md).
//!
//! Beyond "never panics", it checks the parser's promises (`resp/mod.rs`): a parsed request
//! parses the same from exactly its own bytes, every strict prefix of it is `Incomplete`, the
//! arguments it yields re-encode to a request that parses to the same arguments, and an error
//! stays an error whatever bytes follow (the parser reports one only once the bytes proving it
//! have arrived).

use super::parse::{parse_command, ParseLimits, Parsed, UnauthenticatedLimits};

/// Strict prefixes of a parsed request checked, at most (all of them for short requests).
const PREFIXES_CHECKED_MAX: usize = 64;

/// Input: a selector byte, then the bytes a client sent. The selector picks small limits (so
/// mutations reach every limit) or the server's.
pub fn parse_request(data: &[u8]) {
    let Some((&selector, buf)) = data.split_first() else { return };
    let limits = if selector & 1 == 0 {
        ParseLimits {
            multibulk_len_max: 8,
            bulk_bytes_max: 64,
            inline_bytes_max: 32,
            unauthenticated: None,
        }
    } else {
        ParseLimits {
            multibulk_len_max: 1024 * 1024,
            bulk_bytes_max: 512 << 20,
            inline_bytes_max: 64 << 10,
            unauthenticated: (selector & 2 != 0).then_some(UnauthenticatedLimits {
                multibulk_len_max: 10,
                bulk_bytes_max: 16 << 10,
            }),
        }
    };
    match parse_command(buf, &limits) {
        Ok(Parsed::Command { args, consumed }) => {
            assert!(consumed > 0 && consumed <= buf.len(), "consumed {consumed} of {}", buf.len());
            assert!(args.len() <= limits.multibulk_len_max);
            assert!(args.iter().all(|arg| arg.len() <= limits.bulk_bytes_max));
            if let (Some(tight), Some(b'*')) = (limits.unauthenticated, buf.first()) {
                assert!(args.len() <= tight.multibulk_len_max);
                assert!(args.iter().all(|arg| arg.len() <= tight.bulk_bytes_max));
            }
            assert_eq!(
                parse_command(&buf[..consumed], &limits),
                Ok(Parsed::Command { args: args.clone(), consumed }),
                "a request parses otherwise from its own bytes"
            );
            let step = consumed.div_ceil(PREFIXES_CHECKED_MAX).max(1);
            for end in (0..consumed).step_by(step) {
                assert_eq!(
                    parse_command(&buf[..end], &limits),
                    Ok(Parsed::Incomplete),
                    "a strict prefix of {end} bytes of a {consumed}-byte request is not incomplete"
                );
            }
            let mut encoded = Vec::new();
            super::encode_request(&args, &mut encoded);
            // Before authentication only multibulk requests have the tight bounds (an inline one
            // is bounded by its line), so an inline request's arguments may not fit them.
            let reencode_limits = ParseLimits { unauthenticated: None, ..limits };
            match parse_command(&encoded, &reencode_limits) {
                Ok(Parsed::Command { args: again, consumed }) => {
                    assert_eq!(again, args, "re-encoded arguments parse otherwise");
                    assert_eq!(consumed, encoded.len());
                }
                other => panic!("re-encoded arguments did not parse: {other:?}"),
            }
        }
        Ok(Parsed::Skip { consumed }) => {
            assert!(consumed > 0 && consumed <= buf.len(), "skipped {consumed} of {}", buf.len());
        }
        Ok(Parsed::Incomplete) => {}
        Err(err) => {
            let mut longer = buf.to_vec();
            longer.extend_from_slice(b"\r\n$1\r\nx\r\n\r\n");
            assert!(
                parse_command(&longer, &limits).is_err(),
                "{err} became valid when more bytes arrived"
            );
        }
    }
}

/// Requests as clients send them: multibulk and inline, quoted, empty, at the limits.
pub fn corpus() -> Vec<Vec<u8>> {
    let requests: [&[u8]; 12] = [
        b"*3\r\n$3\r\nSET\r\n$3\r\nkey\r\n$5\r\nvalue\r\n",
        b"*2\r\n$3\r\nGET\r\n$3\r\nkey\r\n",
        b"*1\r\n$4\r\nPING\r\n",
        b"*0\r\n",
        b"*-1\r\n",
        b"*2\r\n$4\r\nECHO\r\n$0\r\n\r\n",
        b"PING\r\n",
        b"SET \"a b\" 'c d'\r\n",
        b"GET \"\\x41\\n\"\n",
        b"\r\n",
        b"*5\r\n$4\r\nMSET\r\n$1\r\na\r\n$1\r\n1\r\n$1\r\nb\r\n$1\r\n2\r\n",
        b"*2\r\n$3\r\nGET\r\n$8\r\n12345678\r\n*1\r\n$4\r\nPING\r\n",
    ];
    let mut corpus = Vec::new();
    for request in requests {
        corpus.push([&[0u8][..], request].concat());
        corpus.push([&[1u8][..], request].concat());
    }
    corpus
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_corpus_passes_the_target() {
        for input in corpus() {
            parse_request(&input);
        }
    }
}
