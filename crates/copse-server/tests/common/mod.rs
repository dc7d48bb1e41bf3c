//! What the server's integration tests share.

/// `args` as one RESP multibulk request, as a client sends it.
pub fn encode_request(args: &[&[u8]]) -> Vec<u8> {
    let mut request = format!("*{}\r\n", args.len()).into_bytes();
    for arg in args {
        request.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        request.extend_from_slice(arg);
        request.extend_from_slice(b"\r\n");
    }
    request
}
