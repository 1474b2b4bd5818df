//! "These pages have landed": after a one-sided write completes, the writer
//! tells the owner of the pages over the peer-init socket, so the owner
//! never hands half-written data to its load path. (The six wire messages
//! of the side channel stay as they are; this travels on the channel's own
//! socket.)

use crate::memory::BufferRef;
use crate::wire::{Reader, Writer};
use uuid::Uuid;

/// The most refs one notice may carry (a batch is at most a few thousand chunks).
pub const MAX_LANDED_REFS: usize = 1 << 16;

/// Encodes a notice that `refs` (pages of the receiver) were fully written by `node`.
pub fn encode(node: &str, refs: &[BufferRef]) -> Vec<u8> {
    let mut w = Writer::with_capacity(32 + refs.len() * 40);
    w.map_len(2).expect("2");
    w.str("landed").expect("short");
    w.str(node).expect("node id fits");
    w.str("refs").expect("short");
    w.array_len(refs.len()).expect("refs fit a msgpack array");
    for r in refs {
        w.array_len(2).expect("2");
        w.str(&r.uuid.simple().to_string()).expect("32 chars");
        w.uint(u64::from(r.page));
    }
    w.into_bytes()
}

/// Decodes a landed notice; `None` when the frame is not one (e.g. a hello).
pub fn decode(bytes: &[u8]) -> Option<Result<(String, Vec<BufferRef>), String>> {
    let mut r = Reader::new(bytes);
    let n = r.map_len().ok()?;
    if n != 2 || r.str().ok()? != "landed" {
        return None;
    }
    Some(decode_rest(&mut r))
}

fn decode_rest(r: &mut Reader<'_>) -> Result<(String, Vec<BufferRef>), String> {
    let e = |what: &str| format!("malformed landed notice: {what}");
    let node = r.str().map_err(|_| e("node"))?.to_string();
    if r.str().map_err(|_| e("refs key"))? != "refs" {
        return Err(e("refs key"));
    }
    let count = r.array_len().map_err(|_| e("refs"))?;
    if count > MAX_LANDED_REFS {
        return Err(e("too many refs"));
    }
    let mut refs = Vec::with_capacity(count);
    for _ in 0..count {
        if r.array_len().map_err(|_| e("ref"))? != 2 {
            return Err(e("ref"));
        }
        let uuid = Uuid::parse_str(r.str().map_err(|_| e("uuid"))?).map_err(|_| e("uuid"))?;
        let page = u32::try_from(r.uint().map_err(|_| e("page"))?).map_err(|_| e("page"))?;
        refs.push(BufferRef { uuid, page });
    }
    if r.remaining() != 0 {
        return Err(e("trailing bytes"));
    }
    Ok((node, refs))
}

/// The one-byte-map reply to a landed notice: `{"ok": true}`.
pub fn ack() -> Vec<u8> {
    let mut w = Writer::with_capacity(8);
    w.map_len(1).expect("1");
    w.str("ok").expect("short");
    w.bool(true);
    w.into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_not_a_notice() {
        let refs = vec![
            BufferRef {
                uuid: Uuid::new_v4(),
                page: 0,
            },
            BufferRef {
                uuid: Uuid::new_v4(),
                page: 70_000,
            },
        ];
        let f = encode("10.0.0.1:7600", &refs);
        let (node, back) = decode(&f).unwrap().unwrap();
        assert_eq!(node, "10.0.0.1:7600");
        assert_eq!(back, refs);
        assert!(decode(&ack()).is_none());
        assert!(decode(b"").is_none());
        // Truncations are errors, never panics.
        for cut in 1..f.len() {
            if let Some(r) = decode(&f[..cut]) {
                assert!(r.is_err());
            }
        }
    }
}
