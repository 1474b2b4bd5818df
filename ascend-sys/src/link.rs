//! The link table: how fast each NPU link moves one-sided ops of a given
//! size, from vendor-published throughput figures (`links.csv` next to this
//! crate's `Cargo.toml`, embedded at build time). The CANN emulator models
//! its batches' time with it (`ascend_emu::link`, selected by
//! `ASCEND_PD_EMU_LINK`), and ascend-pd prices a load's op sizes with it to
//! choose between a direct and a staged read.
//!
//! What the curves assume, exactly:
//!
//! - The table gives, per link, path and direction, the throughput (GB/s,
//!   taken as 10^9 bytes per second) of a long stream of ops of one size.
//!   That figure already includes each op's fixed overhead, so one op of
//!   `n` bytes takes `n / rate(n)` seconds and ops on one link run back to
//!   back with no further gap.
//! - Between two of the table's op sizes, `rate` is linear in `log2(size)`.
//!   Above the largest size it is the largest size's rate. Below the
//!   smallest size an op takes as long as an op of the smallest size (a
//!   per-op floor), so its rate falls in proportion to its size. An op of
//!   0 bytes takes no time.
//! - Direction: a put is a write, a get a read; a table row marked `any`
//!   serves both.
//!
//! These are vendor figures; nothing in this project has run on Ascend
//! hardware.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::OnceLock;

/// The environment variable that selects the modeled link.
pub const LINK_ENV: &str = "ASCEND_PD_EMU_LINK";

/// The link table as shipped (see the file's header for its source).
pub const TABLE_CSV: &str = include_str!("../links.csv");

/// Which software path moves the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Path {
    /// The HCCL communication domain (`HcclBatchPut` / `HcclBatchGet`).
    Comm,
    /// HIXL's `hixl_cs` path.
    Hixl,
}

impl Path {
    fn parse(s: &str) -> Option<Path> {
        match s {
            "comm" => Some(Path::Comm),
            "hixl" => Some(Path::Hixl),
            _ => None,
        }
    }
}

/// Which way the bytes go, seen from the side that issues the op.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Direction {
    /// Local to remote (a put).
    Write,
    /// Remote to local (a get).
    Read,
}

/// Throughput by op size for one link, path and direction.
#[derive(Debug, Clone, PartialEq)]
pub struct Curve {
    /// (op size in bytes, GB/s), sizes strictly increasing, at least one.
    points: Vec<(u64, f64)>,
}

impl Curve {
    fn new(points: Vec<(u64, f64)>) -> Result<Curve, String> {
        if points.is_empty() {
            return Err("a curve needs at least one point".into());
        }
        for w in points.windows(2) {
            if w[0].0 >= w[1].0 {
                return Err("op sizes must increase".into());
            }
        }
        if let Some((s, r)) = points
            .iter()
            .find(|(s, r)| *s == 0 || !r.is_finite() || *r <= 0.0)
        {
            return Err(format!("bad point: {r} GB/s at {s} bytes"));
        }
        Ok(Curve { points })
    }

    /// The table's points: (op size in bytes, GB/s).
    pub fn points(&self) -> &[(u64, f64)] {
        &self.points
    }

    /// The modeled throughput (GB/s) of ops of `n` bytes; see the module
    /// documentation for the interpolation. 0 for `n == 0`.
    pub fn gbps(&self, n: u64) -> f64 {
        if n == 0 {
            return 0.0;
        }
        let (s0, r0) = self.points[0];
        if n <= s0 {
            // Floor: the op takes as long as one of s0 bytes.
            return r0 * n as f64 / s0 as f64;
        }
        let (s_last, r_last) = self.points[self.points.len() - 1];
        if n >= s_last {
            return r_last;
        }
        let i = self.points.partition_point(|(s, _)| *s <= n);
        let (sa, ra) = self.points[i - 1];
        let (sb, rb) = self.points[i];
        let (x, xa, xb) = ((n as f64).log2(), (sa as f64).log2(), (sb as f64).log2());
        ra + (rb - ra) * (x - xa) / (xb - xa)
    }

