//! Parsing client requests: RESP multibulk (`*2\r\n$3\r\nGET\r\n$1\r\nk\r\n`) and inline
//! (`GET k\r\n`, what a person types into telnet).
//!
//! A request is multibulk when its first byte is `*`, inline otherwise (as in Redis).
//!
//! Invariants (see `resp/mod.rs` for why they matter):
//! - Never panics: every index is either checked (`get`) or bounded by a length computed just
//!   before it; every size from the wire goes through checked arithmetic.
//! - No allocation by an untrusted size: a multibulk request is walked twice. The first walk
//!   copies nothing and only finds out whether the whole request is present (or malformed),
//!   remembering in `ParseState` how far it got; the second, run only when it is, copies the
//!   arguments. So `*1000000` or `$16000000` followed by a
//!   few bytes allocates nothing, and the argument vector is sized only once its elements are
//!   known to be in the buffer (each takes at least 6 bytes, `$0\r\n\r\n`).
//! - Incremental: header lines are searched within `inline_bytes_max` bytes only, so a line that
//!   is too long is refused at the same point whatever the split, and an error is reported as soon
//!   as the bytes proving it have arrived. With `parse_command_resumed` a call after more bytes
//!   arrive resumes at the bulk and the line offset the last one reached, so each byte of a
//!   request is examined O(1) times however it is split (`ParseState::examined_bytes` counts).
//!
//! Where this parser is stricter than Redis (each case is malformed input either way):
//! - A header line's `\r` must be followed by `\n`; Redis skips whichever byte follows.
//! - A bulk must be followed by `\r\n`; Redis skips two bytes unchecked.
//! - A bulk header whose first byte is not `$` is refused as soon as that byte arrives; Redis
//!   waits for the next `\r` first.
//! - A NUL byte ends Redis's search for a line ending (`strchr`), so Redis never completes an
//!   inline request or header line holding one: it waits until the line exceeds 64 KiB and then
//!   refuses it as too big. Here an inline request is refused as soon as a NUL arrives in it, and
//!   a NUL in a header line is an invalid digit.
//! - An inline request may hold no more arguments than a multibulk one (`multibulk_len_max`);
//!   Redis bounds it only by its 64 KiB. With Redis's limits the two bounds never meet (64 KiB of
//!   inline text holds at most 32 Ki arguments); with smaller limits the argument count would
//!   otherwise escape its limit (found by the coverage-guided fuzzer, docs/reliability.md).

use thiserror::Error;

/// Bounds on one request. Redis's defaults are 1024 * 1024 arguments, 512 MiB per bulk
/// (`proto-max-bulk-len`) and 64 KiB per inline request or header line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParseLimits {
    /// Maximum number of arguments in one request (multibulk or inline).
    pub multibulk_len_max: usize,
    /// Maximum bytes of one bulk argument.
    pub bulk_bytes_max: usize,
    /// Maximum bytes of an inline request line, and of a `*N` / `$N` header line, without its
    /// line ending.
    pub inline_bytes_max: usize,
    /// Tighter bounds while the client still has to authenticate (a password is set and it has
    /// not given it), as in Redis since CVE-2021-32675: otherwise anyone who can reach the port
    /// makes the server buffer and copy up to `multibulk_len_max` × `bulk_bytes_max` bytes
    /// before it even looks at the command. `None` once authenticated, or with no password.
    pub unauthenticated: Option<UnauthenticatedLimits>,
}

/// The bounds on a request sent before authentication (Redis: 10 arguments of 16 KiB).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnauthenticatedLimits {
    pub multibulk_len_max: usize,
    pub bulk_bytes_max: usize,
}

/// A request's arguments, the command's name first. Most commands have at most three (GET k,
/// SET k v), held in place: parsing a request allocates only its arguments' bytes.
pub type Args = smallvec::SmallVec<[Vec<u8>; ARGS_INLINE]>;

/// Arguments an `Args` holds without allocating a list for them.
pub const ARGS_INLINE: usize = 3;

/// The outcome of parsing the start of a connection's buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Parsed {
    /// One complete request; `consumed` bytes of the buffer belong to it.
    Command { args: Args, consumed: usize },
    /// Bytes that form no command (an empty inline line, `*0`, `*-1`, `*-10`): skip `consumed`,
    /// no reply.
    Skip { consumed: usize },
    /// More bytes are needed; nothing consumed.
    Incomplete,
}

/// A request that can never become valid. The caller replies `-ERR <display>` and closes the
/// connection, since it cannot know where the next request would start.
///
/// The texts are Redis's, without the leading "ERR ", so clients matching on them keep working.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// The count of `*<count>` is not a number or exceeds `multibulk_len_max`.
    #[error("Protocol error: invalid multibulk length")]
    InvalidMultibulkLength,
    /// The length of `$<length>` is not a number, is negative or exceeds `bulk_bytes_max`.
    #[error("Protocol error: invalid bulk length")]
    InvalidBulkLength,
    /// Before authentication, a count over the unauthenticated `multibulk_len_max`.
    #[error("Protocol error: unauthenticated multibulk length")]
    UnauthenticatedMultibulkLength,
    /// Before authentication, a bulk over the unauthenticated `bulk_bytes_max`.
    #[error("Protocol error: unauthenticated bulk length")]
    UnauthenticatedBulkLength,
    /// An argument of a multibulk request does not start with `$`. Bytes above 0x7f are shown as
    /// the Latin-1 character of that value, since Redis writes the raw byte, which is not UTF-8.
    #[error("Protocol error: expected '$', got '{}'", char::from(*.got))]
    ExpectedDollar { got: u8 },
    /// A quoted inline argument is not closed, or its closing quote is followed by a non-space.
    #[error("Protocol error: unbalanced quotes in request")]
    UnbalancedQuotes,
    /// More than `inline_bytes_max` bytes of an inline request without a newline.
    #[error("Protocol error: too big inline request")]
    InlineTooBig,
    /// An inline request with more than `multibulk_len_max` arguments.
    #[error("Protocol error: too many arguments in inline request")]
    InlineTooManyArguments,
    /// A NUL byte in an inline request, which Redis can never complete (see the module comment).
    #[error("Protocol error: NUL byte in inline request")]
    InlineNul,
    /// More than `inline_bytes_max` bytes of a `*<count>` line without its `\r`.
    #[error("Protocol error: too big mbulk count string")]
    MultibulkCountTooBig,
    /// More than `inline_bytes_max` bytes of a `$<length>` line without its `\r`.
    #[error("Protocol error: too big bulk count string")]
    BulkCountTooBig,
    /// The bytes after a bulk's data are not `\r\n`: the announced length is wrong.
    #[error("Protocol error: bulk data not followed by CRLF")]
    BulkNotTerminated,
}

/// How far the parse of the request at the start of a connection's buffer got, so that the
/// next call, once more bytes have arrived, resumes there instead of walking the request from
/// its start again: each byte of a request is then examined a bounded number of times however
/// finely the network splits it (re-walking made a 7 MB request sent in 700-byte reads cost
/// seconds of CPU). Offsets are from the start of the request.
///
/// REQUIRES: between calls with the same state, the buffer holds the same bytes, with more
/// appended. The state forgets the request when it is consumed (or refused).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParseState {
    /// A multibulk request's argument count and where its first bulk starts, once its header
    /// line is read.
    multibulk: Option<(usize, usize)>,
    /// Bulks of it known complete and valid.
    bulks_done: usize,
    /// Where the next bulk starts.
    next_bulk_at: usize,
    /// The line being searched for its end (a header line, or an inline request, starting at
    /// `next_bulk_at` or 0) holds no line end before this offset.
    line_scanned: usize,
    /// Bytes examined over this state's life: searched for a line end, or copied.
    examined_bytes: u64,
}

