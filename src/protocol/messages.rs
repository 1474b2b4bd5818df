//! The side-channel messages and their msgspec-compatible msgpack codec.

use std::fmt;

use super::error::{shorten, DecodeError, EncodeError};
use crate::wire::{RawError, Reader, Writer};

/// `fmt` value of the `KV_2LTD` memory format: shape `[2, layers, tokens, hidden]`.
pub const FMT_KV_2LTD: i64 = 1;
/// `fmt` value of the MLA memory format.
pub const FMT_MLA: i64 = 6;

/// Name of the map key that carries the message type (msgspec `tag_field`).
pub const TYPE_KEY: &str = "type";

/// The type tag of a side-channel message (the value of its `"type"` key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MessageType {
    /// [`AllocRequest`]: push-mode allocation request (sender → receiver).
    AllocRequest,
    /// [`AscendAllocResponse`]: reply to an [`AllocRequest`].
    AscendAllocResponse,
    /// [`PullReadyNotif`]: pull-mode "data is pinned, read it" (sender → receiver).
    PullReadyNotif,
    /// [`PullReadyDoneAck`]: reply to a [`PullReadyNotif`].
    PullReadyDoneAck,
    /// [`PullDoneSignal`]: receiver finished reading a pull (receiver → sender).
    PullDoneSignal,
    /// [`ProxyNotif`]: last prefill chunk sent (sender → proxy).
    ProxyNotif,
    /// [`CancelNotif`]: upstream LMCache's "drop what this request holds"
    /// (sender → receiver, on the allocation socket).
    CancelNotif,
    /// [`CacheQueryRequest`]: upstream LMCache's decoder cache probe.
    CacheQueryRequest,
    /// [`CacheQueryResponse`]: the reply to a [`CacheQueryRequest`].
    CacheQueryResponse,
    /// [`RegisterDecode`]: router-native flow, a decode names its receiver
    /// for a transfer the prefill parked (decode → prefill registration port).
    RegisterDecode,
    /// [`RegisterDecodeAck`]: the reply to a [`RegisterDecode`].
    RegisterDecodeAck,
}

impl MessageType {
    /// Every message type, in the order of the protocol table.
    pub const ALL: [MessageType; 11] = [
        MessageType::AllocRequest,
        MessageType::AscendAllocResponse,
        MessageType::PullReadyNotif,
        MessageType::PullReadyDoneAck,
        MessageType::PullDoneSignal,
        MessageType::ProxyNotif,
        MessageType::CancelNotif,
        MessageType::CacheQueryRequest,
        MessageType::CacheQueryResponse,
        MessageType::RegisterDecode,
        MessageType::RegisterDecodeAck,
    ];

    /// The wire name (value of the `"type"` key), e.g. `"AllocRequest"`.
    pub const fn name(self) -> &'static str {
        match self {
            MessageType::AllocRequest => "AllocRequest",
            MessageType::AscendAllocResponse => "AscendAllocResponse",
            MessageType::PullReadyNotif => "PullReadyNotif",
            MessageType::PullReadyDoneAck => "PullReadyDoneAck",
            MessageType::PullDoneSignal => "PullDoneSignal",
            MessageType::ProxyNotif => "ProxyNotif",
            MessageType::CancelNotif => "CancelNotif",
            MessageType::CacheQueryRequest => "CacheQueryRequest",
            MessageType::CacheQueryResponse => "CacheQueryResponse",
            MessageType::RegisterDecode => "RegisterDecode",
            MessageType::RegisterDecodeAck => "RegisterDecodeAck",
        }
    }

    /// The type whose wire name is `name` (exact, case-sensitive match).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }
}

impl fmt::Display for MessageType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Push mode: the sender asks the receiver to allocate pages for `keys`.
///
/// Sent on the sender's REQ socket to the receiver's REP socket
/// (`pd_peer_alloc_port[rank]`); answered by [`AscendAllocResponse`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AllocRequest {
    /// Cache keys of the chunks to transfer, in order.
    pub keys: Vec<String>,
    /// Memory format of the chunks ([`FMT_KV_2LTD`], [`FMT_MLA`], ...);
    /// any integer is decoded, semantic checks are left to the caller.
    pub fmt: i64,
    /// Shape of one full chunk (e.g. `[2, layers, tokens, hidden]`).
    pub shape: Vec<u64>,
    /// Element dtype name, e.g. `"bfloat16"`.
    pub dtype: String,
    /// Number of tokens in the last key's chunk (only it may be partial).
    pub last_chunk_toks: u64,
    /// Upstream LMCache's async backend: the request these keys belong to
    /// (absent in LMCache-Ascend's five-field form, which we send).
    pub req_id: Option<String>,
    /// Upstream async backend: whether this is the request's last batch.
    pub is_last_batch: Option<bool>,
    /// Upstream async backend: chunks of the whole request.
    pub total_chunks: Option<u64>,
}

