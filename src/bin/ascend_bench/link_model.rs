//! Modeled link figures: what a run's one-sided ops would take on an
//! Ascend link, from the CANN emulator's link model (`ASCEND_PD_EMU_LINK`,
//! table in `ascend_sys::link`: vendor-published throughput figures, not
//! measurements; nothing here has run on Ascend hardware).
//!
//! Each process has its own modeled link clock in the emulator. A worker
//! reads its process's counters ([`EmuLinkCounters`]) when it starts and
//! when it is done, and reports the difference (`link_stats` in its done
//! event); [`combine`] turns the reports of one mode into its figures:
//!
//! - Bytes and ops: summed over every process and both paths.
//! - Modeled time: links run in parallel, one per process (each process
//!   is one NPU with its own link), so the mode's modeled time is the
//!   largest modeled busy time of any process. A process's busy time is
//!   the sum over its paths (both paths queue on its one link).
//! - `modeled_gbps` = bytes / modeled time. With one issuing process (1P1D)
//!   it is that link's figure and never exceeds the table's ceiling; with
//!   several it is their aggregate, up to `modeled_links` x the ceiling.
//!
//! Wall time never enters: the figures depend only on the ops issued.

use anyhow::{anyhow, bail, Context, Result};
use ascend_pd::memory::npu::AclRuntime;
use ascend_sys::link::{Direction, Link, Path as LinkPath, Table, LINK_ENV};
use serde_json::{json, Value};
use std::ffi::{c_char, c_int, CStr};

/// The link `ASCEND_PD_EMU_LINK` selects from the built-in table, if any;
/// an unknown value is an error naming the known ones (said here, before
/// any worker starts, rather than by the emulator at the first batch).
pub fn selected() -> Result<Option<&'static Link>> {
    let value = match std::env::var(LINK_ENV) {
        Ok(v) => Some(v),
        Err(std::env::VarError::NotPresent) => None,
        Err(std::env::VarError::NotUnicode(v)) => bail!("{LINK_ENV}={v:?} is not UTF-8"),
    };
    Table::builtin()
        .select(value.as_deref())
        .map_err(|e| anyhow!("{e}"))
}

/// Whether `runtime` models `link`'s batches: only the CANN emulator has a
/// link model; real CANN ignores `ASCEND_PD_EMU_LINK`.
pub fn runtime_models(runtime: &AclRuntime) -> bool {
    runtime.acl().is_emulator()
}

/// One path's counters (or their change over a span).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PathCounters {
    /// One-sided ops accounted.
    pub ops: u64,
    /// Bytes they moved.
    pub bytes: u64,
    /// Modeled seconds the link was busy with them.
    pub busy_seconds: f64,
}

impl PathCounters {
    fn since(self, before: PathCounters) -> PathCounters {
        PathCounters {
            ops: self.ops.saturating_sub(before.ops),
            bytes: self.bytes.saturating_sub(before.bytes),
            busy_seconds: (self.busy_seconds - before.busy_seconds).max(0.0),
        }
    }

    fn json(self) -> Value {
        json!({"ops": self.ops, "bytes": self.bytes, "busy_seconds": self.busy_seconds})
    }

    fn from_json(v: &Value) -> Option<PathCounters> {
        Some(PathCounters {
            ops: v["ops"].as_u64()?,
            bytes: v["bytes"].as_u64()?,
            busy_seconds: v["busy_seconds"].as_f64()?,
        })
    }
}

/// One process's modeled-link counters, per path.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProcessCounters {
    /// The modeled link's name.
    pub link: String,
    /// HCCL's communication domain (`HcclBatchPut` / `HcclBatchGet`).
    pub comm: PathCounters,
    /// HIXL's client-server path.
    pub hixl: PathCounters,
}

impl ProcessCounters {
    /// The change from `before` to `self`.
    pub fn since(&self, before: &ProcessCounters) -> ProcessCounters {
        ProcessCounters {
            link: self.link.clone(),
            comm: self.comm.since(before.comm),
            hixl: self.hixl.since(before.hixl),
        }
    }

    /// Modeled seconds this process's link was busy (both paths share it).
    pub fn busy_seconds(&self) -> f64 {
        self.comm.busy_seconds + self.hixl.busy_seconds
    }

    /// `{"link", "comm": {ops, bytes, busy_seconds}, "hixl": {...}}`: a
    /// worker's `link_stats`.
    pub fn json(&self) -> Value {
        json!({"link": self.link, "comm": self.comm.json(), "hixl": self.hixl.json()})
    }