impl ParseState {
    /// Bytes examined over this state's life, for tests of the parser's cost.
    #[cfg(test)]
    pub fn examined_bytes(&self) -> u64 {
        self.examined_bytes
    }

    /// Bytes examined since the last call, which are then forgotten (a connection adds them to
    /// its server's INFO figure).
    pub fn take_examined_bytes(&mut self) -> u64 {
        std::mem::take(&mut self.examined_bytes)
    }

    /// Forgets the request (keeping the count of bytes examined).
    fn next_request(&mut self) {
        *self = ParseState { examined_bytes: self.examined_bytes, ..ParseState::default() };
    }
}

/// Parses the first request at the start of `buf` from scratch. Never panics on any input.
/// For tests and the fuzz target; a connection resumes (`parse_command_resumed`).
#[cfg(any(test, feature = "testing"))]
pub fn parse_command(buf: &[u8], limits: &ParseLimits) -> Result<Parsed, ProtocolError> {
    parse_command_resumed(buf, limits, &mut ParseState::default())
}

/// Parses the first request at the start of `buf`, resuming where `state` says the last call
/// on the same request stopped. Same outcomes as `parse_command`. Never panics on any input.
pub fn parse_command_resumed(
    buf: &[u8],
    limits: &ParseLimits,
    state: &mut ParseState,
) -> Result<Parsed, ProtocolError> {
    let outcome = match buf.first() {
        None => Ok(Parsed::Incomplete),
        Some(b'*') => parse_multibulk(buf, limits, state),
        Some(_) => parse_inline(buf, limits, state),
    };
    if !matches!(outcome, Ok(Parsed::Incomplete)) {
        state.next_request();
    }
    outcome
}

fn parse_multibulk(
    buf: &[u8],
    limits: &ParseLimits,
    state: &mut ParseState,
) -> Result<Parsed, ProtocolError> {
    // Tried once per request: a request still arriving has its header read by the walk, which
    // then resumes it, so the bytes this copies and drops are at most those of the first call.
    if state.multibulk.is_none() {
        match parse_whole_multibulk(buf, limits) {
            Ok((args, consumed)) => {
                state.examined_bytes += consumed as u64;
                return Ok(Parsed::Command { args, consumed });
            }
            Err(examined) => state.examined_bytes += examined as u64,
        }
    }
    walk_multibulk(buf, limits, state)
}

/// The general parse of a multibulk request, resumable (`ParseState`), for every input.
fn walk_multibulk(
    buf: &[u8],
    limits: &ParseLimits,
    state: &mut ParseState,
) -> Result<Parsed, ProtocolError> {
    let (count, args_start) = match state.multibulk {
        Some(header) => header,
        None => {
            let Some((count, args_start)) =
                read_header_line(buf, 0, limits, HeaderKind::Multibulk, state)?
            else {
                return Ok(Parsed::Incomplete);
            };
            // Redis ignores a non-positive count silently; clients never send one for a command.
            if count <= 0 {
                return Ok(Parsed::Skip { consumed: args_start });
            }
            let count = match usize::try_from(count) {
                Ok(count) if count <= limits.multibulk_len_max => count,
                _ => return Err(ProtocolError::InvalidMultibulkLength),
            };
            // Redis checks the general limit first, then the unauthenticated one, and so answers.
            if limits.unauthenticated.is_some_and(|tight| count > tight.multibulk_len_max) {
                return Err(ProtocolError::UnauthenticatedMultibulkLength);
            }
            state.multibulk = Some((count, args_start));
            state.next_bulk_at = args_start;
            state.line_scanned = args_start;
            (count, args_start)
        }
    };
    // Each pass either returns or completes a bulk of at least `$0\r\n\r\n`, so a huge claimed
    // `count` costs nothing beyond the bytes actually present.
    while state.bulks_done < count {
        let Some(bulk_end) = read_bulk(buf, state.next_bulk_at, limits, state)? else {
            return Ok(Parsed::Incomplete);
        };
        state.bulks_done += 1;
        state.next_bulk_at = bulk_end;
        state.line_scanned = bulk_end;
    }
    let consumed = state.next_bulk_at;
    // The whole request is in `buf` now, so `count` is bounded by bytes received, not by a
    // claim: copy the arguments, re-reading only their short, already checked headers.
    let mut args = Args::with_capacity(count);
    let mut position = args_start;
    while args.len() < count {
        let mut fresh = ParseState { line_scanned: position, ..ParseState::default() };
        let Some((length, data_start)) =
            read_header_line(buf, position, limits, HeaderKind::Bulk, &mut fresh)?
        else {
            unreachable!("a bulk found complete is complete");
        };
        let data_end = data_start + length as usize;
        args.push(buf[data_start..data_end].to_vec());
        state.examined_bytes += fresh.examined_bytes + (data_end - data_start) as u64;
        position = data_end + 2;
    }
    // The copy reads the same bytes as the walk, so it must end at the same place.
    debug_assert_eq!(position, consumed);
    Ok(Parsed::Command { args, consumed })
}

/// The common case in one pass: a multibulk request that is all in `buf`, with short, plain
/// header lines (digits only, no sign, no leading zero) and every count and length within the
/// limits. Returns its arguments and length; for anything else (incomplete, an error, an
/// unusual header) the bytes it looked at, and the general walk then parses the request from
/// the start and answers exactly as before: this path only ever accepts what that walk would
/// accept, with the same result.
fn parse_whole_multibulk(buf: &[u8], limits: &ParseLimits) -> Result<(Args, usize), usize> {
    let mut position = 0;
    match whole_multibulk_from(buf, limits, &mut position) {
        Some(args) => Ok((args, position)),
        None => Err(position),
    }
}

/// `parse_whole_multibulk`, leaving `position` where it stopped.
fn whole_multibulk_from(buf: &[u8], limits: &ParseLimits, position: &mut usize) -> Option<Args> {
    let line_max = limits.inline_bytes_max;
    let count;
    (count, *position) = plain_header(buf, 0, b'*', line_max)?;
    let count_max = limits.unauthenticated.map_or(limits.multibulk_len_max, |tight| {
        tight.multibulk_len_max.min(limits.multibulk_len_max)
    });
    let bulk_bytes_max = limits.unauthenticated.map_or(limits.bulk_bytes_max, |tight| {
        tight.bulk_bytes_max.min(limits.bulk_bytes_max)
    });
    if count == 0 || count > count_max {
        return None;
    }
    let mut args = Args::new();
    for _ in 0..count {
        let (length, data_start) = plain_header(buf, *position, b'$', line_max)?;
        if length > bulk_bytes_max {
            return None;
        }
        let data_end = data_start.checked_add(length)?;
        if buf.get(data_end..data_end.checked_add(2)?)? != b"\r\n" {
            return None;
        }
        // Grown as bulks are found complete, never sized by the claimed count.
        args.push(buf[data_start..data_end].to_vec());
        *position = data_end + 2;
    }
    Some(args)
}

/// Digits a plain header's number may have: below `usize::MAX` on every platform, and far
/// under any `inline_bytes_max`.
const PLAIN_HEADER_DIGITS_MAX: usize = 18;

/// A header line `<type_byte><digits>\r\n` at `start` whose number is plain: 1 to
/// `PLAIN_HEADER_DIGITS_MAX` digits, no sign, no leading zero unless it is `0`, its `\r` within
/// `line_max` bytes of the type byte (as `read_header_line` requires). Returns the number and
/// where the line ends; `None` for anything else, including an incomplete line.
fn plain_header(buf: &[u8], start: usize, type_byte: u8, line_max: usize) -> Option<(usize, usize)> {
    let line = buf.get(start..)?;
    if line.first() != Some(&type_byte) {
        return None;
    }
    let mut number = 0u64;
    for (at, &byte) in line.iter().enumerate().skip(1) {
        match byte {
            b'0'..=b'9' if at <= PLAIN_HEADER_DIGITS_MAX => {
                if at == 2 && number == 0 {
                    // A leading zero: the general walk decides (it refuses it).
                    return None;
                }
                number = number * 10 + u64::from(byte - b'0');
            }
            b'\r' if at > 1 && at <= line_max => {
                let number = usize::try_from(number).ok()?;
                return (line.get(at + 1) == Some(&b'\n')).then_some((number, start + at + 2));
            }
            _ => return None,
        }
    }
    None
}

