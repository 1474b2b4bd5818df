//! Picking loopback ports for processes started on one host (the bench's
//! `run` and `soak`, the tests).
//!
//! Binding port 0 and closing the listener hands back a port the kernel
//! takes from its ephemeral range, the same range every outgoing
//! connection draws its source port from, and the next `bind(0)` may get
//! the very same port. Between picking the port and the side channel
//! binding it, a ZMQ connect of a neighbour (or another pick) can take it,
//! and the bind fails with "address in use". So ports are picked outside
//! the ephemeral range, never twice in one process, from an offset that
//! differs between processes, and only after a bind proves them free.

use std::net::TcpListener;
use std::ops::Range;
use std::sync::atomic::{AtomicU32, Ordering};

/// Candidates walked so far by this process.
static WALKED: AtomicU32 = AtomicU32::new(0);

/// The kernel's ephemeral range (Linux's default when unreadable).
fn ephemeral() -> Range<u32> {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| {
            let mut it = s.split_whitespace().map(|v| v.parse::<u32>().ok());
            Some(it.next()??..it.next()?? + 1)
        })
        .unwrap_or(32768..61000)
}

/// The ports to pick from: the larger stretch of 10000..65536 outside
/// `eph`.
fn candidates(eph: &Range<u32>) -> Range<u32> {
    let below = 10_000..eph.start.max(10_000);
    let above = eph.end.clamp(10_000, 65_536)..65_536;
    if below.len() >= above.len() {
        below
    } else {
        above
    }
}

/// Where this process starts in `span` ports: apart for different pids.
fn start(span: u32) -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    (std::process::id().wrapping_mul(7919) ^ nanos) % span.max(1)
}

/// A loopback port that is free now, outside the ephemeral range, and not
/// handed out before by this process. Errors only when no port in the
/// range could be bound.
pub fn loopback_port() -> std::io::Result<u16> {
    static OFFSET: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    let range = candidates(&ephemeral());
    let span = range.len() as u32;
    if span == 0 {
        // No room outside the ephemeral range: the kernel's pick.
        return Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port());
    }
    let offset = *OFFSET.get_or_init(|| start(span));
    for _ in 0..span {
        let n = WALKED.fetch_add(1, Ordering::Relaxed);
        let port = range.start + (offset + n) % span;
        if TcpListener::bind(("127.0.0.1", port as u16)).is_ok() {
            return Ok(port as u16);
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        format!(
            "no free loopback port in {}..{} (outside the ephemeral range)",
            range.start, range.end
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_outside_the_ephemeral_range_and_never_repeat() {
        let eph = ephemeral();
        // A host whose ephemeral range leaves no room gets the kernel's picks.
        let outside = !candidates(&eph).is_empty();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..200 {
            let p = loopback_port().unwrap() as u32;
            assert!(
                !outside || !eph.contains(&p),
                "{p} is in the ephemeral range {eph:?}"
            );
            assert!(seen.insert(p) || !outside, "{p} handed out twice");
        }
    }

    #[test]
    fn the_larger_stretch_outside_the_ephemeral_range_is_used() {
        assert_eq!(candidates(&(32768..61000)), 10_000..32768);
        assert_eq!(candidates(&(10_000..20_000)), 20_000..65_536);
        assert_eq!(candidates(&(1024..65_536)).len(), 0);
    }
}