    /// Reads a worker's `link_stats`.
    pub fn from_json(v: &Value) -> Option<ProcessCounters> {
        Some(ProcessCounters {
            link: v["link"].as_str()?.to_string(),
            comm: PathCounters::from_json(&v["comm"])?,
            hixl: PathCounters::from_json(&v["hixl"])?,
        })
    }
}

/// One mode's (or one channel row's) modeled figures.
#[derive(Clone, Debug, PartialEq)]
pub struct Modeled {
    /// The link (`ASCEND_PD_EMU_LINK`).
    pub link: String,
    /// The path that carried the ops: `comm`, `hixl`, `comm+hixl`, or
    /// `none` (no op was issued).
    pub path: String,
    /// `write` (push: puts) or `read` (pull: gets).
    pub direction: Direction,
    /// Ops and bytes, every process.
    pub ops: u64,
    pub bytes: u64,
    /// Processes that issued ops (each its own link).
    pub links: usize,
    /// The mode's modeled time: the largest busy time of any process.
    pub seconds: f64,
    /// bytes / seconds, in GB/s; `None` without ops.
    pub gbps: Option<f64>,
    /// The table's largest-op figure for the path and direction, one
    /// link; `None` without ops. With both paths, the larger of the two.
    pub ceiling_gbps: Option<f64>,
}

impl Modeled {
    /// `gbps` over what the issuing links could give at most
    /// (`links` x `ceiling_gbps`).
    pub fn ratio(&self) -> Option<f64> {
        let (g, c) = (self.gbps?, self.ceiling_gbps?);
        (c > 0.0 && self.links > 0).then(|| g / (c * self.links as f64))
    }

    /// `write` or `read`.
    pub fn direction_name(&self) -> &'static str {
        match self.direction {
            Direction::Write => "write",
            Direction::Read => "read",
        }
    }

    /// The JSON fields (merged into a mode's or a channel row's object).
    pub fn json_fields(&self) -> serde_json::Map<String, Value> {
        let r = |x: f64| (x * 1000.0).round() / 1000.0;
        let v = json!({
            "link_model": self.link,
            "modeled_path": self.path,
            "modeled_direction": self.direction_name(),
            "modeled_ops": self.ops,
            "modeled_bytes": self.bytes,
            "modeled_links": self.links,
            "modeled_seconds": self.seconds,
            "modeled_gbps": self.gbps.map(r),
            "link_ceiling_gbps": self.ceiling_gbps,
            "modeled_ratio": self.ratio().map(r),
        });
        match v {
            Value::Object(m) => m,
            _ => unreachable!("json! of an object"),
        }
    }
}

/// The direction a mode's bytes take on the link: push modes write (the
/// sender puts), pull modes read (the receiver gets).
pub fn mode_direction(mode: &str) -> Direction {
    match mode.starts_with("push") {
        true => Direction::Write,
        false => Direction::Read,
    }
}

/// A mode's figures from its processes' counters (see the module
/// documentation for how processes combine).
pub fn combine(link: &Link, direction: Direction, processes: &[ProcessCounters]) -> Modeled {
    let total = |f: fn(&PathCounters) -> u64| -> u64 {
        processes.iter().map(|p| f(&p.comm) + f(&p.hixl)).sum()
    };
    let (ops, bytes) = (total(|c| c.ops), total(|c| c.bytes));
    let used = |f: fn(&ProcessCounters) -> &PathCounters| processes.iter().any(|p| f(p).ops > 0);
    let paths: Vec<LinkPath> = [
        (used(|p| &p.comm), LinkPath::Comm),
        (used(|p| &p.hixl), LinkPath::Hixl),
    ]
    .into_iter()
    .filter_map(|(u, p)| u.then_some(p))
    .collect();
    let seconds = processes
        .iter()
        .map(ProcessCounters::busy_seconds)
        .fold(0.0, f64::max);
    let ceiling = paths
        .iter()
        .filter_map(|&p| link.ceiling_gbps(p, direction))
        .reduce(f64::max);
    Modeled {
        link: link.name().to_string(),
        path: match paths.as_slice() {
            [] => "none".into(),
            [LinkPath::Comm] => "comm".into(),
            [LinkPath::Hixl] => "hixl".into(),
            _ => "comm+hixl".into(),
        },
        direction,
        ops,
        bytes,
        links: processes
            .iter()
            .filter(|p| p.comm.ops + p.hixl.ops > 0)
            .count(),
        seconds,
        gbps: (seconds > 0.0 && bytes > 0).then(|| bytes as f64 / seconds / 1e9),
        ceiling_gbps: ceiling,
    }
}

