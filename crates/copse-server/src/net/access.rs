//! Who may talk to the server at all: protected mode (Redis's), for the Redis port and the
//! metrics endpoint.
//!
//! With protected mode on (the default) and no password set, only loopback peers are served:
//! a server bound to a public address by mistake answers the rest with Redis's `-DENIED` error
//! and closes, instead of serving every command (CONFIG, FLUSHALL, ...) to any host. The
//! metrics endpoint has no password at all, so with protected mode on it serves loopback peers
//! only, password or not. Both decisions are pure functions of the peer's address and the
//! settings, so they are tested directly over addresses (tests below) as well as over sockets.

use std::net::IpAddr;

/// Redis's protected-mode error, sent on accept: its first two sentences byte for byte (so
/// tools that recognise Redis's text recognise copse's); the remedies are copse's own (no
/// CONFIG REWRITE; the TOML setting and the flag).
pub const PROTECTED_MODE_DENIED: &str = "-DENIED Redis is running in protected mode because protected mode is enabled and no password is set for the default user. In this mode connections are only accepted from the loopback interface. If you want to connect from external computers to copse you may adopt one of the following solutions: 1) Just disable protected mode sending the command 'CONFIG SET protected-mode no' from the loopback interface by connecting to copse from the same host the server is running, however MAKE SURE copse is not publicly accessible from internet if you do so. 2) Alternatively you can disable protected mode in the configuration file (protected_mode = false) and restart the server. 3) If you started the server manually just for testing, restart it with the '--protected-mode no' option. 4) Set up an authentication password for the default user (requirepass, requirepass_file or COPSE_REQUIREPASS). NOTE: You only need to do one of the above things in order for the server to start accepting connections from the outside.\r\n";

/// The metrics endpoint's answer to a peer protected mode refuses.
pub const METRICS_DENIED: &str = "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nContent-Length: 91\r\nConnection: close\r\n\r\ncopse: protected mode serves metrics to loopback peers only (protected_mode = false opens)\n";

/// Whether `peer` is this host's loopback (127.0.0.0/8, ::1, or either mapped into IPv6).
pub fn is_loopback(peer: IpAddr) -> bool {
    match peer {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

/// Whether the Redis port refuses `peer`: protected mode on, no password, not loopback.
pub fn refuses_client(protected_mode: bool, password_set: bool, peer: IpAddr) -> bool {
    protected_mode && !password_set && !is_loopback(peer)
}

/// Whether the metrics endpoint refuses `peer`: it has no password, so protected mode alone
/// decides.
pub fn refuses_metrics(protected_mode: bool, peer: IpAddr) -> bool {
    protected_mode && !is_loopback(peer)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUTSIDE: [&str; 6] =
        ["192.0.2.7", "10.0.0.1", "0.0.0.0", "fd00::2", "::ffff:192.0.2.7", "169.254.1.1"];
    const LOOPBACK: [&str; 4] = ["127.0.0.1", "127.255.0.9", "::1", "::ffff:127.0.0.1"];

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn protected_mode_without_a_password_serves_loopback_peers_only() {
        for peer in LOOPBACK {
            assert!(!refuses_client(true, false, ip(peer)), "{peer}");
        }
        for peer in OUTSIDE {
            assert!(refuses_client(true, false, ip(peer)), "{peer}");
            assert!(!refuses_client(true, true, ip(peer)), "a password opens {peer}");
            assert!(!refuses_client(false, false, ip(peer)), "protected-mode no opens {peer}");
        }
    }

    #[test]
    fn metrics_serve_outside_peers_only_with_protected_mode_off() {
        for peer in LOOPBACK {
            assert!(!refuses_metrics(true, ip(peer)), "{peer}");
        }
        for peer in OUTSIDE {
            assert!(refuses_metrics(true, ip(peer)), "{peer}");
            assert!(!refuses_metrics(false, ip(peer)), "{peer}");
        }
    }

    #[test]
    fn the_refusals_are_well_formed() {
        assert!(PROTECTED_MODE_DENIED.starts_with("-DENIED Redis is running in protected mode because protected mode is enabled and no password is set for the default user. In this mode connections are only accepted from the loopback interface. "));
        assert!(PROTECTED_MODE_DENIED.ends_with("\r\n"));
        assert_eq!(PROTECTED_MODE_DENIED.matches("\r\n").count(), 1);
        let (head, body) = METRICS_DENIED.split_once("\r\n\r\n").unwrap();
        assert!(head.contains(&format!("Content-Length: {}", body.len())), "{head}");
    }
}
