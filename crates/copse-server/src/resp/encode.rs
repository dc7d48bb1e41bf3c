//! Encoding replies in RESP2 or RESP3, the version a connection chose with `HELLO`.
//!
//! One `Reply` value encodes in either protocol, so command code builds a reply once and never
//! asks which protocol the client speaks; RESP3-only types fall back to what Redis sends a RESP2
//! client (a map as a flat array, a double as a bulk string, a boolean as an integer).
//!
//! Invariants:
//! - Appends only: `encode_reply` never touches bytes already in `out`, so a connection can
//!   encode many replies into one buffer and write them with one system call.
//! - Framing cannot be broken by content: simple strings and errors are one line each, so any CR
//!   or LF inside their text is replaced by a space; binary data goes in length-prefixed bulks.
//! - No allocation of its own: numbers are formatted on the stack, directly into `out`.

use std::fmt;

/// The protocol version of a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    Resp2,
    Resp3,
}

/// A reply to a command, independent of the protocol it is sent in.
#[derive(Clone, Debug, PartialEq)]
pub enum Reply {
    /// `+OK`: a short status line, almost always a fixed word (OK, PONG), held without an
    /// allocation.
    Simple(std::borrow::Cow<'static, str>),
    /// The full error text including its code, e.g. "ERR unknown command" or "WRONGTYPE ...".
    Error(String),
    Integer(i64),
    Bulk(Vec<u8>),
    /// A missing string (RESP2 `$-1`).
    Null,
    /// A missing array (RESP2 `*-1`), e.g. a timed-out blocking pop.
    NullArray,
    Array(Vec<Reply>),
    /// Key-value pairs; a flat array of 2n elements in RESP2.
    Map(Vec<(Reply, Reply)>),
    /// Unordered unique elements; an array in RESP2.
    Set(Vec<Reply>),
    /// Formatted by `format_double`; a bulk string in RESP2.
    Double(f64),
    /// Text with a three-letter format such as `txt` or `mkd`; a plain bulk in RESP2.
    Verbatim {
        format: [u8; 3],
        text: Vec<u8>,
    },
    /// Out-of-band data (pub/sub messages and subscription confirmations): RESP3's push type,
    /// an array in RESP2.
    Push(Vec<Reply>),
    /// Several replies one command answers with, one after another (SUBSCRIBE of several
    /// channels confirms each).
    Frames(Vec<Reply>),
    /// Bytes already encoded in the connection's protocol (pub/sub messages a subscriber's
    /// mailbox held), written as they are.
    Encoded(Vec<u8>),
}

impl Reply {
    /// `+OK`.
    pub fn ok() -> Reply {
        Reply::Simple("OK".into())
    }

