//! Redis's glob patterns (`stringmatchlen`): KEYS, SCAN MATCH, the SCAN forms of the
//! collections, PSUBSCRIBE and PUBSUB CHANNELS.

/// Redis's glob matching (`*`, `?`, `[...]` with ranges and `^`, `\` escapes), byte-wise.
pub fn glob_match(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    // Where to resume after the last `*`: (pattern position after it, text position).
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        if p < pattern.len() {
            match pattern[p] {
                b'*' => {
                    while p < pattern.len() && pattern[p] == b'*' {
                        p += 1;
                    }
                    if p == pattern.len() {
                        return true;
                    }
                    star = Some((p, t));
                    continue;
                }
                b'?' => {
                    p += 1;
                    t += 1;
                    continue;
                }
                b'[' => {
                    if let Some((matched, next)) = class_match(pattern, p, text[t]) {
                        if matched {
                            p = next;
                            t += 1;
                            continue;
                        }
                    }
                }
                b'\\' if p + 1 < pattern.len() => {
                    if pattern[p + 1] == text[t] {
                        p += 2;
                        t += 1;
                        continue;
                    }
                }
                byte => {
                    if byte == text[t] {
                        p += 1;
                        t += 1;
                        continue;
                    }
                }
            }
        }
        match star {
            Some((star_p, star_t)) => {
                p = star_p;
                t = star_t + 1;
                star = Some((star_p, star_t + 1));
            }
            None => return false,
        }
    }
    pattern[p..].iter().all(|&byte| byte == b'*')
}

/// Matches `byte` against the class starting at `pattern[at] == '['`: (matched, position after
/// the class). An unterminated class runs to the end of the pattern, as in Redis.
fn class_match(pattern: &[u8], at: usize, byte: u8) -> Option<(bool, usize)> {
    let mut p = at + 1;
    let negate = pattern.get(p) == Some(&b'^');
    if negate {
        p += 1;
    }
    let mut matched = false;
    while p < pattern.len() && pattern[p] != b']' {
        if pattern[p] == b'\\' && p + 1 < pattern.len() {
            matched |= pattern[p + 1] == byte;
            p += 2;
        } else if p + 2 < pattern.len() && pattern[p + 1] == b'-' && pattern[p + 2] != b']' {
            let (low, high) = (pattern[p].min(pattern[p + 2]), pattern[p].max(pattern[p + 2]));
            matched |= (low..=high).contains(&byte);
            p += 3;
        } else {
            matched |= pattern[p] == byte;
            p += 1;
        }
    }
    let next = if p < pattern.len() { p + 1 } else { p };
    Some((matched != negate, next))
}