/// Push mode: the receiver's reply to an [`AllocRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AscendAllocResponse {
    /// Positions (into the request's `keys`) of chunks the receiver
    /// already holds; these are not transferred.
    pub already_sent_indexes: Vec<u64>,
    /// Receiver page index for each new key, in order.
    pub remote_indexes: Vec<u64>,
    /// Receiver buffer uuid (hex) for each new key, in order.
    pub remote_buffer_uuids: Vec<String>,
    /// `true` when the receiver could not allocate (everything rolled
    /// back). Defaults to `false` when absent on the wire.
    pub alloc_failed: bool,
}

/// Pull mode: the sender has pinned chunks and asks the receiver to read them.
///
/// Sent on the sender's REQ socket to the receiver's REP socket; answered
/// by [`PullReadyDoneAck`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PullReadyNotif {
    /// Identifier of this pull (hex uuid), echoed by [`PullDoneSignal`].
    pub pull_id: String,
    /// Cache keys of the chunks, in order.
    pub keys: Vec<String>,
    /// Sender buffer uuid (hex) holding each key's chunk.
    pub sender_buffer_uuids: Vec<String>,
    /// Sender page index of each key's chunk.
    pub sender_mem_indexes: Vec<u64>,
    /// Identity of the sender (`host:port`).
    pub sender_id: String,
    /// Where the receiver sends [`PullDoneSignal`] (`host:port`).
    pub sender_done_url: String,
    /// Memory format of the chunks ([`FMT_KV_2LTD`], [`FMT_MLA`], ...).
    pub fmt: i64,
    /// Shape of one full chunk.
    pub shape: Vec<u64>,
    /// Element dtype name, e.g. `"bfloat16"`.
    pub dtype: String,
    /// Number of tokens in the last key's chunk (only it may be partial).
    pub last_chunk_toks: u64,
    /// The request these keys belong to: ascend-pd's own addition (like
    /// upstream's async `AllocRequest`), encoded only when set, so the
    /// LMCache-Ascend form is unchanged; msgspec peers ignore it. A
    /// receiver keeps a key shared by several requests until each is done.
    pub req_id: Option<String>,
    /// Whether this is the request's last notification (as upstream's
    /// async `AllocRequest`; ascend-pd's addition here, encoded only when set).
    pub is_last_batch: Option<bool>,
    /// Chunks of the whole request, when the sender knows them: with
    /// `req_id`, a pull-eager receiver reserves the request's pages at its
    /// first notification or refuses it at once (see `protocol::admission`).
    pub total_chunks: Option<u64>,
}

/// Pull mode: the receiver's reply to a [`PullReadyNotif`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PullReadyDoneAck {
    /// Positions (into the notification's `keys`) the receiver already held.
    pub already_sent_indexes: Vec<u64>,
    /// `true` when the receiver could not allocate. Defaults to `false`
    /// when absent on the wire.
    pub alloc_failed: bool,
}

/// Pull mode: the receiver has finished with every chunk of a pull; the
/// sender may unpin them. Receiver PUSH → sender PULL
/// (`pd_pull_done_port[rank]`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PullDoneSignal {
    /// The `pull_id` of the finished [`PullReadyNotif`].
    pub pull_id: String,
}

/// The sender finished the last prefill chunk of a request. Sender PUSH →
/// proxy PULL (`pd_proxy_host:pd_proxy_port`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ProxyNotif {
    /// The request id.
    pub req_id: String,
}

/// A request was cancelled: the receiver drops what it holds for `keys`
/// (stored chunks return to the pool; pull-delay proxies are discarded, so
/// their pull's PullDoneSignal releases the sender's pins). Upstream
/// LMCache's message; sent on the sender's REQ socket to the receiver's
/// allocation socket, which answers with a `CancelNotif` naming the keys it
/// dropped (a REQ peer needs a reply to stay in step).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CancelNotif {
    /// The request id.
    pub req_id: String,
    /// Cache keys of the request's chunks.
    pub keys: Vec<String>,
}

/// Upstream LMCache's decoder cache probe: which of `keys` does the
/// receiver already hold? Answered on the allocation socket (and on
/// `pd_peer_query_port` when configured) by a [`CacheQueryResponse`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CacheQueryRequest {
    /// Cache keys to look up.
    pub keys: Vec<String>,
}

/// The answer to a [`CacheQueryRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CacheQueryResponse {
    /// The keys held, in query order.
    pub cached_keys: Vec<String>,
    /// Their positions in the query's `keys`.
    pub cached_indexes: Vec<u64>,
}