/// Checks the bulk starting at `position`. Returns where it ends, or `None` when the buffer
/// ends first.
fn read_bulk(
    buf: &[u8],
    position: usize,
    limits: &ParseLimits,
    state: &mut ParseState,
) -> Result<Option<usize>, ProtocolError> {
    match buf.get(position) {
        None => return Ok(None),
        Some(b'$') => {}
        Some(&got) => return Err(ProtocolError::ExpectedDollar { got }),
    }
    let Some((length, data_start)) =
        read_header_line(buf, position, limits, HeaderKind::Bulk, state)?
    else {
        return Ok(None);
    };
    let length_bytes = match usize::try_from(length) {
        Ok(length_bytes) if length_bytes <= limits.bulk_bytes_max => length_bytes,
        _ => return Err(ProtocolError::InvalidBulkLength),
    };
    if limits.unauthenticated.is_some_and(|tight| length_bytes > tight.bulk_bytes_max) {
        return Err(ProtocolError::UnauthenticatedBulkLength);
    }
    // Checked because `bulk_bytes_max` may be configured near `usize::MAX`; a bulk whose end
    // cannot even be addressed can never arrive.
    let Some(data_end) = data_start.checked_add(length_bytes) else { return Ok(None) };
    let Some(bulk_end) = data_end.checked_add(2) else { return Ok(None) };
    // Look at nothing until the whole bulk is here: the length is only a claim until then.
    let Some(terminator) = buf.get(data_end..bulk_end) else { return Ok(None) };
    state.examined_bytes += 2;
    if terminator != b"\r\n" {
        return Err(ProtocolError::BulkNotTerminated);
    }
    Ok(Some(bulk_end))
}

#[derive(Clone, Copy)]
enum HeaderKind {
    Multibulk,
    Bulk,
}

impl HeaderKind {
    fn invalid(self) -> ProtocolError {
        match self {
            HeaderKind::Multibulk => ProtocolError::InvalidMultibulkLength,
            HeaderKind::Bulk => ProtocolError::InvalidBulkLength,
        }
    }

    fn too_big(self) -> ProtocolError {
        match self {
            HeaderKind::Multibulk => ProtocolError::MultibulkCountTooBig,
            HeaderKind::Bulk => ProtocolError::BulkCountTooBig,
        }
    }
}

/// Reads the header line `<type byte><decimal>\r\n` starting at `start`, which holds the type
/// byte. Returns its number and the position just after its `\n`, or `None` when incomplete.
/// The search for its `\r` starts at `state.line_scanned` (at least `start`) and leaves it
/// where it stopped.
fn read_header_line(
    buf: &[u8],
    start: usize,
    limits: &ParseLimits,
    kind: HeaderKind,
    state: &mut ParseState,
) -> Result<Option<(i64, usize)>, ProtocolError> {
    let rest = buf.get(start..).unwrap_or_default();
    // Search no further than the limit: past it the line is refused whether or not a `\r`
    // follows, so the answer does not depend on how much of the stream has arrived.
    let window_bytes = rest.len().min(limits.inline_bytes_max.saturating_add(1));
    let searched_from = state.line_scanned.saturating_sub(start).min(window_bytes);
    let found = rest[searched_from..window_bytes].iter().position(|&byte| byte == b'\r');
    let searched_to = found.map_or(window_bytes, |offset| searched_from + offset);
    state.examined_bytes += (searched_to - searched_from) as u64 + 1;
    state.line_scanned = start + searched_to;
    let Some(cr_offset) = found.map(|offset| searched_from + offset) else {
        if rest.len() > limits.inline_bytes_max {
            return Err(kind.too_big());
        }
        return Ok(None);
    };
    match rest.get(cr_offset + 1) {
        None => return Ok(None),
        Some(b'\n') => {}
        Some(_) => return Err(kind.invalid()),
    }
    let digits = rest.get(1..cr_offset).unwrap_or_default();
    state.examined_bytes += digits.len() as u64;
    let number = parse_decimal(digits).ok_or(kind.invalid())?;
    Ok(Some((number, start + cr_offset + 2)))
}

/// Parses a decimal integer as strictly as Redis's `string2ll`: an optional `-`, no `+`, no
/// leading zeros, no spaces, no `-0`, and no overflow.
fn parse_decimal(text: &[u8]) -> Option<i64> {
    let (negative, digits) = match text {
        [b'-', digits @ ..] => (true, digits),
        _ => (false, text),
    };
    match digits {
        [b'0'] if !negative => return Some(0),
        [b'1'..=b'9', ..] => {}
        _ => return None,
    }
    let mut value: i64 = 0;
    for &byte in digits {
        if !byte.is_ascii_digit() {
            return None;
        }
        let digit = i64::from(byte - b'0');
        // Accumulating negative values directly lets `i64::MIN` parse without overflowing.
        value = value.checked_mul(10)?;
        value = if negative { value.checked_sub(digit)? } else { value.checked_add(digit)? };
    }
    Some(value)
}

fn parse_inline(
    buf: &[u8],
    limits: &ParseLimits,
    state: &mut ParseState,
) -> Result<Parsed, ProtocolError> {
    // As for header lines: a newline past the limit does not rescue the line, so the result is
    // the same whether the line arrived in one read or many.
    let window_bytes = buf.len().min(limits.inline_bytes_max.saturating_add(1));
    let searched_from = state.line_scanned.min(window_bytes);
    let end_offset = buf[searched_from..window_bytes]
        .iter()
        .position(|&byte| byte == b'\n' || byte == 0)
        .map(|offset| searched_from + offset);
    let searched_to = end_offset.unwrap_or(window_bytes);
    state.examined_bytes += (searched_to - searched_from) as u64 + 1;
    state.line_scanned = searched_to;
    let newline_offset = match end_offset.map(|offset| (offset, buf[offset])) {
        Some((offset, b'\n')) => offset,
        Some(_) => return Err(ProtocolError::InlineNul),
        None if buf.len() > limits.inline_bytes_max => return Err(ProtocolError::InlineTooBig),
        None => return Ok(Parsed::Incomplete),
    };
    state.examined_bytes += newline_offset as u64;
    let consumed = newline_offset + 1;
    let line = &buf[..newline_offset];
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let args = split_inline_args(line)?;
    if args.len() > limits.multibulk_len_max {
        return Err(ProtocolError::InlineTooManyArguments);
    }
    if args.is_empty() {
        return Ok(Parsed::Skip { consumed });
    }
    Ok(Parsed::Command { args: Args::from_vec(args), consumed })
}

