//! The msgpack writer and bounded reader at the bottom of the crate: the
//! side-channel messages, the channel handshake and landed notices use it.
//!
//! The writer always picks the *smallest* msgpack encoding for every value,
//! which is what msgspec (the encoder used by LMCache-Ascend peers) does, so
//! re-encoding a decoded message reproduces the peer's bytes exactly.
//!
//! The reader works on a borrowed byte slice, never panics, never recurses
//! (skipping nested values is iterative) and checks every length announced
//! by the input against the bytes that are actually left before using it.

use rmp::Marker;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// This process's clock epoch for wire timestamps.
fn clock_epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// `t` as microseconds of this process's monotonic clock, for the wire
/// (only differences and handshake-measured offsets mean anything).
pub(crate) fn micros(t: Instant) -> u64 {
    t.saturating_duration_since(clock_epoch()).as_micros() as u64
}

/// The instant of a wire timestamp of this process's clock.
pub(crate) fn from_micros(us: u64) -> Instant {
    clock_epoch() + Duration::from_micros(us)
}

/// Width selection failed: a string or array is longer than msgpack's
/// 32-bit length fields allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TooLong {
    /// The length that did not fit.
    pub(crate) len: usize,
}

/// Append-only msgpack writer that chooses minimal widths.
#[derive(Debug, Default)]
pub(crate) struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    /// A writer with `capacity` bytes preallocated.
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        Self {
            buf: Vec::with_capacity(capacity),
        }
    }

    /// The bytes written so far.
    pub(crate) fn into_bytes(self) -> Vec<u8> {
        self.buf
    }

    /// The bytes written so far, without giving them up.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.buf
    }

    fn marker(&mut self, m: Marker) {
        self.buf.push(m.to_u8());
    }

    /// Map header: fixmap (< 16), map16 (< 65536), map32 otherwise.
    pub(crate) fn map_len(&mut self, len: usize) -> Result<(), TooLong> {
        let n = u32::try_from(len).map_err(|_| TooLong { len })?;
        if n < 16 {
            self.marker(Marker::FixMap(n as u8));
        } else if let Ok(n16) = u16::try_from(n) {
            self.marker(Marker::Map16);
            self.buf.extend_from_slice(&n16.to_be_bytes());
        } else {
            self.marker(Marker::Map32);
            self.buf.extend_from_slice(&n.to_be_bytes());
        }
        Ok(())
    }

    /// Array header: fixarray (< 16), array16 (< 65536), array32 otherwise.
    pub(crate) fn array_len(&mut self, len: usize) -> Result<(), TooLong> {
        let n = u32::try_from(len).map_err(|_| TooLong { len })?;
        if n < 16 {
            self.marker(Marker::FixArray(n as u8));
        } else if let Ok(n16) = u16::try_from(n) {
            self.marker(Marker::Array16);
            self.buf.extend_from_slice(&n16.to_be_bytes());
        } else {
            self.marker(Marker::Array32);
            self.buf.extend_from_slice(&n.to_be_bytes());
        }
        Ok(())
    }

    /// String: fixstr (< 32 bytes), str8 (< 256), str16 (< 65536), str32.
    pub(crate) fn str(&mut self, s: &str) -> Result<(), TooLong> {
        let len = s.len();
        let n = u32::try_from(len).map_err(|_| TooLong { len })?;
        if n < 32 {
            self.marker(Marker::FixStr(n as u8));
        } else if let Ok(n8) = u8::try_from(n) {
            self.marker(Marker::Str8);
            self.buf.push(n8);
        } else if let Ok(n16) = u16::try_from(n) {
            self.marker(Marker::Str16);
            self.buf.extend_from_slice(&n16.to_be_bytes());
        } else {
            self.marker(Marker::Str32);
            self.buf.extend_from_slice(&n.to_be_bytes());
        }
        self.buf.extend_from_slice(s.as_bytes());
        Ok(())
    }

    /// Non-negative integer: positive fixint (<= 127), uint8, uint16,
    /// uint32, uint64 — the first that fits.
    pub(crate) fn uint(&mut self, v: u64) {
        if v < 0x80 {
            self.marker(Marker::FixPos(v as u8));
        } else if let Ok(v8) = u8::try_from(v) {
            self.marker(Marker::U8);
            self.buf.push(v8);
        } else if let Ok(v16) = u16::try_from(v) {
            self.marker(Marker::U16);
            self.buf.extend_from_slice(&v16.to_be_bytes());
        } else if let Ok(v32) = u32::try_from(v) {
            self.marker(Marker::U32);
            self.buf.extend_from_slice(&v32.to_be_bytes());
        } else {
            self.marker(Marker::U64);
            self.buf.extend_from_slice(&v.to_be_bytes());
        }
    }

    /// Signed integer: non-negative values use [`Writer::uint`] (as msgspec
    /// does); negative ones use negative fixint (>= -32), int8, int16,
    /// int32, int64 — the first that fits.
    pub(crate) fn int(&mut self, v: i64) {
        if let Ok(u) = u64::try_from(v) {
            self.uint(u);
        } else if v >= -32 {
            self.marker(Marker::FixNeg(v as i8));
        } else if let Ok(v8) = i8::try_from(v) {
            self.marker(Marker::I8);
            self.buf.extend_from_slice(&v8.to_be_bytes());
        } else if let Ok(v16) = i16::try_from(v) {
            self.marker(Marker::I16);
            self.buf.extend_from_slice(&v16.to_be_bytes());
        } else if let Ok(v32) = i32::try_from(v) {
            self.marker(Marker::I32);
            self.buf.extend_from_slice(&v32.to_be_bytes());
        } else {
            self.marker(Marker::I64);
            self.buf.extend_from_slice(&v.to_be_bytes());
        }
    }

    /// Boolean: `0xc2` / `0xc3`.
    pub(crate) fn bool(&mut self, v: bool) {
        self.marker(if v { Marker::True } else { Marker::False });
    }

    /// Nil: `0xc0`.
    pub(crate) fn nil(&mut self) {
        self.marker(Marker::Null);
    }

    /// Raw bytes, appended verbatim (tests build odd frames with this).
    #[cfg(test)]
    pub(crate) fn raw(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }
}

