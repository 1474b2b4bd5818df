//! Checks every field of an incoming `AllocRequest` / `PullReadyNotif`
//! before the receiver uses any of it. A peer's message is untrusted input:
//! a failure is a [`InvalidMessage`] naming the message and field, for the
//! shell to log and answer with `alloc_failed=true`.

use std::collections::HashMap;

use uuid::Uuid;

use super::messages::{AllocRequest, MessageType, PullReadyNotif};
use crate::memory::{BufferRef, ChunkLayout, ChunkMeta};

/// Why an incoming message was rejected. `Display` starts with
/// `Type.field`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidMessage {
    /// `fmt`/`shape`/`dtype` do not describe a chunk we can move.
    #[error("{msg}.shape/fmt/dtype: {reason}")]
    Layout {
        /// Message type.
        msg: MessageType,
        /// What is wrong.
        reason: String,
    },
    /// The chunk layout differs from this receiver's.
    #[error("{msg}.shape: {got} does not match this receiver's {expected}")]
    LayoutMismatch {
        /// Message type.
        msg: MessageType,
        /// Layout received (`shape dtype fmt`).
        got: String,
        /// This receiver's layout.
        expected: String,
    },
    /// `keys` is empty.
    #[error("{msg}.keys: empty")]
    NoKeys {
        /// Message type.
        msg: MessageType,
    },
    /// A key is the empty string.
    #[error("{msg}.keys[{index}]: empty key")]
    EmptyKey {
        /// Message type.
        msg: MessageType,
        /// Position.
        index: usize,
    },
    /// A key occurs twice in one message.
    #[error("{msg}.keys[{index}]: duplicate of keys[{first}]")]
    DuplicateKey {
        /// Message type.
        msg: MessageType,
        /// Position of the repeat.
        index: usize,
        /// Position of the first occurrence.
        first: usize,
    },
    /// A per-key list has a different length than `keys`.
    #[error("{msg}.{field}: {len} entries for {keys} keys")]
    LengthMismatch {
        /// Message type.
        msg: MessageType,
        /// The list.
        field: &'static str,
        /// Its length.
        len: usize,
        /// Number of keys.
        keys: usize,
    },
    /// A page index does not fit the u32 page index.
    #[error("{msg}.{field}[{index}]: {value} exceeds the u32 page index")]
    IndexTooLarge {
        /// Message type.
        msg: MessageType,
        /// The list.
        field: &'static str,
        /// Position.
        index: usize,
        /// The value.
        value: u64,
    },
    /// `last_chunk_toks` outside `1..=chunk tokens`.
    #[error("{msg}.last_chunk_toks: {value} not in 1..={max}")]
    LastChunkToks {
        /// Message type.
        msg: MessageType,
        /// The value.
        value: u64,
        /// Tokens of a full chunk.
        max: usize,
    },
    /// A buffer uuid does not parse.
    #[error("{msg}.{field}[{index}]: {value:?} is not a uuid")]
    BadUuid {
        /// Message type.
        msg: MessageType,
        /// The list.
        field: &'static str,
        /// Position.
        index: usize,
        /// The value (shortened).
        value: String,
    },
    /// A string field that must not be empty is.
    #[error("{msg}.{field}: empty")]
    EmptyField {
        /// Message type.
        msg: MessageType,
        /// The field.
        field: &'static str,
    },
    /// `pull_id` names a pull this receiver still has open.
    #[error("{msg}.pull_id: {pull_id:?} is already in use")]
    PullIdInUse {
        /// Message type.
        msg: MessageType,
        /// The id (shortened).
        pull_id: String,
    },
    /// The sender never completed a handshake with this receiver (or was
    /// replaced): there is no agreed lease and no way to read its pages.
    #[error("{msg}.sender_id: {sender:?} has no handshake with this receiver; it must connect to pd_peer_init_port first")]
    UnknownSender {
        /// Message type.
        msg: MessageType,
        /// The sender id (shortened).
        sender: String,
    },
    /// A notification names a sender other than the one that sent it: a
    /// sender may only announce its own pages.
    #[error("{msg}.sender_id: {sender:?}, but it came from {from:?}; a sender may only announce its own pages")]
    NotFromSender {
        /// Message type.
        msg: MessageType,
        /// The sender id (shortened).
        sender: String,
        /// The node it came from (shortened).
        from: String,
    },
    /// The request came on a route its sender already gave up (it said
    /// so in an `aborted` notice naming no pages): nobody hears the reply.
    #[error("{msg}: route {route:?} was given up by its sender; nothing is allocated for it")]
    RouteGivenUp {
        /// Message type.
        msg: MessageType,
        /// The route (shortened).
        route: String,
    },
    /// The pull id does not carry an ascend-pd lease deadline.
    #[error("{msg}.pull_id: {pull_id:?} carries no lease deadline (not an ascend-pd sender of this version)")]
    NoLease {
        /// Message type.
        msg: MessageType,
        /// The id (shortened).
        pull_id: String,
    },
    /// The notification arrived too late: the sender may free (or soon
    /// free) the pages, so nothing of it may be read.
    #[error("{msg}.pull_id: {pull_id:?} arrived {late_ms} ms past the last moment a read could start (it waited in a queue, or the lease is shorter than the delay); refused, nothing read")]
    LeaseOver {
        /// Message type.
        msg: MessageType,
        /// The id (shortened).
        pull_id: String,
        /// How late, in milliseconds.
        late_ms: u64,
    },
    /// The sender would hold more proxies here than it has pages (that
    /// the transfer channel verified it registered).
    #[error("{msg}: sender {sender:?} would hold {held} + {new} proxies here, more than its cap of {limit}: the pages of its pool the transfer channel verified it registered (tcp cannot verify them: its table, but at most this receiver's own pages and at least 1024); refused until its earlier pulls are loaded or expire")]
    TooManyProxies {
        /// Message type.
        msg: MessageType,
        /// The sender (shortened).
        sender: String,
        /// Proxies it holds now.
        held: usize,
        /// Proxies this notification adds.
        new: usize,
        /// Its cap: pages the channel verified it registered.
        limit: usize,
    },
    /// `sender_done_url` is not `host:port`.
    #[error("{msg}.sender_done_url: {value:?} is not host:port")]
    BadDoneUrl {
        /// Message type.
        msg: MessageType,
        /// The value (shortened).
        value: String,
    },
}

