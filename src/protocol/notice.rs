//! Push notices: how a writer ends an allocation it was granted.
//!
//! After its one-sided write into the pages of an `AscendAllocResponse`
//! finished, the sender tells the receiver so on its request socket,
//! naming the allocation: the *route* it came on (the identity of the
//! request socket that asked, `<node>#<n>`; a route has one open
//! allocation, since its writer notices before asking again) and its
//! pages, which must be exactly the allocation's. The notice must come
//! from the same writer (node) as the allocation; anything else is
//! refused. A notice whose reply was lost is sent again from the writer's
//! next socket; the receiver answers a repeat as it answered the first.
//!
//! * `landed`: every byte is written; the pages become resident chunks.
//! * `aborted`: the write failed, and the writer will not touch the pages
//!   again (its transfer ended); the pages go back to the pool.
//!
//! The six LMCache messages keep their wire form; a notice is our own map
//! (first key `"push_notice"`), never confused with them (first key `"type"`).

use crate::memory::BufferRef;
use crate::wire::{Reader, Writer};
use uuid::Uuid;

/// The most pages one notice may list (a push is at most a few thousand chunks).
pub const MAX_NOTICE_REFS: usize = 1 << 16;

/// How the writer's transfer into an allocation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PushOutcome {
    /// Every byte landed.
    Landed,
    /// The write failed and is over: the writer no longer touches the pages.
    Aborted,
}

/// A writer's report on one allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PushNotice {
    /// The route the allocation was asked on.
    pub route: String,
    /// How the write ended.
    pub outcome: PushOutcome,
    /// The receiver pages of the allocation, in response order.
    pub refs: Vec<BufferRef>,
}

impl PushNotice {
    /// The wire form.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(48 + self.refs.len() * 40);
        w.map_len(3).expect("3");
        w.str("push_notice").expect("short");
        w.str(&self.route).expect("a route fits");
        w.str("outcome").expect("short");
        w.str(match self.outcome {
            PushOutcome::Landed => "landed",
            PushOutcome::Aborted => "aborted",
        })
        .expect("short");
        w.str("refs").expect("short");
        w.array_len(self.refs.len())
            .expect("refs fit a msgpack array");
        for r in &self.refs {
            w.array_len(2).expect("2");
            w.str(&r.uuid.simple().to_string()).expect("32 chars");
            w.uint(u64::from(r.page));
        }
        w.into_bytes()
    }

    /// Decodes a notice; `None` when the frame is not one (a side-channel message).
    pub fn decode(bytes: &[u8]) -> Option<Result<PushNotice, String>> {
        let mut r = Reader::new(bytes);
        let n = r.map_len().ok()?;
        if n != 3 || r.str().ok()? != "push_notice" {
            return None;
        }
        Some(decode_rest(&mut r))
    }
}

fn decode_rest(r: &mut Reader<'_>) -> Result<PushNotice, String> {
    let e = |what: &str| format!("malformed push notice: {what}");
    let route = r.str().map_err(|_| e("route"))?.to_string();
    if r.str().map_err(|_| e("outcome key"))? != "outcome" {
        return Err(e("outcome key"));
    }
    let outcome = match r.str().map_err(|_| e("outcome"))? {
        "landed" => PushOutcome::Landed,
        "aborted" => PushOutcome::Aborted,
        other => return Err(e(&format!("outcome {other:?}"))),
    };
    if r.str().map_err(|_| e("refs key"))? != "refs" {
        return Err(e("refs key"));
    }
    let count = r.array_len().map_err(|_| e("refs"))?;
    if count > MAX_NOTICE_REFS {
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
    Ok(PushNotice {
        route,
        outcome,
        refs,
    })
}

/// The writer node a route names (`<node>#<n>`).
pub fn route_node(route: &str) -> &str {
    route.rsplit_once('#').map_or(route, |(node, _)| node)
}

/// The receiver's answer to a notice: `{"ok": true}`, or `{"ok": false,
/// "error": why}` when it was refused.
pub fn encode_reply(result: &Result<(), String>) -> Vec<u8> {
    let mut w = Writer::with_capacity(64);
    match result {
        Ok(()) => {
            w.map_len(1).expect("1");
            w.str("ok").expect("short");
            w.bool(true);
        }
        Err(why) => {
            w.map_len(2).expect("2");
            w.str("ok").expect("short");
            w.bool(false);
            w.str("error").expect("short");
            w.str(why).expect("an error message fits");
        }
    }
    w.into_bytes()
}

/// Decodes a notice reply: `Ok(())`, or the receiver's reason for refusing.
pub fn decode_reply(bytes: &[u8]) -> Result<Result<(), String>, String> {
    let mut r = Reader::new(bytes);
    let bad = || "malformed push notice reply".to_string();
    let n = r.map_len().map_err(|_| bad())?;
    let mut ok = None;
    let mut error = None;
    for _ in 0..n {
        match r.str().map_err(|_| bad())? {
            "ok" => ok = Some(r.bool().map_err(|_| bad())?),
            "error" => error = Some(r.str().map_err(|_| bad())?.to_string()),
            _ => r.skip_value().map_err(|_| bad())?,
        }
    }
    match ok {
        Some(true) => Ok(Ok(())),
        Some(false) => Ok(Err(error.unwrap_or_else(|| "refused".into()))),
        None => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_and_replies_round_trip_and_truncations_are_errors() {
        let n = PushNotice {
            route: "127.0.0.1:7600/p1.r0.0a#3".into(),
            outcome: PushOutcome::Aborted,
            refs: vec![
                BufferRef {
                    uuid: Uuid::new_v4(),
                    page: 0,
                },
                BufferRef {
                    uuid: Uuid::new_v4(),
                    page: 70_000,
                },
            ],
        };
        let f = n.encode();
        assert_eq!(PushNotice::decode(&f).unwrap().unwrap(), n);
        for cut in 1..f.len() {
            if let Some(r) = PushNotice::decode(&f[..cut]) {
                assert!(r.is_err());
            }
        }
        // The six messages are not notices.
        let m = crate::protocol::Message::ProxyNotif(crate::protocol::ProxyNotif {
            req_id: "r".into(),
        })
        .encode();
        assert!(PushNotice::decode(&m).is_none());
        assert_eq!(decode_reply(&encode_reply(&Ok(()))), Ok(Ok(())));
        assert_eq!(
            decode_reply(&encode_reply(&Err("late".into()))),
            Ok(Err("late".to_string()))
        );
        assert!(decode_reply(b"\x90").is_err());
    }
}