/// What went wrong inside one value; the caller adds message/field context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RawError {
    /// The input ended (or an announced length exceeds what is left).
    Truncated,
    /// A value of another msgpack kind than expected.
    WrongType {
        expected: &'static str,
        found: &'static str,
    },
    /// An integer that does not fit the field's range.
    OutOfRange { value: i128, expected: &'static str },
    /// A msgpack str whose payload is not UTF-8.
    InvalidUtf8,
    /// The byte `0xc1`, which msgpack reserves and never uses.
    Reserved,
}

/// Human name of the msgpack kind introduced by `m`.
pub(crate) fn kind_name(m: Marker) -> &'static str {
    match m {
        Marker::FixPos(_)
        | Marker::FixNeg(_)
        | Marker::U8
        | Marker::U16
        | Marker::U32
        | Marker::U64
        | Marker::I8
        | Marker::I16
        | Marker::I32
        | Marker::I64 => "int",
        Marker::Null => "nil",
        Marker::True | Marker::False => "bool",
        Marker::F32 | Marker::F64 => "float",
        Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => "str",
        Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => "bin",
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => "array",
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => "map",
        Marker::FixExt1
        | Marker::FixExt2
        | Marker::FixExt4
        | Marker::FixExt8
        | Marker::FixExt16
        | Marker::Ext8
        | Marker::Ext16
        | Marker::Ext32 => "ext",
        Marker::Reserved => "reserved byte 0xc1",
    }
}