/// Router-native flow: a decode registers for a transfer its prefill
/// parked (the prefill's `kv_transfer_params` named the transfer and the
/// prefill rank's registration port). From it the prefill runs the usual
/// flow (push, pull-eager, pull-delay) to the receiver named here.
///
/// Sent on the decode's REQ socket to the prefill rank's ROUTER on
/// `pd_register_port[rank]`; answered by [`RegisterDecodeAck`]. Sealed
/// with the deployment secret when one is set (see `backend::register`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RegisterDecode {
    /// The prefill's id of the parked transfer (its request id).
    pub transfer_id: String,
    /// The decode receiver's host.
    pub receiver_host: String,
    /// The decode receiver's `pd_peer_init_port`, one per decode TP rank.
    pub receiver_init_port: Vec<u64>,
    /// The decode receiver's `pd_peer_alloc_port`, one per decode TP rank.
    pub receiver_alloc_port: Vec<u64>,
    /// Leading prompt tokens the decode already holds (its own prefix
    /// cache): the chunks they fill are not sent.
    pub held_tokens: u64,
}

/// The prefill's answer to a [`RegisterDecode`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RegisterDecodeAck {
    /// Whether the prefill sends the transfer to the registered receiver.
    pub accepted: bool,
    /// Why not, naming the problem and the fix (empty when accepted).
    pub error: String,
}

/// Any side-channel message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// See [`AllocRequest`].
    AllocRequest(AllocRequest),
    /// See [`AscendAllocResponse`].
    AscendAllocResponse(AscendAllocResponse),
    /// See [`PullReadyNotif`].
    PullReadyNotif(PullReadyNotif),
    /// See [`PullReadyDoneAck`].
    PullReadyDoneAck(PullReadyDoneAck),
    /// See [`PullDoneSignal`].
    PullDoneSignal(PullDoneSignal),
    /// See [`ProxyNotif`].
    ProxyNotif(ProxyNotif),
    /// See [`CancelNotif`].
    CancelNotif(CancelNotif),
    /// See [`CacheQueryRequest`].
    CacheQueryRequest(CacheQueryRequest),
    /// See [`CacheQueryResponse`].
    CacheQueryResponse(CacheQueryResponse),
    /// See [`RegisterDecode`].
    RegisterDecode(RegisterDecode),
    /// See [`RegisterDecodeAck`].
    RegisterDecodeAck(RegisterDecodeAck),
}

impl Message {
    /// The type tag of this message.
    pub fn message_type(&self) -> MessageType {
        match self {
            Message::AllocRequest(_) => MessageType::AllocRequest,
            Message::AscendAllocResponse(_) => MessageType::AscendAllocResponse,
            Message::PullReadyNotif(_) => MessageType::PullReadyNotif,
            Message::PullReadyDoneAck(_) => MessageType::PullReadyDoneAck,
            Message::PullDoneSignal(_) => MessageType::PullDoneSignal,
            Message::ProxyNotif(_) => MessageType::ProxyNotif,
            Message::CancelNotif(_) => MessageType::CancelNotif,
            Message::CacheQueryRequest(_) => MessageType::CacheQueryRequest,
            Message::CacheQueryResponse(_) => MessageType::CacheQueryResponse,
            Message::RegisterDecode(_) => MessageType::RegisterDecode,
            Message::RegisterDecodeAck(_) => MessageType::RegisterDecodeAck,
        }
    }

    /// Encode as one frame, byte-identical to msgspec's encoding: a map
    /// whose first key is `"type"`, then the fields in wire order, every
    /// value in its smallest msgpack form.
    pub fn try_encode(&self) -> Result<Vec<u8>, EncodeError> {
        match self {
            Message::AllocRequest(m) => m.try_encode(),
            Message::AscendAllocResponse(m) => m.try_encode(),
            Message::PullReadyNotif(m) => m.try_encode(),
            Message::PullReadyDoneAck(m) => m.try_encode(),
            Message::PullDoneSignal(m) => m.try_encode(),
            Message::ProxyNotif(m) => m.try_encode(),
            Message::CancelNotif(m) => m.try_encode(),
            Message::CacheQueryRequest(m) => m.try_encode(),
            Message::CacheQueryResponse(m) => m.try_encode(),
            Message::RegisterDecode(m) => m.try_encode(),
            Message::RegisterDecodeAck(m) => m.try_encode(),
        }
    }

    /// Encode as one frame; see [`Message::try_encode`].
    ///
    /// # Panics
    ///
    /// If a string is longer than 4 GiB or an array has more than
    /// 2^32-1 elements (msgpack cannot represent them).
    pub fn encode(&self) -> Vec<u8> {
        unwrap_encoded(self.try_encode())
    }