    /// An error reply; `text` includes its code, e.g. `Reply::error("ERR syntax error")`.
    pub fn error(text: impl Into<String>) -> Reply {
        Reply::Error(text.into())
    }
}

/// Appends `args` as one multibulk request, as a client sends it (the parser's input): for the
/// tools and tests that play the client.
#[cfg(any(test, feature = "testing"))]
pub fn encode_request<A: AsRef<[u8]>>(args: &[A], out: &mut Vec<u8>) {
    push_length_line(out, b'*', args.len());
    for arg in args {
        push_bulk(out, arg.as_ref());
    }
}

/// Appends the encoding of `reply` to `out`.
pub fn encode_reply(reply: &Reply, protocol: Protocol, out: &mut Vec<u8>) {
    match reply {
        Reply::Simple(text) => push_text_line(out, b'+', text),
        Reply::Error(text) => push_text_line(out, b'-', text),
        Reply::Integer(value) => push_integer_line(out, b':', *value),
        Reply::Bulk(bytes) => push_bulk(out, bytes),
        Reply::Null => out.extend_from_slice(match protocol {
            Protocol::Resp2 => b"$-1\r\n",
            Protocol::Resp3 => b"_\r\n",
        }),
        Reply::NullArray => out.extend_from_slice(match protocol {
            Protocol::Resp2 => b"*-1\r\n",
            Protocol::Resp3 => b"_\r\n",
        }),
        Reply::Array(items) => {
            push_length_line(out, b'*', items.len());
            for item in items {
                encode_reply(item, protocol, out);
            }
        }
        Reply::Map(pairs) => {
            match protocol {
                // Cannot overflow: a Vec of pairs holds far fewer than usize::MAX / 2 of them.
                Protocol::Resp2 => push_length_line(out, b'*', 2 * pairs.len()),
                Protocol::Resp3 => push_length_line(out, b'%', pairs.len()),
            }
            for (key, value) in pairs {
                encode_reply(key, protocol, out);
                encode_reply(value, protocol, out);
            }
        }
        Reply::Set(items) => {
            let type_byte = match protocol {
                Protocol::Resp2 => b'*',
                Protocol::Resp3 => b'~',
            };
            push_length_line(out, type_byte, items.len());
            for item in items {
                encode_reply(item, protocol, out);
            }
        }
        Reply::Double(value) => {
            let text = DoubleText::new(*value);
            match protocol {
                Protocol::Resp2 => push_bulk(out, text.as_bytes()),
                Protocol::Resp3 => {
                    out.push(b',');
                    out.extend_from_slice(text.as_bytes());
                    out.extend_from_slice(b"\r\n");
                }
            }
        }
        Reply::Push(items) => {
            let type_byte = match protocol {
                Protocol::Resp2 => b'*',
                Protocol::Resp3 => b'>',
            };
            push_length_line(out, type_byte, items.len());
            for item in items {
                encode_reply(item, protocol, out);
            }
        }
        Reply::Frames(replies) => {
            for reply in replies {
                encode_reply(reply, protocol, out);
            }
        }
        Reply::Encoded(bytes) => out.extend_from_slice(bytes),
        Reply::Verbatim { format, text } => match protocol {
            Protocol::Resp2 => push_bulk(out, text),
            Protocol::Resp3 => {
                // The length covers the format and its colon: "txt:" is 4 bytes.
                push_length_line(out, b'=', text.len() + 4);
                out.extend_from_slice(format);
                out.push(b':');
                out.extend_from_slice(text);
                out.extend_from_slice(b"\r\n");
            }
        },
    }
}

/// Redis's text of a double (`d2string` in Redis 7.2+, as ZSCORE and RESP3 doubles print it):
/// - "nan", "inf", "-inf", and "0" / "-0";
/// - an integral value of magnitude at most 2^62 as an integer: "10", "-3", "1000000000000000000";
/// - otherwise the shortest digits that round-trip, laid out by Redis's `fpconv_dtoa`: plainly
///   when that needs at most 7 trailing zeros ("123456789012345680000") or, for a fraction, fewer
///   than 7 decimals or a decimal exponent above -4 ("0.1", "1.5", "0.000001"); otherwise in
///   exponent form with an explicit sign and no padding ("1e+20", "1.5e-7", "1.234e-4").
///
/// Redis computes the digits with Grisu2, which in rare cases gives a longer (still
/// round-tripping) digit string than the shortest one produced here.
pub fn format_double(value: f64) -> String {
    DoubleText::new(value).as_bytes().iter().map(|&byte| char::from(byte)).collect()
}

/// Appends `<type byte><text>\r\n`, with any CR or LF in `text` replaced by a space: they would
/// end the line early and desynchronise the client's parser.
fn push_text_line(out: &mut Vec<u8>, type_byte: u8, text: &str) {
    let is_line_break = |byte: u8| byte == b'\r' || byte == b'\n';
    out.push(type_byte);
    let bytes = text.as_bytes();
    if bytes.iter().any(|&byte| is_line_break(byte)) {
        out.extend(bytes.iter().map(|&byte| if is_line_break(byte) { b' ' } else { byte }));
    } else {
        out.extend_from_slice(bytes);
    }
    out.extend_from_slice(b"\r\n");
}

fn push_bulk(out: &mut Vec<u8>, bytes: &[u8]) {
    push_length_line(out, b'$', bytes.len());
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
}

fn push_length_line(out: &mut Vec<u8>, type_byte: u8, length: usize) {
    let mut scratch = [0; DECIMAL_DIGITS_MAX];
    out.push(type_byte);
    // usize is at most 64 bits on every platform Rust supports, so this is lossless.
    out.extend_from_slice(decimal_digits(length as u64, &mut scratch));
    out.extend_from_slice(b"\r\n");
}

fn push_integer_line(out: &mut Vec<u8>, type_byte: u8, value: i64) {
    let mut scratch = [0; DECIMAL_DIGITS_MAX];
    out.push(type_byte);
    if value < 0 {
        out.push(b'-');
    }
    out.extend_from_slice(decimal_digits(value.unsigned_abs(), &mut scratch));
    out.extend_from_slice(b"\r\n");
}

/// Digits of `u64::MAX`.
const DECIMAL_DIGITS_MAX: usize = 20;

/// Writes `value` in decimal at the end of `scratch` and returns the digits.
fn decimal_digits(mut value: u64, scratch: &mut [u8; DECIMAL_DIGITS_MAX]) -> &[u8] {
    let mut start = scratch.len();
    loop {
        start -= 1;
        // The remainder is below 10, so the cast cannot truncate.
        scratch[start] = b'0' + (value % 10) as u8;
        value /= 10;
        if value == 0 {
            return &scratch[start..];
        }
    }
}

/// The largest magnitude Redis prints through its integer path (`double2ll`: LLONG_MAX / 2,
/// which rounds to 2^62 as a double).
const INTEGRAL_MAGNITUDE_MAX: f64 = 4_611_686_018_427_387_904.0;

/// Longest text of a double: a sign, 17 significant digits and 7 trailing zeros is 25 bytes;
/// "-0.000" and 17 digits is 23; exponent forms are at most 24.
const DOUBLE_TEXT_BYTES_MAX: usize = 32;

/// A double's text on the stack, so that encoding a double allocates nothing.
struct DoubleText {
    bytes: [u8; DOUBLE_TEXT_BYTES_MAX],
    length_bytes: usize,
}

impl DoubleText {
    fn empty() -> DoubleText {
        DoubleText { bytes: [0; DOUBLE_TEXT_BYTES_MAX], length_bytes: 0 }
    }