/// Bounded cursor over an input frame.
#[derive(Debug, Clone)]
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// A reader positioned at the start of `buf`.
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    /// Bytes not consumed yet.
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Current offset into the input.
    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    /// The input between offsets `start` and `end`.
    pub(crate) fn slice(&self, start: usize, end: usize) -> &'a [u8] {
        self.buf.get(start..end).unwrap_or_default()
    }

    /// Consume `n` bytes, or fail without consuming anything.
    fn take(&mut self, n: usize) -> Result<&'a [u8], RawError> {
        if n > self.remaining() {
            return Err(RawError::Truncated);
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn take_array<const N: usize>(&mut self) -> Result<[u8; N], RawError> {
        let s = self.take(N)?;
        let mut out = [0u8; N];
        out.copy_from_slice(s);
        Ok(out)
    }

    fn be_u8(&mut self) -> Result<u8, RawError> {
        Ok(self.take_array::<1>()?[0])
    }

    fn be_u16(&mut self) -> Result<u16, RawError> {
        Ok(u16::from_be_bytes(self.take_array()?))
    }

    fn be_u32(&mut self) -> Result<u32, RawError> {
        Ok(u32::from_be_bytes(self.take_array()?))
    }

    fn be_u64(&mut self) -> Result<u64, RawError> {
        Ok(u64::from_be_bytes(self.take_array()?))
    }

    /// Look at the next marker without consuming it.
    pub(crate) fn peek_marker(&self) -> Option<Marker> {
        self.buf.get(self.pos).map(|&b| Marker::from_u8(b))
    }

    /// Consume the next marker byte.
    pub(crate) fn marker(&mut self) -> Result<Marker, RawError> {
        Ok(Marker::from_u8(self.be_u8()?))
    }

    /// Fail unless `n` items of at least `min_bytes` each can still follow.
    fn check_count(&self, n: u64, min_bytes: u64) -> Result<usize, RawError> {
        let need = n.saturating_mul(min_bytes);
        if need > self.remaining() as u64 {
            return Err(RawError::Truncated);
        }
        usize::try_from(n).map_err(|_| RawError::Truncated)
    }

    /// Read a map header; the count is checked against the remaining input
    /// (every entry needs at least two bytes).
    pub(crate) fn map_len(&mut self) -> Result<usize, RawError> {
        let n = match self.marker()? {
            Marker::FixMap(n) => u64::from(n),
            Marker::Map16 => u64::from(self.be_u16()?),
            Marker::Map32 => u64::from(self.be_u32()?),
            other => return Err(wrong("map", other)),
        };
        self.check_count(n, 2)
    }

    /// Read an array header; the count is checked against the remaining
    /// input (every element needs at least one byte).
    pub(crate) fn array_len(&mut self) -> Result<usize, RawError> {
        let n = match self.marker()? {
            Marker::FixArray(n) => u64::from(n),
            Marker::Array16 => u64::from(self.be_u16()?),
            Marker::Array32 => u64::from(self.be_u32()?),
            other => return Err(wrong("array", other)),
        };
        self.check_count(n, 1)
    }

    /// Read a str value (any of fixstr/str8/str16/str32), borrowing it.
    pub(crate) fn str(&mut self) -> Result<&'a str, RawError> {
        let len = match self.marker()? {
            Marker::FixStr(n) => usize::from(n),
            Marker::Str8 => usize::from(self.be_u8()?),
            Marker::Str16 => usize::from(self.be_u16()?),
            Marker::Str32 => {
                let n = self.be_u32()?;
                self.check_count(u64::from(n), 1)?
            }
            other => return Err(wrong("str", other)),
        };
        let bytes = self.take(len)?;
        std::str::from_utf8(bytes).map_err(|_| RawError::InvalidUtf8)
    }

    /// Read a bool.
    pub(crate) fn bool(&mut self) -> Result<bool, RawError> {
        match self.marker()? {
            Marker::True => Ok(true),
            Marker::False => Ok(false),
            other => Err(wrong("bool", other)),
        }
    }

    /// Read an integer of any msgpack width (signed or unsigned).
    pub(crate) fn int(&mut self) -> Result<i128, RawError> {
        Ok(match self.marker()? {
            Marker::FixPos(v) => i128::from(v),
            Marker::FixNeg(v) => i128::from(v),
            Marker::U8 => i128::from(self.be_u8()?),
            Marker::U16 => i128::from(self.be_u16()?),
            Marker::U32 => i128::from(self.be_u32()?),
            Marker::U64 => i128::from(self.be_u64()?),
            Marker::I8 => i128::from(self.be_u8()? as i8),
            Marker::I16 => i128::from(self.be_u16()? as i16),
            Marker::I32 => i128::from(self.be_u32()? as i32),
            Marker::I64 => i128::from(self.be_u64()? as i64),
            other => return Err(wrong("int", other)),
        })
    }

    /// Read a non-negative integer that fits in `u64`.
    pub(crate) fn uint(&mut self) -> Result<u64, RawError> {
        let v = self.int()?;
        u64::try_from(v).map_err(|_| RawError::OutOfRange {
            value: v,
            expected: "a non-negative integer",
        })
    }

    /// Read an integer that fits in `i64`.
    pub(crate) fn sint(&mut self) -> Result<i64, RawError> {
        let v = self.int()?;
        i64::try_from(v).map_err(|_| RawError::OutOfRange {
            value: v,
            expected: "an integer that fits in i64",
        })
    }

    /// Skip one complete value of any type, including arbitrarily nested
    /// arrays and maps, without recursion. Announced lengths are checked
    /// against the remaining input before anything is consumed past them.
    pub(crate) fn skip_value(&mut self) -> Result<(), RawError> {
        // Number of values still to skip. Every pending value needs at
        // least one byte, so `pending <= remaining` is an invariant that
        // bounds it by the input size.
        let mut pending: u64 = 1;
        while pending > 0 {
            pending -= 1;
            let m = self.marker()?;
            let (skip, children): (u64, u64) = match m {
                Marker::FixPos(_)
                | Marker::FixNeg(_)
                | Marker::Null
                | Marker::True
                | Marker::False => (0, 0),
                Marker::Reserved => return Err(RawError::Reserved),
                Marker::U8 | Marker::I8 => (1, 0),
                Marker::U16 | Marker::I16 => (2, 0),
                Marker::U32 | Marker::I32 | Marker::F32 => (4, 0),
                Marker::U64 | Marker::I64 | Marker::F64 => (8, 0),
                Marker::FixStr(n) => (u64::from(n), 0),
                Marker::Str8 | Marker::Bin8 => (u64::from(self.be_u8()?), 0),
                Marker::Str16 | Marker::Bin16 => (u64::from(self.be_u16()?), 0),
                Marker::Str32 | Marker::Bin32 => (u64::from(self.be_u32()?), 0),
                // ext: type byte + payload
                Marker::FixExt1 => (2, 0),
                Marker::FixExt2 => (3, 0),
                Marker::FixExt4 => (5, 0),
                Marker::FixExt8 => (9, 0),
                Marker::FixExt16 => (17, 0),
                Marker::Ext8 => (u64::from(self.be_u8()?) + 1, 0),
                Marker::Ext16 => (u64::from(self.be_u16()?) + 1, 0),
                Marker::Ext32 => (u64::from(self.be_u32()?) + 1, 0),
                Marker::FixArray(n) => (0, u64::from(n)),
                Marker::Array16 => (0, u64::from(self.be_u16()?)),
                Marker::Array32 => (0, u64::from(self.be_u32()?)),
                Marker::FixMap(n) => (0, 2 * u64::from(n)),
                Marker::Map16 => (0, 2 * u64::from(self.be_u16()?)),
                Marker::Map32 => (0, 2 * u64::from(self.be_u32()?)),
            };
            let skip = self.check_count(skip, 1)?;
            self.take(skip)?;
            pending += children;
            self.check_count(pending, 1)?;
        }
        Ok(())
    }
}

fn wrong(expected: &'static str, found: Marker) -> RawError {
    if found == Marker::Reserved {
        RawError::Reserved
    } else {
        RawError::WrongType {
            expected,
            found: kind_name(found),
        }
    }
}