    /// Decode one frame.
    ///
    /// Keys may come in any order; unknown keys (with values of any msgpack
    /// type) are skipped; `alloc_failed` defaults to `false`; integers are
    /// accepted in any msgpack width. Duplicate known keys, trailing bytes
    /// and non-str map keys are errors. Never panics, and every length in
    /// the frame is checked against the remaining input before use.
    pub fn decode(bytes: &[u8]) -> Result<Message, DecodeError> {
        let (t, fields) = parse_frame(bytes)?;
        Ok(match t {
            MessageType::AllocRequest => Message::AllocRequest(AllocRequest {
                keys: fields.required("keys")?,
                fmt: fields.required("fmt")?,
                shape: fields.required("shape")?,
                dtype: fields.required("dtype")?,
                last_chunk_toks: fields.required("last_chunk_toks")?,
                req_id: fields.nullable("req_id")?,
                is_last_batch: fields.nullable("is_last_batch")?,
                total_chunks: fields.nullable("total_chunks")?,
            }),
            MessageType::AscendAllocResponse => Message::AscendAllocResponse(AscendAllocResponse {
                already_sent_indexes: fields.required("already_sent_indexes")?,
                remote_indexes: fields.required("remote_indexes")?,
                remote_buffer_uuids: fields.required("remote_buffer_uuids")?,
                alloc_failed: fields.optional("alloc_failed", false)?,
            }),
            MessageType::PullReadyNotif => Message::PullReadyNotif(PullReadyNotif {
                pull_id: fields.required("pull_id")?,
                keys: fields.required("keys")?,
                sender_buffer_uuids: fields.required("sender_buffer_uuids")?,
                sender_mem_indexes: fields.required("sender_mem_indexes")?,
                sender_id: fields.required("sender_id")?,
                sender_done_url: fields.required("sender_done_url")?,
                fmt: fields.required("fmt")?,
                shape: fields.required("shape")?,
                dtype: fields.required("dtype")?,
                last_chunk_toks: fields.required("last_chunk_toks")?,
                req_id: fields.nullable("req_id")?,
                is_last_batch: fields.nullable("is_last_batch")?,
                total_chunks: fields.nullable("total_chunks")?,
            }),
            MessageType::PullReadyDoneAck => Message::PullReadyDoneAck(PullReadyDoneAck {
                already_sent_indexes: fields.required("already_sent_indexes")?,
                alloc_failed: fields.optional("alloc_failed", false)?,
            }),
            MessageType::PullDoneSignal => Message::PullDoneSignal(PullDoneSignal {
                pull_id: fields.required("pull_id")?,
            }),
            MessageType::ProxyNotif => Message::ProxyNotif(ProxyNotif {
                req_id: fields.required("req_id")?,
            }),
            MessageType::CancelNotif => Message::CancelNotif(CancelNotif {
                req_id: fields.required("req_id")?,
                keys: fields.required("keys")?,
            }),
            MessageType::CacheQueryRequest => Message::CacheQueryRequest(CacheQueryRequest {
                keys: fields.required("keys")?,
            }),
            MessageType::CacheQueryResponse => Message::CacheQueryResponse(CacheQueryResponse {
                cached_keys: fields.required("cached_keys")?,
                cached_indexes: fields.required("cached_indexes")?,
            }),
            MessageType::RegisterDecode => Message::RegisterDecode(RegisterDecode {
                transfer_id: fields.required("transfer_id")?,
                receiver_host: fields.required("receiver_host")?,
                receiver_init_port: fields.required("receiver_init_port")?,
                receiver_alloc_port: fields.required("receiver_alloc_port")?,
                held_tokens: fields.optional("held_tokens", 0)?,
            }),
            MessageType::RegisterDecodeAck => Message::RegisterDecodeAck(RegisterDecodeAck {
                accepted: fields.required("accepted")?,
                error: fields.optional("error", String::new())?,
            }),
        })
    }
}

fn unwrap_encoded(r: Result<Vec<u8>, EncodeError>) -> Vec<u8> {
    match r {
        Ok(bytes) => bytes,
        Err(e) => panic!("cannot encode side-channel message: {e}"),
    }
}

/// Every field name of every message; only entries with these keys are
/// kept after the first pass, so unknown keys cost no memory.
const KNOWN_FIELDS: [&str; 26] = [
    "keys",
    "fmt",
    "shape",
    "dtype",
    "last_chunk_toks",
    "already_sent_indexes",
    "remote_indexes",
    "remote_buffer_uuids",
    "alloc_failed",
    "pull_id",
    "sender_buffer_uuids",
    "sender_mem_indexes",
    "sender_id",
    "sender_done_url",
    "req_id",
    "is_last_batch",
    "total_chunks",
    "cached_keys",
    "cached_indexes",
    "transfer_id",
    "receiver_host",
    "receiver_init_port",
    "receiver_alloc_port",
    "held_tokens",
    "accepted",
    "error",
];

/// One map entry whose key is a known field name, with its raw value bytes.
struct Entry<'a> {
    key: &'a str,
    value: &'a [u8],
}