/// The emulator's `AscendEmuLinkPathStats` (ascend-sys/emu/src/ffi.rs),
/// field for field.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RawPathStats {
    ops: u64,
    bytes: u64,
    busy_seconds: f64,
}

/// The emulator's `AscendEmuLinkStats`, field for field.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RawLinkStats {
    link: [c_char; 32],
    modeled_end_seconds: f64,
    comm: RawPathStats,
    hixl: RawPathStats,
}

// The emulator checks the same sizes on its side.
const _: () = assert!(std::mem::size_of::<RawLinkStats>() == 88);

type StatsFn = unsafe extern "C" fn(*mut RawLinkStats, c_int) -> c_int;

/// This process's modeled-link counters, read through the emulator library
/// the CANN loader mapped. (The bench binary also links a copy of the
/// emulator crate, whose counters are separate and never move: only the
/// loaded library's count the process's batches.)
pub struct EmuLinkCounters {
    stats: StatsFn,
    /// Keeps the library (and so `stats`) loaded.
    _lib: libloading::Library,
}

impl EmuLinkCounters {
    /// The counters of the emulator `runtime` loaded, when it is the
    /// emulator and `ASCEND_PD_EMU_LINK` selects a link; `None` otherwise.
    pub fn open(runtime: &AclRuntime) -> Result<Option<EmuLinkCounters>> {
        if selected()?.is_none() || !runtime_models(runtime) {
            return Ok(None);
        }
        let acl = runtime.acl();
        let path = acl
            .one_sided_library_path()
            .unwrap_or_else(|| acl.library_path());
        // SAFETY: the file is the emulator library the loader already
        // mapped (its initialisers ran); this takes another reference to the
        // same mapping, kept until `self` drops.
        let lib = unsafe { libloading::Library::new(path) }
            .with_context(|| format!("opening {} for its link counters", path.display()))?;
        // SAFETY: the emulator exports `ascend_emu_link_stats` with exactly
        // StatsFn's signature; `lib` outlives the pointer (held in `self`).
        let stats: StatsFn = unsafe { lib.get::<StatsFn>(b"ascend_emu_link_stats\0") }
            .with_context(|| {
                format!(
                    "{} has no ascend_emu_link_stats (an emulator older than its link model?)",
                    path.display()
                )
            })
            .map(|s| *s)?;
        Ok(Some(EmuLinkCounters { stats, _lib: lib }))
    }

    /// The counters now (never reset: callers take differences).
    pub fn read(&self) -> Result<ProcessCounters> {
        let mut raw = RawLinkStats::default();
        // SAFETY: `raw` is a writable struct with the emulator's layout
        // (size checked above); reset 0 leaves the counters as they are.
        let rc = unsafe { (self.stats)(&mut raw, 0) };
        if rc != 0 {
            bail!("ascend_emu_link_stats failed ({rc}); is {LINK_ENV} a known link?");
        }
        // SAFETY: the emulator leaves the name NUL-terminated in the array
        // (at most 31 bytes are written), and a zeroed array is "".
        let name = unsafe { CStr::from_ptr(raw.link.as_ptr()) };
        let path = |p: RawPathStats| PathCounters {
            ops: p.ops,
            bytes: p.bytes,
            busy_seconds: p.busy_seconds,
        };
        Ok(ProcessCounters {
            link: name.to_string_lossy().into_owned(),
            comm: path(raw.comm),
            hixl: path(raw.hixl),
        })
    }
}

/// A worker's view over its life: the counters when it started, and their
/// change when it reports.
pub struct LinkProbe {
    counters: EmuLinkCounters,
    start: ProcessCounters,
}

impl LinkProbe {
    /// Starts counting, when `runtime` models a link (see
    /// [`EmuLinkCounters::open`]).
    pub fn start(runtime: Option<&AclRuntime>) -> Result<Option<LinkProbe>> {
        let Some(rt) = runtime else { return Ok(None) };
        let Some(counters) = EmuLinkCounters::open(rt)? else {
            return Ok(None);
        };
        let start = counters.read()?;
        Ok(Some(LinkProbe { counters, start }))
    }

    /// The change since [`LinkProbe::start`] (or the last `restart`).
    pub fn delta(&self) -> Result<ProcessCounters> {
        Ok(self.counters.read()?.since(&self.start))
    }