    /// Modeled seconds of one op of `n` bytes: `n / gbps(n)`.
    pub fn op_seconds(&self, n: u64) -> f64 {
        if n == 0 {
            return 0.0;
        }
        n as f64 / (self.gbps(n) * 1e9)
    }

    /// The figure at the largest op size: the most this curve ever gives.
    pub fn ceiling_gbps(&self) -> f64 {
        self.points[self.points.len() - 1].1
    }
}

/// One modeled link: a curve per path and direction.
#[derive(Debug, Clone, PartialEq)]
pub struct Link {
    name: String,
    curves: BTreeMap<(Path, Direction), Curve>,
}

impl Link {
    /// The name `ASCEND_PD_EMU_LINK` selects it by.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The curve for a path and direction, if the table has one.
    pub fn curve(&self, path: Path, dir: Direction) -> Option<&Curve> {
        self.curves.get(&(path, dir))
    }

    /// Modeled seconds of one op of `n` bytes (`None`: no such curve).
    pub fn op_seconds(&self, path: Path, dir: Direction, n: u64) -> Option<f64> {
        self.curve(path, dir).map(|c| c.op_seconds(n))
    }

    /// The link's largest-op figure on a path and direction (GB/s).
    pub fn ceiling_gbps(&self, path: Path, dir: Direction) -> Option<f64> {
        self.curve(path, dir).map(Curve::ceiling_gbps)
    }
}

/// All links of a table.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    links: Vec<Link>,
}

impl Table {
    /// Parses the CSV format of `links.csv`: `#` comment lines and blank
    /// lines are skipped; the first other line is the header
    /// `link,path,direction,<op size in bytes>...`; every further line is
    /// `name,comm|hixl,write|read|any,<GB/s per op size>...`. Each link must
    /// cover both directions of every path it names, once.
    pub fn parse(text: &str) -> Result<Table, String> {
        let mut lines = text
            .lines()
            .enumerate()
            .map(|(i, l)| (i + 1, l.trim()))
            .filter(|(_, l)| !l.is_empty() && !l.starts_with('#'));
        let (hline, header) = lines.next().ok_or("no header line")?;
        let head: Vec<&str> = header.split(',').map(str::trim).collect();
        if head.len() < 4 || head[..3] != ["link", "path", "direction"] {
            return Err(format!(
                "line {hline}: header must be link,path,direction,<op sizes>"
            ));
        }
        let sizes = head[3..]
            .iter()
            .map(|s| s.parse::<u64>())
            .collect::<Result<Vec<u64>, _>>()
            .map_err(|e| format!("line {hline}: op size: {e}"))?;
        let mut links: Vec<Link> = Vec::new();
        for (n, line) in lines {
            let at = |m: String| format!("line {n}: {m}");
            let cols: Vec<&str> = line.split(',').map(str::trim).collect();
            if cols.len() != head.len() {
                return Err(at(format!(
                    "{} columns, the header has {}",
                    cols.len(),
                    head.len()
                )));
            }
            let name = cols[0];
            if name.is_empty()
                || name.len() > 31
                || !name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            {
                return Err(at(format!(
                    "link name {name:?} must be 1 to 31 lowercase letters, digits and '-'"
                )));
            }
            let path = Path::parse(cols[1])
                .ok_or_else(|| at(format!("path {:?} is not comm or hixl", cols[1])))?;
            let dirs: &[Direction] = match cols[2] {
                "write" => &[Direction::Write],
                "read" => &[Direction::Read],
                "any" => &[Direction::Write, Direction::Read],
                other => return Err(at(format!("direction {other:?} is not write, read or any"))),
            };
            let rates = cols[3..]
                .iter()
                .map(|s| s.parse::<f64>())
                .collect::<Result<Vec<f64>, _>>()
                .map_err(|e| at(format!("GB/s: {e}")))?;
            let curve = Curve::new(sizes.iter().copied().zip(rates).collect()).map_err(at)?;
            let link = match links.iter_mut().position(|l| l.name == name) {
                Some(i) => &mut links[i],
                None => {
                    links.push(Link {
                        name: name.to_string(),
                        curves: BTreeMap::new(),
                    });
                    links.last_mut().expect("just pushed")
                }
            };
            for &d in dirs {
                if link.curves.insert((path, d), curve.clone()).is_some() {
                    return Err(at(format!("{name} {path:?} {d:?} is given twice")));
                }
            }
        }
        for l in &links {
            for &(p, _) in l.curves.keys() {
                for d in [Direction::Write, Direction::Read] {
                    if !l.curves.contains_key(&(p, d)) {
                        return Err(format!("{} has no {p:?} {d:?} row", l.name));
                    }
                }
            }
        }
        if links.is_empty() {
            return Err("no links".into());
        }
        Ok(Table { links })
    }