/// The known-field entries of a frame whose type has been determined.
struct Fields<'a> {
    msg_type: MessageType,
    entries: Vec<Entry<'a>>,
}

/// First pass: validate the map structure, find the type, collect the
/// entries with known field names.
fn parse_frame(bytes: &[u8]) -> Result<(MessageType, Fields<'_>), DecodeError> {
    let mut r = Reader::new(bytes);
    if r.peek_marker().is_none() {
        return Err(DecodeError::EmptyFrame);
    }
    let n = r.map_len().map_err(|e| match e {
        RawError::WrongType { found, .. } => DecodeError::NotAMap { found },
        RawError::Reserved => DecodeError::NotAMap {
            found: "reserved byte 0xc1",
        },
        _ => DecodeError::Truncated {
            msg_type: None,
            field: None,
        },
    })?;

    let mut msg_type: Option<MessageType> = None;
    // `n` is bounded by the input length; no entry list is sized from it.
    let mut entries = Vec::new();
    for _ in 0..n {
        let key = r.str().map_err(|e| match e {
            RawError::WrongType { found, .. } => DecodeError::NonStringKey { msg_type, found },
            other => located(other, msg_type, None),
        })?;
        let start = r.pos();
        r.skip_value()
            .map_err(|e| located(e, msg_type, Some(shorten(key))))?;
        let value = r.slice(start, r.pos());
        if key == TYPE_KEY {
            if let Some(t) = msg_type {
                return Err(DecodeError::DuplicateField {
                    msg_type: t,
                    field: TYPE_KEY,
                });
            }
            let name = Reader::new(value).str().map_err(|e| match e {
                RawError::WrongType { found, .. } => DecodeError::InvalidTypeTag { found },
                other => located(other, None, Some(TYPE_KEY.to_owned())),
            })?;
            msg_type =
                Some(
                    MessageType::from_name(name).ok_or_else(|| DecodeError::UnknownType {
                        name: shorten(name),
                    })?,
                );
        } else if KNOWN_FIELDS.contains(&key) {
            entries.push(Entry { key, value });
        }
    }
    if r.remaining() > 0 {
        return Err(DecodeError::TrailingBytes {
            msg_type,
            count: r.remaining(),
        });
    }
    let msg_type = msg_type.ok_or(DecodeError::MissingType)?;
    Ok((msg_type, Fields { msg_type, entries }))
}

/// Attach a location to a structural error found while the message type
/// may still be unknown (truncation, bad UTF-8, reserved byte).
fn located(e: RawError, msg_type: Option<MessageType>, field: Option<String>) -> DecodeError {
    match e {
        RawError::InvalidUtf8 => DecodeError::InvalidUtf8 { msg_type, field },
        RawError::Reserved => DecodeError::ReservedByte { msg_type, field },
        // Kind and range errors never arise while only skipping values or
        // reading keys; report them as malformed (truncated) input.
        RawError::Truncated | RawError::WrongType { .. } | RawError::OutOfRange { .. } => {
            DecodeError::Truncated { msg_type, field }
        }
    }
}

/// A failure inside a field value: the raw error and, for arrays, the
/// index of the offending element.
type FieldError = (Option<usize>, RawError);

/// A value type a message field can have.
trait FieldValue: Sized {
    /// Read one value of this type, consuming exactly its bytes.
    fn read(r: &mut Reader<'_>) -> Result<Self, FieldError>;
}

impl FieldValue for String {
    fn read(r: &mut Reader<'_>) -> Result<Self, FieldError> {
        r.str().map(str::to_owned).map_err(|e| (None, e))
    }
}

impl FieldValue for u64 {
    fn read(r: &mut Reader<'_>) -> Result<Self, FieldError> {
        r.uint().map_err(|e| (None, e))
    }
}

impl FieldValue for i64 {
    fn read(r: &mut Reader<'_>) -> Result<Self, FieldError> {
        r.sint().map_err(|e| (None, e))
    }
}

impl FieldValue for bool {
    fn read(r: &mut Reader<'_>) -> Result<Self, FieldError> {
        r.bool().map_err(|e| (None, e))
    }
}

impl<T: FieldValue> FieldValue for Vec<T> {
    fn read(r: &mut Reader<'_>) -> Result<Self, FieldError> {
        // `array_len` has checked `n` against the remaining input; the
        // initial capacity is additionally capped.
        let n = r.array_len().map_err(|e| (None, e))?;
        let mut out = Vec::with_capacity(n.min(1024));
        for i in 0..n {
            out.push(T::read(r).map_err(|(_, e)| (Some(i), e))?);
        }
        Ok(out)
    }
}

impl Fields<'_> {
    /// Decode field `name` if present.
    fn get<T: FieldValue>(&self, name: &'static str) -> Result<Option<T>, DecodeError> {
        let t = self.msg_type;
        let mut found: Option<&[u8]> = None;
        for e in self.entries.iter().filter(|e| e.key == name) {
            if found.is_some() {
                return Err(DecodeError::DuplicateField {
                    msg_type: t,
                    field: name,
                });
            }
            found = Some(e.value);
        }
        let Some(bytes) = found else {
            return Ok(None);
        };
        let mut r = Reader::new(bytes);
        let value = T::read(&mut r).map_err(|(index, e)| {
            let field = match index {
                Some(i) => format!("{name}[{i}]"),
                None => name.to_owned(),
            };
            match e {
                RawError::WrongType { expected, found } => DecodeError::WrongType {
                    msg_type: t,
                    field,
                    expected,
                    found,
                },
                RawError::OutOfRange { value, expected } => DecodeError::OutOfRange {
                    msg_type: t,
                    field,
                    value,
                    expected,
                },
                other => located(other, Some(t), Some(field)),
            }
        })?;
        if r.remaining() != 0 {
            // Cannot happen (the first pass delimited exactly one value),
            // but never accept bytes that were not understood.
            return Err(DecodeError::Truncated {
                msg_type: Some(t),
                field: Some(name.to_owned()),
            });
        }
        Ok(Some(value))
    }