impl InvalidMessage {
    /// The message type that was rejected.
    pub fn message_type(&self) -> MessageType {
        match self {
            InvalidMessage::Layout { msg, .. }
            | InvalidMessage::LayoutMismatch { msg, .. }
            | InvalidMessage::NoKeys { msg }
            | InvalidMessage::EmptyKey { msg, .. }
            | InvalidMessage::DuplicateKey { msg, .. }
            | InvalidMessage::LengthMismatch { msg, .. }
            | InvalidMessage::IndexTooLarge { msg, .. }
            | InvalidMessage::LastChunkToks { msg, .. }
            | InvalidMessage::BadUuid { msg, .. }
            | InvalidMessage::EmptyField { msg, .. }
            | InvalidMessage::PullIdInUse { msg, .. }
            | InvalidMessage::UnknownSender { msg, .. }
            | InvalidMessage::NotFromSender { msg, .. }
            | InvalidMessage::RouteGivenUp { msg, .. }
            | InvalidMessage::NoLease { msg, .. }
            | InvalidMessage::LeaseOver { msg, .. }
            | InvalidMessage::TooManyProxies { msg, .. }
            | InvalidMessage::BadDoneUrl { msg, .. } => *msg,
        }
    }
}

/// The per-key chunk metadata of a checked message: every chunk is full
/// except possibly the last (`last_chunk_toks`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckedChunks {
    /// One per key, in order.
    pub metas: Vec<ChunkMeta>,
}

/// A validated `PullReadyNotif`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckedPull {
    /// Per-key chunk metadata.
    pub metas: Vec<ChunkMeta>,
    /// Per-key address of the chunk in the sender's pools.
    pub remote: Vec<BufferRef>,
}

fn shorten(s: &str) -> String {
    super::error::shorten(s)
}

fn check_layout(
    msg: MessageType,
    fmt: i64,
    shape: &[u64],
    dtype: &str,
    ours: &ChunkLayout,
) -> Result<ChunkLayout, InvalidMessage> {
    let got = ChunkLayout::from_wire(fmt, shape, dtype)
        .map_err(|reason| InvalidMessage::Layout { msg, reason })?;
    if got != *ours {
        return Err(InvalidMessage::LayoutMismatch {
            msg,
            got: describe(&got),
            expected: describe(ours),
        });
    }
    Ok(got)
}

/// `[2, 36, 256, 1024] bfloat16 fmt 1`, for errors.
fn describe(l: &ChunkLayout) -> String {
    format!("{:?} {} fmt {}", l.full_shape(), l.dtype, l.fmt.code())
}