    /// The table shipped in `links.csv`.
    pub fn builtin() -> &'static Table {
        static TABLE: OnceLock<Table> = OnceLock::new();
        TABLE.get_or_init(|| Table::parse(TABLE_CSV).expect("links.csv is valid (unit-tested)"))
    }

    /// The links' names, in table order.
    pub fn names(&self) -> Vec<&str> {
        self.links.iter().map(|l| l.name.as_str()).collect()
    }

    /// The link of this name.
    pub fn link(&self, name: &str) -> Option<&Link> {
        self.links.iter().find(|l| l.name == name)
    }

    /// What a value of `ASCEND_PD_EMU_LINK` selects: `None` or empty means
    /// no model; an unknown name is an error naming the known ones.
    pub fn select(&self, value: Option<&str>) -> Result<Option<&Link>, UnknownLink> {
        match value.map(str::trim) {
            None | Some("") => Ok(None),
            Some(v) => self.link(v).map(Some).ok_or_else(|| UnknownLink {
                value: v.to_string(),
                known: self.names().iter().map(|s| s.to_string()).collect(),
            }),
        }
    }
}

/// `ASCEND_PD_EMU_LINK` names no link of the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownLink {
    /// The value given.
    pub value: String,
    /// The names the table knows.
    pub known: Vec<String>,
}

impl fmt::Display for UnknownLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{LINK_ENV}={:?} names no modeled link; known values: {} (or unset for no link model)",
            self.value,
            self.known.join(", ")
        )
    }
}

impl std::error::Error for UnknownLink {}