    /// Decode optional field `name`: absent or nil is `None` (msgspec
    /// writes an unset `Optional` field as nil unless `omit_defaults`).
    fn nullable<T: FieldValue>(&self, name: &'static str) -> Result<Option<T>, DecodeError> {
        let nil = self
            .entries
            .iter()
            .any(|e| e.key == name && e.value == [0xc0]);
        if nil {
            // Still refuse a duplicate.
            if self.entries.iter().filter(|e| e.key == name).count() > 1 {
                return Err(DecodeError::DuplicateField {
                    msg_type: self.msg_type,
                    field: name,
                });
            }
            return Ok(None);
        }
        self.get(name)
    }

    /// Decode required field `name`.
    fn required<T: FieldValue>(&self, name: &'static str) -> Result<T, DecodeError> {
        self.get(name)?.ok_or(DecodeError::MissingField {
            msg_type: self.msg_type,
            field: name,
        })
    }

    /// Decode defaulted field `name`.
    fn optional<T: FieldValue>(&self, name: &'static str, default: T) -> Result<T, DecodeError> {
        Ok(self.get(name)?.unwrap_or(default))
    }
}

/// Map writer for one message: writes the header and `"type"`, then fields.
struct Enc {
    w: Writer,
    msg_type: MessageType,
}

impl Enc {
    /// Start a message with `n_fields` fields after `"type"`.
    fn new(msg_type: MessageType, n_fields: usize, size_hint: usize) -> Result<Self, EncodeError> {
        let mut enc = Enc {
            w: Writer::with_capacity(size_hint),
            msg_type,
        };
        enc.w
            .map_len(n_fields + 1)
            .map_err(|e| enc.too_long("<map>", e.len))?;
        enc.str(TYPE_KEY, msg_type.name())?;
        Ok(enc)
    }

    fn too_long(&self, field: &'static str, len: usize) -> EncodeError {
        EncodeError::TooLong {
            msg_type: self.msg_type,
            field,
            len,
        }
    }

    fn key(&mut self, name: &'static str) -> Result<(), EncodeError> {
        self.w.str(name).map_err(|e| self.too_long(name, e.len))
    }

    fn str(&mut self, name: &'static str, v: &str) -> Result<(), EncodeError> {
        self.key(name)?;
        self.w.str(v).map_err(|e| self.too_long(name, e.len))
    }

    fn str_list(&mut self, name: &'static str, v: &[String]) -> Result<(), EncodeError> {
        self.key(name)?;
        self.w
            .array_len(v.len())
            .map_err(|e| self.too_long(name, e.len))?;
        for s in v {
            self.w.str(s).map_err(|e| self.too_long(name, e.len))?;
        }
        Ok(())
    }

    fn uint(&mut self, name: &'static str, v: u64) -> Result<(), EncodeError> {
        self.key(name)?;
        self.w.uint(v);
        Ok(())
    }

    fn int(&mut self, name: &'static str, v: i64) -> Result<(), EncodeError> {
        self.key(name)?;
        self.w.int(v);
        Ok(())
    }

    fn uint_list(&mut self, name: &'static str, v: &[u64]) -> Result<(), EncodeError> {
        self.key(name)?;
        self.w
            .array_len(v.len())
            .map_err(|e| self.too_long(name, e.len))?;
        for &x in v {
            self.w.uint(x);
        }
        Ok(())
    }

    fn bool(&mut self, name: &'static str, v: bool) -> Result<(), EncodeError> {
        self.key(name)?;
        self.w.bool(v);
        Ok(())
    }

    fn finish(self) -> Vec<u8> {
        self.w.into_bytes()
    }
}