    /// Counts from now on.
    pub fn restart(&mut self) -> Result<()> {
        self.start = self.counters.read()?;
        Ok(())
    }
}

/// A worker's `link_stats` value: its counters' change, or null without a
/// modeled link (or when they cannot be read: said on stderr, and the
/// parent then reports no modeled figures for the mode).
pub fn report_json(probe: Option<&LinkProbe>) -> Value {
    match probe.map(LinkProbe::delta) {
        None => Value::Null,
        Some(Ok(d)) => d.json(),
        Some(Err(e)) => {
            eprintln!("link model: {e:#}");
            Value::Null
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a2_roce() -> &'static Link {
        Table::builtin().link("a2-roce").unwrap()
    }

    fn process(comm: (u64, u64, f64), hixl: (u64, u64, f64)) -> ProcessCounters {
        let p = |(ops, bytes, busy_seconds)| PathCounters {
            ops,
            bytes,
            busy_seconds,
        };
        ProcessCounters {
            link: "a2-roce".into(),
            comm: p(comm),
            hixl: p(hixl),
        }
    }

    #[test]
    fn one_issuing_process_gives_its_links_rate_and_the_ceiling_of_its_direction() {
        let sender = process((64, 8 << 20, (8 << 20) as f64 / 5.7e9), (0, 0, 0.0));
        let receiver = ProcessCounters::default();
        let m = combine(a2_roce(), Direction::Write, &[sender, receiver]);
        assert_eq!(
            (m.path.as_str(), m.ops, m.bytes, m.links),
            ("comm", 64, 8 << 20, 1)
        );
        assert!((m.gbps.unwrap() - 5.7).abs() < 1e-9);
        assert_eq!(m.ceiling_gbps, Some(19.8));
        assert!((m.ratio().unwrap() - 5.7 / 19.8).abs() < 1e-12);
        // a2-hccs comm reads have their own ceiling.
        let hccs = Table::builtin().link("a2-hccs").unwrap();
        let m = combine(hccs, Direction::Read, &[process((1, 1, 1e-9), (0, 0, 0.0))]);
        assert_eq!(m.ceiling_gbps, Some(27.3));
        assert_eq!(m.direction_name(), "read");
    }

    #[test]
    fn parallel_processes_take_the_longest_busy_time_and_sum_their_bytes() {
        let a = process((10, 1_000_000_000, 0.1), (0, 0, 0.0));
        let b = process((10, 1_000_000_000, 0.2), (0, 0, 0.0));
        let m = combine(a2_roce(), Direction::Read, &[a, b]);
        assert_eq!(m.seconds, 0.2);
        assert_eq!(m.links, 2);
        assert!((m.gbps.unwrap() - 10.0).abs() < 1e-9);
        // Against two links' ceiling.
        assert!((m.ratio().unwrap() - 10.0 / 39.6).abs() < 1e-12);
        // Both paths of one process queue on its one link: their busy
        // times add; the ceiling is the larger path's.
        let both = process((1, 500, 0.3), (1, 500, 0.4));
        let m = combine(a2_roce(), Direction::Write, &[both]);
        assert_eq!(m.path, "comm+hixl");
        assert!((m.seconds - 0.7).abs() < 1e-12);
        assert_eq!(m.ceiling_gbps, Some(23.7));
    }

    #[test]
    fn no_ops_give_no_rate_and_no_ceiling() {
        let m = combine(a2_roce(), Direction::Write, &[ProcessCounters::default()]);
        assert_eq!(
            (m.path.as_str(), m.gbps, m.ceiling_gbps),
            ("none", None, None)
        );
        assert_eq!(m.ratio(), None);
        let f = m.json_fields();
        assert_eq!(f["link_model"], "a2-roce");
        assert_eq!(f["modeled_gbps"], Value::Null);
    }

    #[test]
    fn counters_round_trip_through_a_workers_report_and_subtract() {
        let before = process((3, 300, 0.5), (1, 10, 0.25));
        let after = process((5, 800, 1.5), (1, 10, 0.25));
        let d = after.since(&before);
        assert_eq!(d, process((2, 500, 1.0), (0, 0, 0.0)));
        assert_eq!(ProcessCounters::from_json(&d.json()), Some(d));
        assert_eq!(ProcessCounters::from_json(&Value::Null), None);
        assert_eq!(mode_direction("push-layerwise"), Direction::Write);
        assert_eq!(mode_direction("pull-delay-offload"), Direction::Read);
    }
}