    fn new(value: f64) -> DoubleText {
        let mut text = DoubleText::empty();
        if value.is_nan() {
            text.extend(b"nan");
        } else if value.is_infinite() {
            text.extend(if value < 0.0 { &b"-inf"[..] } else { &b"inf"[..] });
        } else if value == 0.0 {
            text.extend(if value.is_sign_negative() { &b"-0"[..] } else { &b"0"[..] });
        } else if value.abs() <= INTEGRAL_MAGNITUDE_MAX && value.fract() == 0.0 {
            // Exact: the value is integral and well within i64.
            let integral = value as i64;
            let mut scratch = [0; DECIMAL_DIGITS_MAX];
            if integral < 0 {
                text.push(b'-');
            }
            text.extend(decimal_digits(integral.unsigned_abs(), &mut scratch));
        } else {
            if value.is_sign_negative() {
                text.push(b'-');
            }
            text.push_fpconv_layout(value.abs());
        }
        text
    }

    /// Lays out the shortest round-trip digits of a finite, non-zero `magnitude` the way
    /// Redis's `fpconv_dtoa` (`emit_digits`) does.
    fn push_fpconv_layout(&mut self, magnitude: f64) {
        // Rust's `{:e}` gives the shortest digits that round-trip, as "d.ddde-x" / "de+x" → "dex".
        let mut scientific = DoubleText::empty();
        // Cannot fail: `DoubleText`'s `write_str` never fails.
        let _ = fmt::Write::write_fmt(&mut scientific, format_args!("{magnitude:e}"));
        let scientific = scientific.as_bytes();
        let (mantissa, exponent_text) = match scientific.iter().position(|&byte| byte == b'e') {
            Some(e_offset) => (&scientific[..e_offset], &scientific[e_offset + 1..]),
            None => (scientific, &b"0"[..]),
        };
        let mut digits = DoubleText::empty();
        for &byte in mantissa.iter().filter(|byte| byte.is_ascii_digit()) {
            digits.push(byte);
        }
        let digits = digits.as_bytes();
        let exponent = parse_small_exponent(exponent_text);

        // At most 17 digits and |exponent| <= 324, so i32 arithmetic cannot overflow.
        let digit_count = digits.len() as i32;
        // The value is `digits` × 10^scale (fpconv's K).
        let scale = exponent - (digit_count - 1);
        let exponent_magnitude = exponent.abs();

        if scale >= 0 && exponent_magnitude < digit_count + 7 {
            self.extend(digits);
            for _ in 0..scale {
                self.push(b'0');
            }
        } else if scale < 0 && (scale > -7 || exponent_magnitude < 4) {
            let integer_digit_count = digit_count + scale;
            if integer_digit_count <= 0 {
                self.extend(b"0.");
                for _ in 0..-integer_digit_count {
                    self.push(b'0');
                }
                self.extend(digits);
            } else {
                // 0 < integer_digit_count < digit_count, so the split is in range.
                let (integer_part, fraction_part) = digits.split_at(integer_digit_count as usize);
                self.extend(integer_part);
                self.push(b'.');
                self.extend(fraction_part);
            }
        } else {
            if let Some((first, rest)) = digits.split_first() {
                self.push(*first);
                if !rest.is_empty() {
                    self.push(b'.');
                    self.extend(rest);
                }
            }
            self.push(b'e');
            self.push(if exponent < 0 { b'-' } else { b'+' });
            let mut scratch = [0; DECIMAL_DIGITS_MAX];
            self.extend(decimal_digits(u64::from(exponent_magnitude.unsigned_abs()), &mut scratch));
        }
    }