/// Splits an inline request into arguments with the rules of Redis's `sdssplitargs`:
/// - blanks (C `isspace`) separate arguments; an unquoted argument ends at space, tab, CR or LF
///   (so a vertical tab or form feed inside one is kept, as in Redis);
/// - `"..."` takes the escapes `\n \r \t \b \a \xHH`, and `\<any>` for that byte;
/// - `'...'` takes only `\'`;
/// - a quote may open in the middle of an argument, and a closing quote must be followed by a
///   blank or the end of the line, else the quotes are unbalanced.
///
/// REQUIRES: `line` holds no NUL (`sdssplitargs` would stop there; `parse_inline` refuses it).
fn split_inline_args(line: &[u8]) -> Result<Vec<Vec<u8>>, ProtocolError> {
    debug_assert!(!line.contains(&0));
    let mut args = Vec::new();
    let mut position = 0;
    loop {
        while line.get(position).is_some_and(|&byte| is_c_space(byte)) {
            position += 1;
        }
        if position >= line.len() {
            return Ok(args);
        }
        // A plain run, copied at once rather than byte by byte, then possibly one quoted part,
        // whose closing quote ends the argument (it must be followed by a blank).
        let rest = line.get(position..).unwrap_or_default();
        let run_bytes = rest.iter().position(|&byte| ends_unquoted_run(byte)).unwrap_or(rest.len());
        let mut arg = rest[..run_bytes].to_vec();
        position += run_bytes;
        match line.get(position) {
            Some(b'"') => position = read_double_quoted(line, position + 1, &mut arg)?,
            Some(b'\'') => position = read_single_quoted(line, position + 1, &mut arg)?,
            // A separator, or the end of the line.
            _ => {}
        }
        args.push(arg);
    }
}

/// C's `isspace` in the "C" locale, which is what `sdssplitargs` skips between arguments.
fn is_c_space(byte: u8) -> bool {
    matches!(byte, b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c)
}

fn ends_unquoted_run(byte: u8) -> bool {
    matches!(byte, b' ' | b'\t' | b'\n' | b'\r' | b'"' | b'\'')
}

/// Reads a double-quoted string whose opening quote ends just before `position`, appending its
/// bytes to `arg`. Returns the position after the closing quote.
fn read_double_quoted(
    line: &[u8],
    mut position: usize,
    arg: &mut Vec<u8>,
) -> Result<usize, ProtocolError> {
    loop {
        let rest = line.get(position..).unwrap_or_default();
        let run_bytes =
            rest.iter().position(|&byte| byte == b'"' || byte == b'\\').unwrap_or(rest.len());
        arg.extend_from_slice(&rest[..run_bytes]);
        position += run_bytes;
        match line.get(position) {
            None => return Err(ProtocolError::UnbalancedQuotes),
            Some(b'"') => return after_closing_quote(line, position),
            Some(_) => {
                // A backslash. Redis takes `\xHH` only with two hex digits, and otherwise keeps
                // the escaped byte itself, so `\xZZ` is `xZZ`.
                let hex_byte = match (line.get(position + 2), line.get(position + 3)) {
                    (Some(&high), Some(&low)) => hex_pair(high, low),
                    _ => None,
                };
                match (line.get(position + 1), hex_byte) {
                    (Some(b'x'), Some(byte)) => {
                        arg.push(byte);
                        position += 4;
                    }
                    (Some(&escaped), _) => {
                        arg.push(match escaped {
                            b'n' => b'\n',
                            b'r' => b'\r',
                            b't' => b'\t',
                            b'b' => 0x08,
                            b'a' => 0x07,
                            other => other,
                        });
                        position += 2;
                    }
                    // A backslash at the very end: the quote can no longer be closed.
                    (None, _) => return Err(ProtocolError::UnbalancedQuotes),
                }
            }
        }
    }
}

/// Reads a single-quoted string whose opening quote ends just before `position`; only `\'` is
/// an escape, any other backslash is kept.
fn read_single_quoted(
    line: &[u8],
    mut position: usize,
    arg: &mut Vec<u8>,
) -> Result<usize, ProtocolError> {
    loop {
        let rest = line.get(position..).unwrap_or_default();
        let run_bytes =
            rest.iter().position(|&byte| byte == b'\'' || byte == b'\\').unwrap_or(rest.len());
        arg.extend_from_slice(&rest[..run_bytes]);
        position += run_bytes;
        match line.get(position) {
            None => return Err(ProtocolError::UnbalancedQuotes),
            Some(b'\'') => return after_closing_quote(line, position),
            Some(_) => {
                if line.get(position + 1) == Some(&b'\'') {
                    arg.push(b'\'');
                    position += 2;
                } else {
                    arg.push(b'\\');
                    position += 1;
                }
            }
        }
    }
}

/// Checks what follows the closing quote at `quote_position`: Redis refuses `"a"b`, because the
/// intended split is ambiguous.
fn after_closing_quote(line: &[u8], quote_position: usize) -> Result<usize, ProtocolError> {
    match line.get(quote_position + 1) {
        Some(&next) if !is_c_space(next) => Err(ProtocolError::UnbalancedQuotes),
        _ => Ok(quote_position + 1),
    }
}