/// The largest-op figure (GB/s) of the named built-in link on a path and
/// direction: what a run on that link cannot exceed.
pub fn link_ceiling_gbps(link: &str, path: Path, dir: Direction) -> Option<f64> {
    Table::builtin().link(link)?.ceiling_gbps(path, dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * KIB;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
    }

    fn a2_roce() -> &'static Link {
        Table::builtin().link("a2-roce").unwrap()
    }

    #[test]
    fn the_shipped_table_parses_and_names_its_links() {
        let t = Table::builtin();
        assert_eq!(t.names(), ["a2-roce", "a2-hccs", "a3-hccs", "a3-roce"]);
        for l in &t.links {
            for p in [Path::Comm, Path::Hixl] {
                for d in [Direction::Write, Direction::Read] {
                    assert_eq!(l.curve(p, d).unwrap().points().len(), 5, "{}", l.name);
                }
            }
        }
        let hccs = t.link("a2-hccs").unwrap();
        assert_eq!(hccs.ceiling_gbps(Path::Comm, Direction::Write), Some(20.5));
        assert_eq!(hccs.ceiling_gbps(Path::Comm, Direction::Read), Some(27.3));
        assert_eq!(
            link_ceiling_gbps("a3-hccs", Path::Hixl, Direction::Write),
            Some(164.6)
        );
        assert_eq!(
            link_ceiling_gbps("b9-x", Path::Comm, Direction::Write),
            None
        );
    }

    #[test]
    fn interpolation_hits_every_table_point_and_stays_between_neighbours() {
        for l in &Table::builtin().links {
            for (key, c) in &l.curves {
                let pts = c.points();
                for &(s, r) in pts {
                    assert!(close(c.gbps(s), r), "{} {key:?} at {s}", l.name);
                    assert!(close(c.op_seconds(s), s as f64 / (r * 1e9)));
                }
                for w in pts.windows(2) {
                    let ((sa, ra), (sb, rb)) = (w[0], w[1]);
                    let (lo, hi) = (ra.min(rb), ra.max(rb));
                    for n in [sa + 1, (sa + sb) / 2, sb - 1] {
                        let g = c.gbps(n);
                        assert!(lo <= g && g <= hi, "{} {key:?}: {g} at {n}", l.name);
                    }
                }
            }
        }
        // Linear in log2(size): 256 KiB is half way from 128 KiB to 512 KiB.
        let c = a2_roce().curve(Path::Comm, Direction::Write).unwrap();
        assert!(close(c.gbps(256 * KIB), (5.7 + 15.6) / 2.0));
    }

    #[test]
    fn a2_roce_comm_models_the_table_at_16k_and_2m() {
        let l = a2_roce();
        for d in [Direction::Write, Direction::Read] {
            let t16 = l.op_seconds(Path::Comm, d, 16 * KIB).unwrap();
            assert!(close(16.0 * KIB as f64 / t16 / 1e9, 0.72));
            let t2m = l.op_seconds(Path::Comm, d, 2 * MIB).unwrap();
            assert!(close(2.0 * MIB as f64 / t2m / 1e9, 19.8));
        }
    }

    #[test]
    fn small_ops_cost_at_least_a_smallest_op_and_large_ops_the_largest_rate() {
        let c = a2_roce().curve(Path::Comm, Direction::Write).unwrap();
        let floor = c.op_seconds(16 * KIB);
        for n in [1, 100, 4 * KIB, 16 * KIB - 1] {
            assert!(close(c.op_seconds(n), floor), "{n}");
        }
        assert_eq!(c.op_seconds(0), 0.0);
        assert!(close(c.gbps(64 * MIB), 19.8));
        assert!(close(c.op_seconds(4 * MIB), 2.0 * c.op_seconds(2 * MIB)));
    }

    #[test]
    fn selection_unset_means_no_model_and_unknown_names_the_known_values() {
        let t = Table::builtin();
        assert_eq!(t.select(None).unwrap(), None);
        assert_eq!(t.select(Some("")).unwrap(), None);
        assert_eq!(
            t.select(Some("a3-hccs")).unwrap().unwrap().name(),
            "a3-hccs"
        );
        let err = t.select(Some("a2-nvlink")).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains(LINK_ENV) && text.contains("a2-nvlink"),
            "{text}"
        );
        for name in ["a2-roce", "a2-hccs", "a3-hccs", "a3-roce"] {
            assert!(text.contains(name), "{text}");
        }
    }

    #[test]
    fn the_parser_refuses_malformed_tables() {
        let head = "link,path,direction,16384,131072\n";
        let ok = format!("{head}x,comm,any,1,2\n");
        assert!(Table::parse(&ok).is_ok());
        for (bad, why) in [
            ("", "no header"),
            ("link,path,16384\nx,comm,1\n", "header"),
            (
                "link,path,direction,131072,16384\nx,comm,any,1,2\n",
                "sizes",
            ),
            (&format!("{head}x,comm,any,1\n") as &str, "columns"),
            (&format!("{head}x,comm,any,1,0\n"), "zero rate"),
            (&format!("{head}x,comm,any,1,fast\n"), "not a number"),
            (&format!("{head}x,pcie,any,1,2\n"), "path"),
            (&format!("{head}x,comm,both,1,2\n"), "direction"),
            (&format!("{head}X,comm,any,1,2\n"), "name"),
            (
                &format!("{head}{},comm,any,1,2\n", "x".repeat(32)),
                "long name",
            ),
            (&format!("{head}x,comm,write,1,2\n"), "no read row"),
            (&format!("{head}x,comm,any,1,2\nx,comm,read,1,2\n"), "twice"),
            (head, "no links"),
        ] {
            assert!(Table::parse(bad).is_err(), "{why}");
        }
    }
}