    fn push(&mut self, byte: u8) {
        debug_assert!(self.length_bytes < DOUBLE_TEXT_BYTES_MAX, "DOUBLE_TEXT_BYTES_MAX too small");
        // Truncate rather than panic should the bound above ever be wrong in a release build.
        if let Some(slot) = self.bytes.get_mut(self.length_bytes) {
            *slot = byte;
            self.length_bytes += 1;
        }
    }

    fn extend(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.push(byte);
        }
    }

    fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.length_bytes]
    }
}

impl fmt::Write for DoubleText {
    fn write_str(&mut self, text: &str) -> fmt::Result {
        self.extend(text.as_bytes());
        Ok(())
    }
}

/// Parses the exponent of Rust's `{:e}` output: an optional `-` and at most three digits.
fn parse_small_exponent(text: &[u8]) -> i32 {
    let (negative, digits) = match text {
        [b'-', digits @ ..] => (true, digits),
        _ => (false, text),
    };
    let magnitude = digits
        .iter()
        .filter(|byte| byte.is_ascii_digit())
        .fold(0i32, |value, &byte| value.saturating_mul(10).saturating_add(i32::from(byte - b'0')));
    if negative {
        -magnitude
    } else {
        magnitude
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn encoded(reply: &Reply, protocol: Protocol) -> Vec<u8> {
        let mut out = Vec::new();
        encode_reply(reply, protocol, &mut out);
        out
    }

    /// Checks one reply's bytes in RESP2 and in RESP3.
    fn assert_encodes(reply: Reply, resp2: &[u8], resp3: &[u8]) {
        assert_eq!(
            encoded(&reply, Protocol::Resp2),
            resp2,
            "RESP2 of {reply:?}: {:?}",
            String::from_utf8_lossy(&encoded(&reply, Protocol::Resp2))
        );
        assert_eq!(
            encoded(&reply, Protocol::Resp3),
            resp3,
            "RESP3 of {reply:?}: {:?}",
            String::from_utf8_lossy(&encoded(&reply, Protocol::Resp3))
        );
    }

    #[test]
    fn simple_strings_and_helpers() {
        assert_encodes(Reply::ok(), b"+OK\r\n", b"+OK\r\n");
        assert_encodes(Reply::Simple("PONG".into()), b"+PONG\r\n", b"+PONG\r\n");
        assert_encodes(Reply::Simple("a\r\nb".into()), b"+a  b\r\n", b"+a  b\r\n");
    }

    #[test]
    fn errors_keep_their_code_and_lose_line_breaks() {
        assert_eq!(Reply::error("ERR syntax error"), Reply::Error("ERR syntax error".into()));
        assert_encodes(
            Reply::error("WRONGTYPE Operation against a key holding the wrong kind of value"),
            b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n",
            b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n",
        );
        assert_encodes(
            Reply::error("ERR unknown command 'a\r\nb'"),
            b"-ERR unknown command 'a  b'\r\n",
            b"-ERR unknown command 'a  b'\r\n",
        );
    }

    #[test]
    fn integers() {
        assert_encodes(Reply::Integer(0), b":0\r\n", b":0\r\n");
        assert_encodes(Reply::Integer(-42), b":-42\r\n", b":-42\r\n");
        assert_encodes(
            Reply::Integer(i64::MAX),
            b":9223372036854775807\r\n",
            b":9223372036854775807\r\n",
        );
        assert_encodes(
            Reply::Integer(i64::MIN),
            b":-9223372036854775808\r\n",
            b":-9223372036854775808\r\n",
        );
    }

    #[test]
    fn bulks_are_binary_safe() {
        assert_encodes(Reply::Bulk(b"bar".to_vec()), b"$3\r\nbar\r\n", b"$3\r\nbar\r\n");
        assert_encodes(Reply::Bulk(Vec::new()), b"$0\r\n\r\n", b"$0\r\n\r\n");
        assert_encodes(Reply::Bulk(b"\r\n\0".to_vec()), b"$3\r\n\r\n\0\r\n", b"$3\r\n\r\n\0\r\n");
    }

    #[test]
    fn nulls_differ_by_protocol() {
        assert_encodes(Reply::Null, b"$-1\r\n", b"_\r\n");
        assert_encodes(Reply::NullArray, b"*-1\r\n", b"_\r\n");
    }

    #[test]
    fn arrays_nest() {
        assert_encodes(Reply::Array(Vec::new()), b"*0\r\n", b"*0\r\n");
        assert_encodes(
            Reply::Array(vec![
                Reply::Integer(1),
                Reply::Array(vec![Reply::Bulk(b"a".to_vec()), Reply::Null]),
            ]),
            b"*2\r\n:1\r\n*2\r\n$1\r\na\r\n$-1\r\n",
            b"*2\r\n:1\r\n*2\r\n$1\r\na\r\n_\r\n",
        );
    }

    #[test]
    fn maps_flatten_in_resp2() {
        let map = Reply::Map(vec![
            (Reply::Bulk(b"a".to_vec()), Reply::Integer(1)),
            (Reply::Bulk(b"b".to_vec()), Reply::Double(1.5)),
        ]);
        assert_encodes(
            map,
            b"*4\r\n$1\r\na\r\n:1\r\n$1\r\nb\r\n$3\r\n1.5\r\n",
            b"%2\r\n$1\r\na\r\n:1\r\n$1\r\nb\r\n,1.5\r\n",
        );
        assert_encodes(Reply::Map(Vec::new()), b"*0\r\n", b"%0\r\n");
    }

    #[test]
    fn sets_are_arrays_in_resp2() {
        assert_encodes(
            Reply::Set(vec![Reply::Bulk(b"x".to_vec()), Reply::Bulk(b"yz".to_vec())]),
            b"*2\r\n$1\r\nx\r\n$2\r\nyz\r\n",
            b"~2\r\n$1\r\nx\r\n$2\r\nyz\r\n",
        );
    }

    #[test]
    fn doubles_are_bulks_in_resp2() {
        assert_encodes(Reply::Double(0.1), b"$3\r\n0.1\r\n", b",0.1\r\n");
        assert_encodes(Reply::Double(10.0), b"$2\r\n10\r\n", b",10\r\n");
        assert_encodes(Reply::Double(1e20), b"$5\r\n1e+20\r\n", b",1e+20\r\n");
        assert_encodes(Reply::Double(f64::INFINITY), b"$3\r\ninf\r\n", b",inf\r\n");
        assert_encodes(Reply::Double(f64::NEG_INFINITY), b"$4\r\n-inf\r\n", b",-inf\r\n");
        assert_encodes(Reply::Double(f64::NAN), b"$3\r\nnan\r\n", b",nan\r\n");
    }


    #[test]
    fn verbatim_is_a_plain_bulk_in_resp2() {
        assert_encodes(
            Reply::Verbatim { format: *b"txt", text: b"Some string".to_vec() },
            b"$11\r\nSome string\r\n",
            b"=15\r\ntxt:Some string\r\n",
        );
        assert_encodes(
            Reply::Verbatim { format: *b"mkd", text: Vec::new() },
            b"$0\r\n\r\n",
            b"=4\r\nmkd:\r\n",
        );
    }

    #[test]
    fn replies_append_without_touching_earlier_bytes() {
        let mut out = b"+OK\r\n".to_vec();
        encode_reply(&Reply::Integer(7), Protocol::Resp3, &mut out);
        encode_reply(&Reply::Null, Protocol::Resp2, &mut out);
        assert_eq!(out, b"+OK\r\n:7\r\n$-1\r\n");
    }

    #[test]
    fn format_double_matches_redis() {
        let cases: &[(f64, &str)] = &[
            (0.1, "0.1"),
            (1.5, "1.5"),
            (10.0, "10"),
            (-3.0, "-3"),
            (0.0, "0"),
            (-0.0, "-0"),
            (123.456, "123.456"),
            (-2.5, "-2.5"),
            (1e20, "1e+20"),
            (1.5e-7, "1.5e-7"),
            (1e-7, "1e-7"),
            (1e-6, "0.000001"),
            (0.001, "0.001"),
            (0.0001234, "1.234e-4"),
            (0.0012345678901234567, "0.0012345678901234567"),
            (123456789012345680000.0, "123456789012345680000"),
            (12345678.9, "12345678.9"),
            (1e18, "1000000000000000000"),
            (4611686018427387904.0, "4611686018427387904"),
            (-4611686018427387904.0, "-4611686018427387904"),
            (5e18, "5e+18"),
            (9223372036854775808.0, "9223372036854776000"),
            (1e21, "1e+21"),
            (1e100, "1e+100"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
            (-1.2345e-300, "-1.2345e-300"),
            (0.30000000000000004, "0.30000000000000004"),
            (f64::INFINITY, "inf"),
            (f64::NEG_INFINITY, "-inf"),
            (f64::NAN, "nan"),
        ];
        for &(value, text) in cases {
            assert_eq!(format_double(value), text, "{value:e}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 1024,
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn format_double_round_trips(bits in any::<u64>()) {
            let value = f64::from_bits(bits);
            let text = format_double(value);
            if value.is_nan() {
                prop_assert_eq!(text, "nan");
            } else {
                // "inf" and "-inf" parse in Rust too, so every double reads back exactly.
                let parsed: f64 = text.parse().map_err(|_| TestCaseError::fail(text.clone()))?;
                prop_assert_eq!(parsed.to_bits(), value.to_bits(), "{}", text);
                prop_assert!(text.len() <= 25, "{}", text);
            }
        }
    }
}