fn hex_pair(high: u8, low: u8) -> Option<u8> {
    let digit = |byte: u8| char::from(byte).to_digit(16);
    let value = digit(high)? * 16 + digit(low)?;
    u8::try_from(value).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The one-pass parse accepts only what the general walk accepts, with the same arguments
    /// and length: checked on well-formed requests, on every truncation of them, on single-byte
    /// mutations and under tight limits.
    #[test]
    fn the_one_pass_parse_agrees_with_the_general_walk() {
        // A small deterministic generator: the test needs spread, not quality.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |below: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % below as u64) as usize
        };
        let limit_sets = [
            ParseLimits { multibulk_len_max: 1024, bulk_bytes_max: 512, inline_bytes_max: 64, unauthenticated: None },
            ParseLimits { multibulk_len_max: 3, bulk_bytes_max: 512, inline_bytes_max: 2, unauthenticated: None },
            ParseLimits {
                multibulk_len_max: 1024,
                bulk_bytes_max: 512,
                inline_bytes_max: 64,
                unauthenticated: Some(UnauthenticatedLimits { multibulk_len_max: 2, bulk_bytes_max: 4 }),
            },
        ];
        let mut accepted = 0;
        for _ in 0..3_000 {
            let args: Vec<Vec<u8>> = (0..1 + next(5))
                .map(|_| (0..next(20)).map(|_| next(256) as u8).collect())
                .collect();
            let request = encode_multibulk(&args);
            let mut inputs = vec![request.clone()];
            for end in 0..request.len() {
                inputs.push(request[..end].to_vec());
            }
            // A leading zero or sign put in front of a count or a length keeps the framing.
            for (at, &byte) in request.iter().enumerate() {
                if byte == b'$' || byte == b'*' {
                    for inserted in [b'0', b'-', b'+'] {
                        let mut longer = request.clone();
                        longer.insert(at + 1, inserted);
                        inputs.push(longer);
                    }
                }
            }
            for _ in 0..20 {
                let mut mutated = request.clone();
                let at = next(mutated.len());
                let bytes = [b'0', b'-', b'+', b'\r', b'\n', b'$', b'*', b'9', next(256) as u8];
                mutated[at] = bytes[next(bytes.len())];
                inputs.push(mutated);
            }
            for input in &inputs {
                for limits in &limit_sets {
                    let Ok((args, consumed)) = parse_whole_multibulk(input, limits) else { continue };
                    accepted += 1;
                    let walked = walk_multibulk(input, limits, &mut ParseState::default());
                    assert_eq!(walked, Ok(Parsed::Command { args, consumed }), "{input:?}");
                }
            }
        }
        assert!(accepted > 3_000, "the one-pass parse accepted only {accepted} requests");
    }

    /// Redis's defaults.
    const REDIS_LIMITS: ParseLimits = ParseLimits {
        multibulk_len_max: 1024 * 1024,
        bulk_bytes_max: 512 * 1024 * 1024,
        inline_bytes_max: 64 * 1024,
        unauthenticated: None,
    };

    /// Small enough that random inputs reach every limit.
    const SMALL_LIMITS: ParseLimits = ParseLimits {
        multibulk_len_max: 8,
        bulk_bytes_max: 16,
        inline_bytes_max: 32,
        unauthenticated: None,
    };

    fn parse(buf: &[u8]) -> Result<Parsed, ProtocolError> {
        parse_command(buf, &REDIS_LIMITS)
    }

    fn command(args: &[&[u8]], consumed: usize) -> Result<Parsed, ProtocolError> {
        Ok(Parsed::Command { args: args.iter().map(|arg| arg.to_vec()).collect(), consumed })
    }

    fn encode_multibulk(args: &[Vec<u8>]) -> Vec<u8> {
        let mut out = Vec::new();
        crate::resp::encode_request(args, &mut out);
        out
    }

    /// Feeds `chunks` to a connection-like buffer, parsing after each one until more is needed.
    fn parse_stream<'a>(
        chunks: impl IntoIterator<Item = &'a [u8]>,
        limits: &ParseLimits,
    ) -> Result<Vec<Vec<Vec<u8>>>, ProtocolError> {
        let mut pending = Vec::new();
        let mut commands = Vec::new();
        for chunk in chunks {
            pending.extend_from_slice(chunk);
            loop {
                match parse_command(&pending, limits)? {
                    Parsed::Command { args, consumed } => {
                        commands.push(args.into_vec());
                        pending.drain(..consumed);
                    }
                    Parsed::Skip { consumed } => {
                        pending.drain(..consumed);
                    }
                    Parsed::Incomplete => break,
                }
            }
        }
        assert!(pending.is_empty(), "bytes left over: {pending:?}");
        Ok(commands)
    }

    // ---- multibulk ----

    #[test]
    fn multibulk_request_parses_with_its_exact_length() {
        assert_eq!(parse(b"*1\r\n$4\r\nPING\r\n"), command(&[b"PING"], 14));
        assert_eq!(
            parse(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$0\r\n\r\nextra"),
            command(&[b"SET", b"k", b""], 26)
        );
    }

    #[test]
    fn bulk_data_is_binary_safe() {
        let buf = b"*2\r\n$3\r\nGET\r\n$6\r\n\r\n\0*$\xff\r\n";
        assert_eq!(parse(buf), command(&[b"GET", b"\r\n\0*$\xff"], buf.len()));
    }

    #[test]
    fn non_positive_multibulk_counts_are_skipped_silently() {
        assert_eq!(parse(b"*0\r\n"), Ok(Parsed::Skip { consumed: 4 }));
        assert_eq!(parse(b"*-1\r\n"), Ok(Parsed::Skip { consumed: 5 }));
        assert_eq!(parse(b"*-10\r\n*1\r\n"), Ok(Parsed::Skip { consumed: 6 }));
        assert_eq!(parse(b"*-3000000000\r\n"), Ok(Parsed::Skip { consumed: 14 }));
    }

    #[test]
    fn out_of_range_multibulk_counts_are_refused() {
        assert_eq!(parse(b"*3000000000\r\n"), Err(ProtocolError::InvalidMultibulkLength));
        assert_eq!(parse(b"*20000000\r\n"), Err(ProtocolError::InvalidMultibulkLength));
        assert_eq!(parse(b"*1048577\r\n"), Err(ProtocolError::InvalidMultibulkLength));
        assert_eq!(
            parse(b"*99999999999999999999999\r\n"),
            Err(ProtocolError::InvalidMultibulkLength)
        );
        // At the limit the count is accepted and the request simply waits for its arguments.
        assert_eq!(parse(b"*1048576\r\n"), Ok(Parsed::Incomplete));
    }

    #[test]
    fn malformed_multibulk_counts_are_refused() {
        for buf in [
            &b"*blabla\r\n"[..],
            b"*\r\n",
            b"*01\r\n",
            b"*+1\r\n",
            b"*-0\r\n",
            b"*-\r\n",
            b"* 1\r\n",
            b"*1 \r\n",
            b"*1\0\r\n",
            b"*\xff\xfe\r\n",
        ] {
            assert_eq!(parse(buf), Err(ProtocolError::InvalidMultibulkLength), "{buf:?}");
        }
    }

    #[test]
    fn header_cr_must_be_followed_by_lf() {
        assert_eq!(parse(b"*1\rX$4\r\nPING\r\n"), Err(ProtocolError::InvalidMultibulkLength));
        assert_eq!(parse(b"*1\r\n$4\rXPING\r\n"), Err(ProtocolError::InvalidBulkLength));
        assert_eq!(parse(b"*1\r"), Ok(Parsed::Incomplete));
        assert_eq!(parse(b"*1\r\n$4\r"), Ok(Parsed::Incomplete));
    }

    #[test]
    fn malformed_bulk_lengths_are_refused() {
        for buf in [
            &b"*1\r\n$-10\r\n"[..],
            b"*1\r\n$-1\r\n",
            b"*1\r\n$2000000000\r\n",
            b"*1\r\n$blabla\r\n",
            b"*1\r\n$\r\n",
            b"*1\r\n$04\r\nPING\r\n",
            b"*1\r\n$99999999999999999999\r\n",
        ] {
            assert_eq!(parse(buf), Err(ProtocolError::InvalidBulkLength), "{buf:?}");
        }
    }

    #[test]
    fn argument_not_starting_with_dollar_is_refused() {
        assert_eq!(parse(b"*1\r\nfoo\r\n"), Err(ProtocolError::ExpectedDollar { got: b'f' }));
        assert_eq!(
            parse(b"*3\r\n$3\r\nSET\r\n$1\r\nx\r\nfooz\r\n"),
            Err(ProtocolError::ExpectedDollar { got: b'f' })
        );
        // Detected from the first byte, without waiting for a line ending.
        assert_eq!(parse(b"*2\r\n$1\r\na\r\n:"), Err(ProtocolError::ExpectedDollar { got: b':' }));
    }

    #[test]
    fn bulk_must_be_followed_by_crlf() {
        assert_eq!(parse(b"*1\r\n$3\r\nfooXY"), Err(ProtocolError::BulkNotTerminated));
        assert_eq!(parse(b"*1\r\n$3\r\nfoo\rX"), Err(ProtocolError::BulkNotTerminated));
        assert_eq!(parse(b"*1\r\n$3\r\nfo\r\n\r\n"), Err(ProtocolError::BulkNotTerminated));
        assert_eq!(parse(b"*1\r\n$3\r\nfoo\r"), Ok(Parsed::Incomplete));
    }

    #[test]
    fn bulk_of_exactly_the_limit_is_accepted_and_one_more_byte_refused() {
        let limits = ParseLimits { bulk_bytes_max: 16, ..REDIS_LIMITS };
        let at_limit = encode_multibulk(&[vec![b'a'; 16]]);
        assert_eq!(
            parse_command(&at_limit, &limits),
            Ok(Parsed::Command { args: Args::from_vec(vec![vec![b'a'; 16]]), consumed: at_limit.len() })
        );
        let over_limit = encode_multibulk(&[vec![b'a'; 17]]);
        assert_eq!(parse_command(&over_limit, &limits), Err(ProtocolError::InvalidBulkLength));
    }

    #[test]
    fn multibulk_count_at_the_limit_is_accepted_and_one_more_refused() {
        let limits = ParseLimits { multibulk_len_max: 3, ..REDIS_LIMITS };
        let at_limit = encode_multibulk(&[b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]);
        assert!(matches!(parse_command(&at_limit, &limits), Ok(Parsed::Command { .. })));
        let over_limit = encode_multibulk(&[b"a".to_vec(), b"b".to_vec(), b"c".to_vec(), vec![]]);
        assert_eq!(parse_command(&over_limit, &limits), Err(ProtocolError::InvalidMultibulkLength));
    }

    /// CVE-2021-32675: before AUTH, a request that announces more than a few small arguments
    /// is refused at its header, before any of its bytes are buffered (at 101534c these limits
    /// did not exist and `*1048576` bulks of 16 MiB were read and copied first).
    #[test]
    fn an_unauthenticated_client_may_send_only_a_few_small_arguments() {
        let tight = UnauthenticatedLimits { multibulk_len_max: 10, bulk_bytes_max: 16 * 1024 };
        let limits = ParseLimits { unauthenticated: Some(tight), ..REDIS_LIMITS };
        let at_limit: Vec<Vec<u8>> = std::iter::once(b"AUTH".to_vec())
            .chain((0..9).map(|_| vec![b'p'; 16 * 1024]))
            .collect();
        let request = encode_multibulk(&at_limit);
        assert_eq!(
            parse_command(&request, &limits),
            Ok(Parsed::Command { args: Args::from_vec(at_limit), consumed: request.len() })
        );
        // Refused as soon as the header line is in, with Redis's texts.
        assert_eq!(
            parse_command(b"*11\r\n", &limits),
            Err(ProtocolError::UnauthenticatedMultibulkLength)
        );
        assert_eq!(
            parse_command(b"*2\r\n$3\r\nDEL\r\n$16385\r\n", &limits),
            Err(ProtocolError::UnauthenticatedBulkLength)
        );
        // The general limits still come first, as in Redis.
        assert_eq!(
            parse_command(b"*2000000\r\n", &limits),
            Err(ProtocolError::InvalidMultibulkLength)
        );
        assert_eq!(parse_command(b"*1\r\n$-5\r\n", &limits), Err(ProtocolError::InvalidBulkLength));
        assert_eq!(
            ProtocolError::UnauthenticatedMultibulkLength.to_string(),
            "Protocol error: unauthenticated multibulk length"
        );
        assert_eq!(
            ProtocolError::UnauthenticatedBulkLength.to_string(),
            "Protocol error: unauthenticated bulk length"
        );
        // Authenticated, the same requests wait for their bytes.
        assert_eq!(parse(b"*11\r\n"), Ok(Parsed::Incomplete));
    }

    #[test]
    fn huge_claims_wait_for_their_bytes() {
        // Neither claim may be trusted to size an allocation; both just wait.
        assert_eq!(parse(b"*1000000\r\n$3\r\nGET\r\n"), Ok(Parsed::Incomplete));
        assert_eq!(parse(b"*1\r\n$16000000\r\nabc"), Ok(Parsed::Incomplete));
        let limits = ParseLimits { bulk_bytes_max: usize::MAX, ..REDIS_LIMITS };
        let claim = format!("*1\r\n${}\r\nabc", i64::MAX);
        assert_eq!(parse_command(claim.as_bytes(), &limits), Ok(Parsed::Incomplete));
    }

    #[test]
    fn header_line_without_cr_beyond_the_limit_is_refused() {
        let mut count = b"*".to_vec();
        count.resize(70 * 1024, b'1');
        assert_eq!(parse(&count), Err(ProtocolError::MultibulkCountTooBig));
        let mut length = b"*1\r\n$".to_vec();
        length.resize(70 * 1024, b'1');
        assert_eq!(parse(&length), Err(ProtocolError::BulkCountTooBig));
        // The limit counts the type byte; a line of exactly the limit still waits.
        let limits = ParseLimits { inline_bytes_max: 4, ..REDIS_LIMITS };
        assert_eq!(parse_command(b"*123", &limits), Ok(Parsed::Incomplete));
        assert_eq!(parse_command(b"*1234", &limits), Err(ProtocolError::MultibulkCountTooBig));
        assert_eq!(parse_command(b"*1234\r\n", &limits), Err(ProtocolError::MultibulkCountTooBig));
    }

    #[test]
    fn every_strict_prefix_of_a_request_is_incomplete() {
        let request = b"*3\r\n$3\r\nSET\r\n$3\r\nkey\r\n$5\r\nvalue\r\n";
        for end in 0..request.len() {
            assert_eq!(parse(&request[..end]), Ok(Parsed::Incomplete), "prefix of {end} bytes");
        }
        assert_eq!(parse(request), command(&[b"SET", b"key", b"value"], request.len()));
    }

    #[test]
    fn pipelined_requests_are_consumed_one_at_a_time() {
        let buf = b"*1\r\n$4\r\nPING\r\nECHO \"a b\"\r\n*0\r\n\r\n*2\r\n$3\r\nGET\r\n$1\r\nk\r\n";
        let mut position = 0;
        let mut outcomes = Vec::new();
        while position < buf.len() {
            let outcome = parse(&buf[position..]).expect("valid pipeline");
            position += match &outcome {
                Parsed::Command { consumed, .. } | Parsed::Skip { consumed } => *consumed,
                Parsed::Incomplete => panic!("incomplete at {position}"),
            };
            outcomes.push(outcome);
        }
        assert_eq!(
            outcomes,
            vec![
                Parsed::Command { args: smallvec::smallvec![b"PING".to_vec()], consumed: 14 },
                Parsed::Command { args: smallvec::smallvec![b"ECHO".to_vec(), b"a b".to_vec()], consumed: 12 },
                Parsed::Skip { consumed: 4 },
                Parsed::Skip { consumed: 2 },
                Parsed::Command { args: smallvec::smallvec![b"GET".to_vec(), b"k".to_vec()], consumed: 20 },
            ]
        );
        assert_eq!(position, buf.len());
    }

    #[test]
    fn binary_garbage_is_refused_or_waits_but_never_panics() {
        assert_eq!(parse(b"*\xff\x00\xfe\r\n"), Err(ProtocolError::InvalidMultibulkLength));
        assert_eq!(parse(b"*1\r\n\xff"), Err(ProtocolError::ExpectedDollar { got: 0xff }));
        // Inline garbage: a NUL is refused as soon as it arrives, newline or not.
        assert_eq!(parse(b"\x00\xff\xfe\n"), Err(ProtocolError::InlineNul));
        assert_eq!(parse(b"GET \x00"), Err(ProtocolError::InlineNul));
        assert_eq!(parse(b"\x01\xff\xfe\n"), command(&[b"\x01\xff\xfe"], 4));
        let garbage: Vec<u8> = (0..70 * 1024).map(|i| (i * 7 % 251) as u8 | 0x80).collect();
        assert_eq!(parse(&garbage), Err(ProtocolError::InlineTooBig));
        // Redis's protocol desync tests: "\x00", "*\x00" and "$\x00" followed by a stream
        // without line endings.
        for start in [&b"\x00"[..], b"*\x00", b"$\x00"] {
            let mut buf = start.to_vec();
            buf.resize(70 * 1024, b'A');
            assert!(parse(&buf).is_err(), "{start:?}");
        }
    }

    #[test]
    fn error_texts_are_redis_texts() {
        let texts = [
            (ProtocolError::InvalidMultibulkLength, "Protocol error: invalid multibulk length"),
            (ProtocolError::InvalidBulkLength, "Protocol error: invalid bulk length"),
            (ProtocolError::ExpectedDollar { got: b'f' }, "Protocol error: expected '$', got 'f'"),
            (ProtocolError::UnbalancedQuotes, "Protocol error: unbalanced quotes in request"),
            (ProtocolError::InlineTooBig, "Protocol error: too big inline request"),
            (ProtocolError::InlineNul, "Protocol error: NUL byte in inline request"),
            (ProtocolError::MultibulkCountTooBig, "Protocol error: too big mbulk count string"),
            (ProtocolError::BulkCountTooBig, "Protocol error: too big bulk count string"),
            (ProtocolError::BulkNotTerminated, "Protocol error: bulk data not followed by CRLF"),
        ];
        for (error, text) in texts {
            assert_eq!(error.to_string(), text);
        }
        assert_eq!(
            ProtocolError::ExpectedDollar { got: 0xe9 }.to_string(),
            "Protocol error: expected '$', got 'é'"
        );
    }

    #[test]
    fn decimal_parsing_matches_string2ll() {
        assert_eq!(parse_decimal(b"0"), Some(0));
        assert_eq!(parse_decimal(b"-5"), Some(-5));
        assert_eq!(parse_decimal(b"9223372036854775807"), Some(i64::MAX));
        assert_eq!(parse_decimal(b"-9223372036854775808"), Some(i64::MIN));
        for text in [&b""[..], b"-", b"-0", b"00", b"+1", b"1a", b"9223372036854775808"] {
            assert_eq!(parse_decimal(text), None, "{text:?}");
        }
    }

    // ---- inline ----

    #[test]
    fn inline_request_ends_at_lf_with_optional_cr() {
        assert_eq!(parse(b"PING\r\n"), command(&[b"PING"], 6));
        assert_eq!(parse(b"PING\n"), command(&[b"PING"], 5));
        assert_eq!(parse(b"SET  k\tv \r\nGET k\r\n"), command(&[b"SET", b"k", b"v"], 11));
        assert_eq!(parse(b"SET k v"), Ok(Parsed::Incomplete));
        assert_eq!(parse(b"SET k v\r"), Ok(Parsed::Incomplete));
    }

    #[test]
    fn empty_inline_lines_are_skipped() {
        assert_eq!(parse(b"\n"), Ok(Parsed::Skip { consumed: 1 }));
        assert_eq!(parse(b"\r\n"), Ok(Parsed::Skip { consumed: 2 }));
        assert_eq!(parse(b"  \t \r\n"), Ok(Parsed::Skip { consumed: 6 }));
    }

    #[test]
    fn inline_quotes_group_arguments() {
        assert_eq!(
            parse(b"set \"a b\" 'c d' \"\" ''\n"),
            command(&[b"set", b"a b", b"c d", b"", b""], 22)
        );
        // A quote may open mid-argument, as in Redis.
        assert_eq!(parse(b"foo\"bar baz\"\n"), command(&[b"foobar baz"], 13));
        assert_eq!(parse(b"\"a\"\t'b'\n"), command(&[b"a", b"b"], 8));
    }

    #[test]
    fn double_quotes_take_c_escapes_and_hex() {
        let line = b"\"\\n\\r\\t\\b\\a\\\\\\\"\\x41\\xfF\\xzz\\q\"\n";
        assert_eq!(parse(line), command(&[b"\n\r\t\x08\x07\\\"A\xffxzzq"], line.len()));
        // `\x` with fewer than two hex digits keeps the `x`.
        assert_eq!(parse(b"\"\\x4\"\n"), command(&[b"x4"], 6));
    }

    #[test]
    fn single_quotes_take_only_escaped_quote() {
        let line = b"'it\\'s' 'a\\nb' 'a\\\\b'\n";
        assert_eq!(parse(line), command(&[b"it's", b"a\\nb", b"a\\\\b"], line.len()));
    }

    #[test]
    fn unbalanced_quotes_are_refused() {
        for line in [
            &b"set \"\"\"test-key\"\"\" test-value\r\n"[..],
            b"\"abc\n",
            b"'abc\n",
            b"\"abc\"def\n",
            b"'abc'def\n",
            b"\"abc\\\"\n",
            b"\"abc\\\n",
            // `\'` escapes the closing quote, so `'\\'` is never closed.
            b"'\\\\'\n",
        ] {
            assert_eq!(parse(line), Err(ProtocolError::UnbalancedQuotes), "{line:?}");
        }
    }

    #[test]
    fn inline_whitespace_follows_c_rules() {
        // Vertical tab and form feed separate only between arguments, not inside one.
        assert_eq!(parse(b"\x0b a\x0bb\x0c\n"), command(&[b"a\x0bb\x0c"], 7));
        // A closing quote may be followed by any C space.
        assert_eq!(parse(b"\"a\"\x0bb\n"), command(&[b"a", b"b"], 6));
        // A CR inside the line separates arguments.
        assert_eq!(parse(b"a\rb\r\n"), command(&[b"a", b"b"], 5));
        // Redis can never complete a line holding a NUL; it is refused at once.
        assert_eq!(parse(b"GET a\0b c\n"), Err(ProtocolError::InlineNul));
        assert_eq!(parse(b"GET \"a\0\"\n"), Err(ProtocolError::InlineNul));
    }

    #[test]
    fn inline_line_beyond_the_limit_is_refused() {
        let limit_bytes = REDIS_LIMITS.inline_bytes_max;
        let mut line = vec![b'a'; limit_bytes];
        assert_eq!(parse(&line), Ok(Parsed::Incomplete));
        line.push(b'\n');
        assert!(
            matches!(parse(&line), Ok(Parsed::Command { consumed, .. }) if consumed == limit_bytes + 1)
        );
        let mut long_line = vec![b'a'; limit_bytes + 1];
        assert_eq!(parse(&long_line), Err(ProtocolError::InlineTooBig));
        long_line.push(b'\n');
        assert_eq!(parse(&long_line), Err(ProtocolError::InlineTooBig));
        assert_eq!(parse(&vec![b'a'; 70 * 1024]), Err(ProtocolError::InlineTooBig));
    }

    /// Found by the coverage-guided fuzzer (fuzz/resp_request, within 9,352 inputs): an inline
    /// request split into more arguments than `multibulk_len_max`, which the multibulk form of
    /// the same request is refused for.
    #[test]
    fn an_inline_request_with_more_arguments_than_the_limit_is_refused() {
        let limits = SMALL_LIMITS;
        let at_limit = b"a b c d e f g h\r\n";
        assert!(matches!(
            parse_command(at_limit, &limits),
            Ok(Parsed::Command { ref args, .. }) if args.len() == limits.multibulk_len_max
        ));
        let over = b"a b c d e f g h i\r\n";
        assert_eq!(parse_command(over, &limits), Err(ProtocolError::InlineTooManyArguments));
        let found: &[u8] = b"\xf6 \xba q  4 \x01PING\t\t&\xf6 \xba q  4 \x0b\r\xd7\n";
        assert_eq!(parse_command(found, &limits), Err(ProtocolError::InlineTooManyArguments));
        assert_eq!(
            parse_command(b"*9\r\n", &limits),
            Err(ProtocolError::InvalidMultibulkLength),
            "the multibulk form is refused at the same count"
        );
    }

    // ---- resumed parsing ----

    /// Feeds `stream` in `chunk_bytes` pieces as a connection does, keeping one state; returns
    /// the requests and the bytes examined.
    fn parse_in_chunks(
        stream: &[u8],
        chunk_bytes: usize,
        resume: bool,
    ) -> (Vec<Vec<Vec<u8>>>, u64) {
        let limits = REDIS_LIMITS;
        let mut state = ParseState::default();
        let mut examined = 0;
        let (mut received, mut start) = (0, 0);
        let mut commands = Vec::new();
        while received < stream.len() {
            received = (received + chunk_bytes).min(stream.len());
            loop {
                if !resume {
                    // What 101534c did: every parse walks the request from its start.
                    examined += state.take_examined_bytes();
                    state = ParseState::default();
                }
                match parse_command_resumed(&stream[start..received], &limits, &mut state) {
                    Ok(Parsed::Command { args, consumed }) => {
                        commands.push(args.into_vec());
                        start += consumed;
                    }
                    Ok(Parsed::Skip { consumed }) => start += consumed,
                    Ok(Parsed::Incomplete) => break,
                    Err(err) => panic!("{err}"),
                }
            }
        }
        (commands, examined + state.examined_bytes())
    }

    /// The review's case: a request of many small arguments arriving 700 bytes at a time was
    /// walked from its start on every read (quadratic: 3.7 s of CPU for 7 MB). Resumed, each
    /// byte is examined a bounded number of times; the same stream parsed from scratch on
    /// every read examines hundreds of times more, which is what this counter would show
    /// without `ParseState`.
    #[test]
    fn a_request_split_into_small_reads_is_examined_a_bounded_number_of_times() {
        let args: Vec<Vec<u8>> = std::iter::once(b"DEL".to_vec())
            .chain((0..20_000).map(|i| format!("key:{i:08}").into_bytes()))
            .collect();
        let mut stream = encode_multibulk(&args);
        stream.extend_from_slice(b"PING\r\n");
        let (commands, examined) = parse_in_chunks(&stream, 700, true);
        assert_eq!(commands, vec![args.clone(), vec![b"PING".to_vec()]]);
        assert!(
            examined <= 3 * stream.len() as u64,
            "{examined} bytes examined for a {}-byte stream",
            stream.len()
        );
        let (again, examined_from_scratch) = parse_in_chunks(&stream, 700, false);
        assert_eq!(again, commands);
        assert!(examined_from_scratch > 100 * stream.len() as u64, "{examined_from_scratch}");
        // One large bulk, and one long inline line, one byte at a time.
        // One byte at a time, a call costs a few bytes of its own (re-reading a bulk's short
        // header), beyond each byte of the stream examined a bounded number of times.
        let per_call_bytes = 24;
        let big = encode_multibulk(&[b"SET".to_vec(), b"k".to_vec(), vec![b'v'; 100_000]]);
        let (_, examined) = parse_in_chunks(&big, 1, true);
        assert!(examined <= (3 + per_call_bytes) * big.len() as u64, "{examined}");
        let mut line = vec![b'a'; 60_000];
        line.extend_from_slice(b"\r\n");
        let (commands, examined) = parse_in_chunks(&line, 1, true);
        assert_eq!(commands.len(), 1);
        assert!(examined <= (3 + per_call_bytes) * line.len() as u64, "{examined}");
        let (_, examined_from_scratch) = parse_in_chunks(&line, 1, false);
        assert!(examined_from_scratch > 1000 * line.len() as u64, "{examined_from_scratch}");
    }

    // ---- properties ----

    fn proptest_config(cases: u32) -> ProptestConfig {
        // No regression files: a failure prints the shrunk case, which reproduces it.
        ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
    }

    /// Inputs that reach every state of the parser: raw bytes biased towards the protocol's
    /// syntax, sequences of protocol tokens, and valid requests with a few bytes corrupted.
    fn protocol_soup() -> impl Strategy<Value = Vec<u8>> {
        let syntax_byte = prop_oneof![
            any::<u8>(),
            prop::sample::select(b"*$\r\n0123456789-\"' \\xaf\t\0".to_vec()),
        ];
        let raw = prop::collection::vec(syntax_byte, 0..200);
        let token = prop_oneof![
            Just(b"*".to_vec()),
            Just(b"$".to_vec()),
            Just(b"\r\n".to_vec()),
            (-2i64..20).prop_map(|number| number.to_string().into_bytes()),
            prop::collection::vec(any::<u8>(), 0..4),
        ];
        let tokens = prop::collection::vec(token, 0..40).prop_map(|tokens| tokens.concat());
        let corrupted = (
            prop::collection::vec(args_strategy(), 1..3),
            prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        )
            .prop_map(|(requests, corruptions)| {
                let mut buf: Vec<u8> =
                    requests.iter().flat_map(|args| encode_multibulk(args)).collect();
                for (index, byte) in corruptions {
                    let position = index.index(buf.len());
                    buf[position] = byte;
                }
                buf
            });
        prop_oneof![raw, tokens, corrupted]
    }

    fn args_strategy() -> impl Strategy<Value = Vec<Vec<u8>>> {
        prop::collection::vec(prop::collection::vec(any::<u8>(), 0..40), 1..8)
    }

    proptest! {
        #![proptest_config(proptest_config(1024))]

        #[test]
        fn random_bytes_never_panic_and_never_overconsume(
            buf in protocol_soup(),
            small_limits in any::<bool>(),
        ) {
            let limits = if small_limits { SMALL_LIMITS } else { REDIS_LIMITS };
            match parse_command(&buf, &limits) {
                Ok(Parsed::Command { args, consumed }) => {
                    prop_assert!(consumed > 0 && consumed <= buf.len());
                    prop_assert!(!args.is_empty());
                    // A request's outcome depends on its own bytes only.
                    prop_assert_eq!(
                        parse_command(&buf[..consumed], &limits),
                        Ok(Parsed::Command { args, consumed })
                    );
                }
                Ok(Parsed::Skip { consumed }) => {
                    prop_assert!(consumed > 0 && consumed <= buf.len());
                    prop_assert_eq!(
                        parse_command(&buf[..consumed], &limits),
                        Ok(Parsed::Skip { consumed })
                    );
                }
                Ok(Parsed::Incomplete) | Err(_) => {}
            }
        }

        #[test]
        fn encoded_args_parse_back_and_every_prefix_is_incomplete(
            args in args_strategy(),
            trailing in prop::collection::vec(any::<u8>(), 0..16),
        ) {
            let request = encode_multibulk(&args);
            for end in 0..request.len() {
                prop_assert_eq!(parse(&request[..end]), Ok(Parsed::Incomplete));
            }
            let mut buf = request.clone();
            buf.extend_from_slice(&trailing);
            prop_assert_eq!(parse(&buf), Ok(Parsed::Command { args: Args::from_vec(args), consumed: request.len() }));
        }

        #[test]
        fn requests_split_anywhere_parse_identically(
            requests in prop::collection::vec(args_strategy(), 1..5),
            cut_seeds in prop::collection::vec(any::<prop::sample::Index>(), 0..8),
        ) {
            let stream: Vec<u8> = requests.iter().flat_map(|args| encode_multibulk(args)).collect();
            let mut cuts: Vec<usize> = cut_seeds.iter().map(|seed| seed.index(stream.len() + 1)).collect();
            cuts.push(0);
            cuts.push(stream.len());
            cuts.sort_unstable();
            let chunks = cuts.windows(2).map(|pair| &stream[pair[0]..pair[1]]);
            prop_assert_eq!(parse_stream(chunks, &REDIS_LIMITS), Ok(requests));
        }

        #[test]
        fn resumed_parsing_gives_what_parsing_from_scratch_gives(
            buf in protocol_soup(),
            cut_seeds in prop::collection::vec(any::<prop::sample::Index>(), 0..8),
            small_limits in any::<bool>(),
        ) {
            let limits = if small_limits { SMALL_LIMITS } else { REDIS_LIMITS };
            let mut cuts: Vec<usize> = cut_seeds.iter().map(|seed| seed.index(buf.len() + 1)).collect();
            cuts.push(buf.len());
            cuts.sort_unstable();
            let mut state = ParseState::default();
            let mut start = 0;
            'feed: for end in cuts {
                loop {
                    let resumed = parse_command_resumed(&buf[start..end], &limits, &mut state);
                    prop_assert_eq!(&resumed, &parse_command(&buf[start..end], &limits));
                    match resumed {
                        Ok(Parsed::Command { consumed, .. }) | Ok(Parsed::Skip { consumed }) => start += consumed,
                        Ok(Parsed::Incomplete) => continue 'feed,
                        Err(_) => break 'feed,
                    }
                }
            }
        }

        #[test]
        fn hex_quoted_inline_args_parse_back(args in args_strategy()) {
            // Quote every argument with every byte escaped, the inverse of the inline rules.
            let mut line = Vec::new();
            for arg in &args {
                line.push(b'"');
                for byte in arg {
                    line.extend_from_slice(format!("\\x{byte:02x}").as_bytes());
                }
                line.extend_from_slice(b"\" ");
            }
            line.extend_from_slice(b"\r\n");
            prop_assert_eq!(parse(&line), Ok(Parsed::Command { args: Args::from_vec(args), consumed: line.len() }));
        }
    }
}