/// Rough encoded size: fixed overhead plus string payloads plus 9 bytes
/// per integer (the widest form).
fn hint(strings: &[&[String]], single: &[&str], ints: usize) -> usize {
    let lists: usize = strings
        .iter()
        .flat_map(|l| l.iter())
        .map(|s| s.len() + 5)
        .sum();
    let singles: usize = single.iter().map(|s| s.len() + 5).sum();
    256 + lists + singles + 9 * ints
}

impl AllocRequest {
    fn encode_impl(&self) -> Result<Vec<u8>, EncodeError> {
        let rid = self.req_id.as_deref().unwrap_or("");
        let size = hint(&[&self.keys], &[&self.dtype, rid], self.shape.len() + 4);
        // The five-field form unless the upstream async fields are set;
        // those that are follow in upstream's order.
        let extra = usize::from(self.req_id.is_some())
            + usize::from(self.is_last_batch.is_some())
            + usize::from(self.total_chunks.is_some());
        let mut e = Enc::new(MessageType::AllocRequest, 5 + extra, size)?;
        e.str_list("keys", &self.keys)?;
        e.int("fmt", self.fmt)?;
        e.uint_list("shape", &self.shape)?;
        e.str("dtype", &self.dtype)?;
        e.uint("last_chunk_toks", self.last_chunk_toks)?;
        if let Some(r) = &self.req_id {
            e.str("req_id", r)?;
        }
        if let Some(b) = self.is_last_batch {
            e.bool("is_last_batch", b)?;
        }
        if let Some(n) = self.total_chunks {
            e.uint("total_chunks", n)?;
        }
        Ok(e.finish())
    }
}

impl AscendAllocResponse {
    fn encode_impl(&self) -> Result<Vec<u8>, EncodeError> {
        let size = hint(
            &[&self.remote_buffer_uuids],
            &[],
            self.already_sent_indexes.len() + self.remote_indexes.len(),
        );
        let mut e = Enc::new(MessageType::AscendAllocResponse, 4, size)?;
        e.uint_list("already_sent_indexes", &self.already_sent_indexes)?;
        e.uint_list("remote_indexes", &self.remote_indexes)?;
        e.str_list("remote_buffer_uuids", &self.remote_buffer_uuids)?;
        e.bool("alloc_failed", self.alloc_failed)?;
        Ok(e.finish())
    }
}

impl PullReadyNotif {
    fn encode_impl(&self) -> Result<Vec<u8>, EncodeError> {
        let size = hint(
            &[&self.keys, &self.sender_buffer_uuids],
            &[
                &self.pull_id,
                &self.sender_id,
                &self.sender_done_url,
                &self.dtype,
            ],
            self.sender_mem_indexes.len() + self.shape.len() + 2,
        );
        let extra = usize::from(self.req_id.is_some())
            + usize::from(self.is_last_batch.is_some())
            + usize::from(self.total_chunks.is_some());
        let mut e = Enc::new(
            MessageType::PullReadyNotif,
            10 + extra,
            size + self.req_id.as_ref().map_or(0, |r| r.len() + 16) + 48,
        )?;
        e.str("pull_id", &self.pull_id)?;
        e.str_list("keys", &self.keys)?;
        e.str_list("sender_buffer_uuids", &self.sender_buffer_uuids)?;
        e.uint_list("sender_mem_indexes", &self.sender_mem_indexes)?;
        e.str("sender_id", &self.sender_id)?;
        e.str("sender_done_url", &self.sender_done_url)?;
        e.int("fmt", self.fmt)?;
        e.uint_list("shape", &self.shape)?;
        e.str("dtype", &self.dtype)?;
        e.uint("last_chunk_toks", self.last_chunk_toks)?;
        if let Some(r) = &self.req_id {
            e.str("req_id", r)?;
        }
        if let Some(b) = self.is_last_batch {
            e.bool("is_last_batch", b)?;
        }
        if let Some(n) = self.total_chunks {
            e.uint("total_chunks", n)?;
        }
        Ok(e.finish())
    }
}

impl PullReadyDoneAck {
    fn encode_impl(&self) -> Result<Vec<u8>, EncodeError> {
        let size = hint(&[], &[], self.already_sent_indexes.len());
        let mut e = Enc::new(MessageType::PullReadyDoneAck, 2, size)?;
        e.uint_list("already_sent_indexes", &self.already_sent_indexes)?;
        e.bool("alloc_failed", self.alloc_failed)?;
        Ok(e.finish())
    }
}

impl PullDoneSignal {
    fn encode_impl(&self) -> Result<Vec<u8>, EncodeError> {
        let mut e = Enc::new(
            MessageType::PullDoneSignal,
            1,
            hint(&[], &[&self.pull_id], 0),
        )?;
        e.str("pull_id", &self.pull_id)?;
        Ok(e.finish())
    }
}