fn check_keys(msg: MessageType, keys: &[String]) -> Result<(), InvalidMessage> {
    if keys.is_empty() {
        return Err(InvalidMessage::NoKeys { msg });
    }
    let mut seen: HashMap<&str, usize> = HashMap::with_capacity(keys.len());
    for (index, k) in keys.iter().enumerate() {
        if k.is_empty() {
            return Err(InvalidMessage::EmptyKey { msg, index });
        }
        if let Some(&first) = seen.get(k.as_str()) {
            return Err(InvalidMessage::DuplicateKey { msg, index, first });
        }
        seen.insert(k, index);
    }
    Ok(())
}

fn chunk_metas(
    msg: MessageType,
    n: usize,
    last_chunk_toks: u64,
    layout: ChunkLayout,
) -> Result<Vec<ChunkMeta>, InvalidMessage> {
    let last = usize::try_from(last_chunk_toks)
        .ok()
        .filter(|t| (1..=layout.tokens).contains(t))
        .ok_or(InvalidMessage::LastChunkToks {
            msg,
            value: last_chunk_toks,
            max: layout.tokens,
        })?;
    Ok((0..n)
        .map(|i| {
            if i + 1 == n {
                ChunkMeta::partial(layout, last)
            } else {
                ChunkMeta::full(layout)
            }
        })
        .collect())
}

/// Checks an `AllocRequest` against this receiver's chunk layout.
pub fn check_alloc_request(
    req: &AllocRequest,
    layout: &ChunkLayout,
) -> Result<CheckedChunks, InvalidMessage> {
    let msg = MessageType::AllocRequest;
    let layout = check_layout(msg, req.fmt, &req.shape, &req.dtype, layout)?;
    check_keys(msg, &req.keys)?;
    let metas = chunk_metas(msg, req.keys.len(), req.last_chunk_toks, layout)?;
    Ok(CheckedChunks { metas })
}

/// Checks a `PullReadyNotif` against this receiver's chunk layout.
pub fn check_pull_notif(
    notif: &PullReadyNotif,
    layout: &ChunkLayout,
) -> Result<CheckedPull, InvalidMessage> {
    let msg = MessageType::PullReadyNotif;
    if notif.pull_id.is_empty() {
        return Err(InvalidMessage::EmptyField {
            msg,
            field: "pull_id",
        });
    }
    if notif.sender_id.is_empty() {
        return Err(InvalidMessage::EmptyField {
            msg,
            field: "sender_id",
        });
    }
    check_done_url(&notif.sender_done_url)?;
    let layout = check_layout(msg, notif.fmt, &notif.shape, &notif.dtype, layout)?;
    check_keys(msg, &notif.keys)?;
    let n = notif.keys.len();
    for (field, len) in [
        ("sender_buffer_uuids", notif.sender_buffer_uuids.len()),
        ("sender_mem_indexes", notif.sender_mem_indexes.len()),
    ] {
        if len != n {
            return Err(InvalidMessage::LengthMismatch {
                msg,
                field,
                len,
                keys: n,
            });
        }
    }
    let metas = chunk_metas(msg, n, notif.last_chunk_toks, layout)?;
    let mut remote = Vec::with_capacity(n);
    for (index, (u, &page)) in notif
        .sender_buffer_uuids
        .iter()
        .zip(&notif.sender_mem_indexes)
        .enumerate()
    {
        let uuid = Uuid::parse_str(u).map_err(|_| InvalidMessage::BadUuid {
            msg,
            field: "sender_buffer_uuids",
            index,
            value: shorten(u),
        })?;
        let page = u32::try_from(page).map_err(|_| InvalidMessage::IndexTooLarge {
            msg,
            field: "sender_mem_indexes",
            index,
            value: page,
        })?;
        remote.push(BufferRef { uuid, page });
    }
    Ok(CheckedPull { metas, remote })
}

