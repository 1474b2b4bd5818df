//! The `log` facade → a C callback. Rust users pick their own logger; a C
//! or Python host installs this one with `apd_set_log_callback`.

use super::{ApdLogCallback, Failure, APD_ERR_INVALID_ARGUMENT};
use std::ffi::{c_void, CString};
use std::sync::RwLock;

#[derive(Clone, Copy)]
struct Sink {
    callback:
        unsafe extern "C" fn(i32, *const std::ffi::c_char, *const std::ffi::c_char, *mut c_void),
    /// The host's pointer, handed back untouched.
    user_data: usize,
}

static SINK: RwLock<Option<Sink>> = RwLock::new(None);

struct Bridge;

static BRIDGE: Bridge = Bridge;

impl log::Log for Bridge {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let sink = *SINK.read().unwrap_or_else(|p| p.into_inner());
        let Some(sink) = sink else { return };
        let text = |s: String| CString::new(s.replace('\0', "\\0")).unwrap_or_default();
        let target = text(record.target().to_string());
        let message = text(record.args().to_string());
        // SAFETY: the host gave this callback for exactly this call shape;
        // both strings live until it returns.
        unsafe {
            (sink.callback)(
                record.level() as i32,
                target.as_ptr(),
                message.as_ptr(),
                sink.user_data as *mut c_void,
            )
        };
    }

    fn flush(&self) {}
}

/// Installs (or, with `None`, removes) the callback.
pub(super) fn set(
    callback: ApdLogCallback,
    user_data: *mut c_void,
    max_level: i32,
) -> Result<(), Failure> {
    let level = match max_level {
        0 => log::LevelFilter::Off,
        1 => log::LevelFilter::Error,
        2 => log::LevelFilter::Warn,
        3 => log::LevelFilter::Info,
        4 => log::LevelFilter::Debug,
        5 => log::LevelFilter::Trace,
        other => {
            return Err(Failure::new(
                APD_ERR_INVALID_ARGUMENT,
                format!("argument `max_level` is {other}: pass 0 (off) to 5 (trace)"),
            ))
        }
    };
    let mut sink = SINK.write().unwrap_or_else(|p| p.into_inner());
    if callback.is_some() && log::set_logger(&BRIDGE).is_err() {
        // Already ours (a second call), or a Rust host's logger.
        let ours = std::ptr::eq(
            log::logger() as *const dyn log::Log as *const (),
            &BRIDGE as *const Bridge as *const (),
        );
        if !ours {
            return Err(Failure::new(
                APD_ERR_INVALID_ARGUMENT,
                "this process already has a Rust logger: a Rust host configures logging \
                 through the log crate instead of a callback",
            ));
        }
    }
    *sink = callback.map(|callback| Sink {
        callback,
        user_data: user_data as usize,
    });
    log::set_max_level(if sink.is_some() {
        level
    } else {
        log::LevelFilter::Off
    });
    Ok(())
}