impl ProxyNotif {
    fn encode_impl(&self) -> Result<Vec<u8>, EncodeError> {
        let mut e = Enc::new(MessageType::ProxyNotif, 1, hint(&[], &[&self.req_id], 0))?;
        e.str("req_id", &self.req_id)?;
        Ok(e.finish())
    }
}

impl CancelNotif {
    fn encode_impl(&self) -> Result<Vec<u8>, EncodeError> {
        let size = hint(&[&self.keys], &[&self.req_id], 0);
        let mut e = Enc::new(MessageType::CancelNotif, 2, size)?;
        e.str("req_id", &self.req_id)?;
        e.str_list("keys", &self.keys)?;
        Ok(e.finish())
    }
}

impl CacheQueryRequest {
    fn encode_impl(&self) -> Result<Vec<u8>, EncodeError> {
        let mut e = Enc::new(
            MessageType::CacheQueryRequest,
            1,
            hint(&[&self.keys], &[], 0),
        )?;
        e.str_list("keys", &self.keys)?;
        Ok(e.finish())
    }
}

impl CacheQueryResponse {
    fn encode_impl(&self) -> Result<Vec<u8>, EncodeError> {
        let size = hint(&[&self.cached_keys], &[], self.cached_indexes.len());
        let mut e = Enc::new(MessageType::CacheQueryResponse, 2, size)?;
        e.str_list("cached_keys", &self.cached_keys)?;
        e.uint_list("cached_indexes", &self.cached_indexes)?;
        Ok(e.finish())
    }
}

impl RegisterDecode {
    fn encode_impl(&self) -> Result<Vec<u8>, EncodeError> {
        let size = hint(
            &[],
            &[&self.transfer_id, &self.receiver_host],
            self.receiver_init_port.len() + self.receiver_alloc_port.len() + 1,
        );
        let mut e = Enc::new(MessageType::RegisterDecode, 5, size)?;
        e.str("transfer_id", &self.transfer_id)?;
        e.str("receiver_host", &self.receiver_host)?;
        e.uint_list("receiver_init_port", &self.receiver_init_port)?;
        e.uint_list("receiver_alloc_port", &self.receiver_alloc_port)?;
        e.uint("held_tokens", self.held_tokens)?;
        Ok(e.finish())
    }
}

impl RegisterDecodeAck {
    fn encode_impl(&self) -> Result<Vec<u8>, EncodeError> {
        let mut e = Enc::new(
            MessageType::RegisterDecodeAck,
            2,
            hint(&[], &[&self.error], 1),
        )?;
        e.bool("accepted", self.accepted)?;
        e.str("error", &self.error)?;
        Ok(e.finish())
    }
}

/// Per-message API: type constant, encoding, typed decoding and
/// conversions to and from [`Message`].
macro_rules! wire_message {
    ($ty:ident) => {
        impl $ty {
            /// The wire type tag of this message.
            pub const TYPE: MessageType = MessageType::$ty;

            /// Encode as one frame, byte-identical to msgspec (see
            /// [`Message::try_encode`]).
            pub fn try_encode(&self) -> Result<Vec<u8>, EncodeError> {
                self.encode_impl()
            }

            /// Encode as one frame; see [`Message::try_encode`].
            ///
            /// # Panics
            ///
            /// If a string is longer than 4 GiB or an array has more than
            /// 2^32-1 elements (msgpack cannot represent them).
            pub fn encode(&self) -> Vec<u8> {
                unwrap_encoded(self.encode_impl())
            }

            /// Decode a frame that must hold this message type (for a
            /// socket that only ever carries it). A valid frame of another
            /// type gives [`DecodeError::UnexpectedMessage`]; otherwise as
            /// [`Message::decode`].
            pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
                match Message::decode(bytes)? {
                    Message::$ty(m) => Ok(m),
                    other => Err(DecodeError::UnexpectedMessage {
                        expected: MessageType::$ty,
                        found: other.message_type(),
                    }),
                }
            }
        }

        impl From<$ty> for Message {
            fn from(m: $ty) -> Self {
                Message::$ty(m)
            }
        }

        impl TryFrom<Message> for $ty {
            /// The message itself, when it is of another type.
            type Error = Message;

            fn try_from(m: Message) -> Result<Self, Message> {
                match m {
                    Message::$ty(inner) => Ok(inner),
                    other => Err(other),
                }
            }
        }
    };
}

wire_message!(AllocRequest);
wire_message!(AscendAllocResponse);
wire_message!(PullReadyNotif);
wire_message!(PullReadyDoneAck);
wire_message!(PullDoneSignal);
wire_message!(ProxyNotif);
wire_message!(CancelNotif);
wire_message!(CacheQueryRequest);
wire_message!(CacheQueryResponse);
wire_message!(RegisterDecode);
wire_message!(RegisterDecodeAck);