fn check_done_url(url: &str) -> Result<(), InvalidMessage> {
    let msg = MessageType::PullReadyNotif;
    let bad = || InvalidMessage::BadDoneUrl {
        msg,
        value: shorten(url),
    };
    // Accept an optional tcp:// prefix (a ZMQ endpoint) as well as host:port.
    let rest = url.strip_prefix("tcp://").unwrap_or(url);
    let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
    if host.is_empty() || !matches!(port.parse::<u16>(), Ok(p) if p != 0) {
        return Err(bad());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{Dtype, MemFormat};

    fn layout() -> ChunkLayout {
        ChunkLayout {
            fmt: MemFormat::Kv2Ltd,
            layers: 2,
            tokens: 4,
            hidden: 8,
            dtype: Dtype::BFloat16,
        }
    }

    fn req() -> AllocRequest {
        AllocRequest {
            keys: vec!["a".into(), "b".into()],
            fmt: 1,
            shape: vec![2, 2, 4, 8],
            dtype: "bfloat16".into(),
            last_chunk_toks: 3,
            ..Default::default()
        }
    }

    fn notif() -> PullReadyNotif {
        PullReadyNotif {
            pull_id: "p1".into(),
            keys: vec!["a".into(), "b".into()],
            sender_buffer_uuids: vec![Uuid::new_v4().simple().to_string(); 2],
            sender_mem_indexes: vec![0, 7],
            sender_id: "s:1".into(),
            sender_done_url: "127.0.0.1:7700".into(),
            fmt: 1,
            shape: vec![2, 2, 4, 8],
            dtype: "bfloat16".into(),
            last_chunk_toks: 4,
            ..Default::default()
        }
    }

    fn err_text<T: std::fmt::Debug>(r: Result<T, InvalidMessage>) -> String {
        r.unwrap_err().to_string()
    }

    #[test]
    fn valid_messages_give_per_key_metas_with_partial_last() {
        let c = check_alloc_request(&req(), &layout()).unwrap();
        assert_eq!(c.metas.len(), 2);
        assert_eq!(c.metas[0].tokens, 4);
        assert_eq!(c.metas[1].tokens, 3);
        let p = check_pull_notif(&notif(), &layout()).unwrap();
        assert_eq!(p.remote[1].page, 7);
        assert_eq!(p.metas[1].tokens, 4);
    }

    #[test]
    fn every_bad_field_is_named() {
        let l = layout();
        let mut r = req();
        r.shape = vec![2, 2, 8, 8];
        assert_eq!(
            err_text(check_alloc_request(&r, &l)),
            "AllocRequest.shape: [2, 2, 8, 8] bfloat16 fmt 1 does not match this receiver's [2, 2, 4, 8] bfloat16 fmt 1"
        );
        let mut r = req();
        r.dtype = "complex".into();
        assert!(err_text(check_alloc_request(&r, &l)).contains("complex"));
        let mut r = req();
        r.fmt = 6;
        assert!(err_text(check_alloc_request(&r, &l)).contains("planes"));
        let mut r = req();
        r.keys.clear();
        assert_eq!(
            err_text(check_alloc_request(&r, &l)),
            "AllocRequest.keys: empty"
        );
        let mut r = req();
        r.keys = vec!["a".into(), "".into()];
        assert!(err_text(check_alloc_request(&r, &l)).contains("keys[1]: empty key"));
        let mut r = req();
        r.keys = vec!["a".into(), "b".into(), "a".into()];
        assert!(err_text(check_alloc_request(&r, &l)).contains("keys[2]: duplicate of keys[0]"));
        for bad in [0, 5, u64::MAX] {
            let mut r = req();
            r.last_chunk_toks = bad;
            assert!(err_text(check_alloc_request(&r, &l)).contains("last_chunk_toks"));
        }

        let mut n = notif();
        n.sender_mem_indexes.pop();
        assert!(err_text(check_pull_notif(&n, &l))
            .contains("PullReadyNotif.sender_mem_indexes: 1 entries for 2 keys"));
        let mut n = notif();
        n.sender_buffer_uuids.push("x".into());
        assert!(err_text(check_pull_notif(&n, &l)).contains("sender_buffer_uuids: 3 entries"));
        let mut n = notif();
        n.sender_mem_indexes[1] = u64::from(u32::MAX) + 1;
        assert!(err_text(check_pull_notif(&n, &l)).contains("sender_mem_indexes[1]"));
        let mut n = notif();
        n.sender_buffer_uuids[0] = "not-a-uuid".into();
        assert!(err_text(check_pull_notif(&n, &l)).contains("sender_buffer_uuids[0]"));
        let mut n = notif();
        n.pull_id.clear();
        assert!(err_text(check_pull_notif(&n, &l)).contains("pull_id: empty"));
        for url in ["nohost", ":7700", "h:0", "h:99999", "h:x"] {
            let mut n = notif();
            n.sender_done_url = url.into();
            assert!(
                err_text(check_pull_notif(&n, &l)).contains("sender_done_url"),
                "{url}"
            );
        }
        let mut n = notif();
        n.sender_done_url = "tcp://10.0.0.1:7700".into();
        assert!(check_pull_notif(&n, &l).is_ok());
        let e = check_pull_notif(
            &PullReadyNotif {
                keys: vec![],
                sender_buffer_uuids: vec![],
                sender_mem_indexes: vec![],
                ..notif()
            },
            &l,
        )
        .unwrap_err();
        assert_eq!(e.message_type(), MessageType::PullReadyNotif);
    }
}
