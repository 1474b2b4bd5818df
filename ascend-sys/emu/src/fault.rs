//! Faults a test injects into asynchronous copies (emulator only, through
//! `ascend_emu_inject_copy_fault`): so that the product's handling of a
//! copy refused part-way through a batch, or of a stream or event that
//! reports a failure, can be exercised without a broken device.
//!
//! A fault is scoped to an address range, so tests that run at once in one
//! process (one emulator) each fault only their own memory.

use std::sync::Mutex;

use crate::status::{Failure, ACL_ERROR_INVALID_PARAM, ACL_ERROR_RT_INTERNAL_ERROR};
use crate::stream::Copy;

/// Where an injected fault strikes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FaultPoint {
    /// `aclrtMemcpyAsync` refuses the copy: the call returns the error and
    /// nothing is queued.
    Queue,
    /// The copy is queued but fails on its stream without moving a byte:
    /// the stream's next synchronisation reports the failure, and so does
    /// every event recorded on the stream after it until then.
    Run,
    /// The copy is queued and runs, but the stream's next synchronisations
    /// (as many as the fault's count; and the next one of each event
    /// recorded on it meanwhile) fail at once, before the stream's work
    /// has run: a wait that errs or times out while the device still
    /// copies. The first copy over the range uses the whole count.
    Sync,
}

#[derive(Debug)]
struct CopyFault {
    addr: usize,
    len: usize,
    at: FaultPoint,
    /// Copies still to fail.
    times: u32,
}

static FAULTS: Mutex<Vec<CopyFault>> = Mutex::new(Vec::new());

fn faults() -> std::sync::MutexGuard<'static, Vec<CopyFault>> {
    FAULTS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Arms a fault: the next `times` asynchronous copies whose source or
/// destination overlaps `[addr, addr + len)` fail at `at` (`1`: queue,
/// `2`: run; `3`: the first such copy's stream fails its next `times`
/// synchronisations). `times == 0` clears every fault over exactly that
/// range.
pub(crate) fn inject(addr: u64, len: u64, at: i32, times: u32) -> Result<(), Failure> {
    let (Ok(addr), Ok(len)) = (usize::try_from(addr), usize::try_from(len)) else {
        return Err(Failure::acl(ACL_ERROR_INVALID_PARAM, "range out of bounds"));
    };
    if len == 0 || addr.checked_add(len).is_none() {
        return Err(Failure::acl(
            ACL_ERROR_INVALID_PARAM,
            format!("cannot fault {len} bytes at {addr:#x}"),
        ));
    }
    let mut f = faults();
    if times == 0 {
        f.retain(|x| (x.addr, x.len) != (addr, len));
        return Ok(());
    }
    let at = match at {
        1 => FaultPoint::Queue,
        2 => FaultPoint::Run,
        3 => FaultPoint::Sync,
        other => {
            return Err(Failure::acl(
                ACL_ERROR_INVALID_PARAM,
                format!("unknown fault point {other} (1: queue, 2: run, 3: sync)"),
            ))
        }
    };
    f.push(CopyFault {
        addr,
        len,
        at,
        times,
    });
    Ok(())
}

/// The failure an armed fault gives `copy` at `at`, and how often (one
/// copy, or for [`FaultPoint::Sync`] that many synchronisations), using
/// the fault up; `None` when no fault covers it.
pub(crate) fn strike(copy: &Copy, at: FaultPoint) -> Option<(Failure, u32)> {
    let overlaps = |a: usize, n: usize, f: &CopyFault| a < f.addr + f.len && f.addr < a + n;
    let mut f = faults();
    let i = f.iter().position(|x| {
        x.at == at && (overlaps(copy.dst, copy.len, x) || overlaps(copy.src, copy.len, x))
    })?;
    let times = match at {
        FaultPoint::Sync => std::mem::take(&mut f[i].times),
        FaultPoint::Queue | FaultPoint::Run => {
            f[i].times -= 1;
            1
        }
    };
    if f[i].times == 0 {
        f.swap_remove(i);
    }
    let when = match at {
        FaultPoint::Queue => "refused when queued",
        FaultPoint::Run => "failed on its stream",
        FaultPoint::Sync => "was queued, and the stream's synchronisation failed before it ran",
    };
    let failure = Failure::acl(
        ACL_ERROR_RT_INTERNAL_ERROR,
        format!(
            "injected fault: the copy of {} bytes {:#x} -> {:#x} {when}",
            copy.len, copy.src, copy.dst
        ),
    );
    Some((failure, times))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(dst: usize, src: usize, len: usize) -> Copy {
        Copy { dst, src, len }
    }

    /// Faults strike only copies touching their range, as often as armed
    /// (a sync fault gives its whole count to the first copy), and can be
    /// cleared; nonsense is refused.
    #[test]
    fn faults_strike_their_range_as_often_as_armed() {
        let base: usize = 0x7000_0000_0000;
        let at = base as u64;
        inject(at, 64, 1, 2).unwrap();
        assert!(strike(&copy(base + 64, 0x10, 8), FaultPoint::Queue).is_none());
        assert!(strike(&copy(base + 60, 0x10, 8), FaultPoint::Run).is_none());
        let (f, n) = strike(&copy(0x10, base + 60, 8), FaultPoint::Queue).unwrap();
        assert!(f.message.contains("refused when queued") && n == 1, "{f}");
        assert!(strike(&copy(base, 0x10, 1), FaultPoint::Queue).is_some());
        assert!(
            strike(&copy(base, 0x10, 1), FaultPoint::Queue).is_none(),
            "used up"
        );

        inject(at, 64, 3, 4).unwrap();
        let (f, n) = strike(&copy(base, 0x10, 1), FaultPoint::Sync).unwrap();
        assert!(
            f.message.contains("synchronisation failed") && n == 4,
            "{f}"
        );
        assert!(strike(&copy(base, 0x10, 1), FaultPoint::Sync).is_none());

        inject(at, 64, 2, 5).unwrap();
        inject(at, 64, 0, 0).unwrap();
        assert!(
            strike(&copy(base, 0x10, 1), FaultPoint::Run).is_none(),
            "cleared"
        );
        assert!(inject(at, 0, 2, 1).is_err());
        assert!(inject(at, 64, 7, 1).is_err());
    }
}
