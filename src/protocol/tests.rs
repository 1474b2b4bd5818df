//! Unit tests of the side-channel codec: widths, key order, unknown keys,
//! defaults, every error class, robustness against malformed input.

use std::time::{Duration, Instant};

use super::*;
use crate::wire::{Reader, Writer};

// ---------------------------------------------------------------- helpers

fn alloc_request() -> AllocRequest {
    AllocRequest {
        keys: vec![
            "vllm@Qwen/Qwen3-8B@2@0@1a2b3c4d5e6f7081@bfloat16".to_owned(),
            "k2".to_owned(),
        ],
        fmt: FMT_KV_2LTD,
        shape: vec![2, 36, 256, 1024],
        dtype: "bfloat16".to_owned(),
        last_chunk_toks: 77,
        ..Default::default()
    }
}

fn pull_ready_notif() -> PullReadyNotif {
    PullReadyNotif {
        pull_id: "9d3c1b2a4e5f60718293a4b5c6d7e8f9".to_owned(),
        keys: vec!["a".to_owned(), "b".to_owned(), "c".to_owned()],
        sender_buffer_uuids: vec!["u0".to_owned(), "u1".to_owned(), "u1".to_owned()],
        sender_mem_indexes: vec![0, 300, 70_000],
        sender_id: "10.0.0.5:7600".to_owned(),
        sender_done_url: "10.0.0.5:7700".to_owned(),
        fmt: FMT_MLA,
        shape: vec![1, 61, 256, 576],
        dtype: "bfloat16".to_owned(),
        last_chunk_toks: 256,
        ..Default::default()
    }
}

fn samples() -> Vec<Message> {
    vec![
        alloc_request().into(),
        AscendAllocResponse {
            already_sent_indexes: vec![0, 2],
            remote_indexes: vec![4, 5_000_000_000],
            remote_buffer_uuids: vec!["x".repeat(32), "y".repeat(300)],
            alloc_failed: false,
        }
        .into(),
        AscendAllocResponse {
            alloc_failed: true,
            ..Default::default()
        }
        .into(),
        pull_ready_notif().into(),
        PullReadyDoneAck {
            already_sent_indexes: vec![1],
            alloc_failed: true,
        }
        .into(),
        PullDoneSignal {
            pull_id: "p".to_owned(),
        }
        .into(),
        ProxyNotif {
            req_id: String::new(),
        }
        .into(),
    ]
}

/// Split an encoded map into its raw (key, value) entries.
fn split_entries(frame: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut r = Reader::new(frame);
    let n = r.map_len().expect("map header");
    let mut out = Vec::new();
    for _ in 0..n {
        let k0 = r.pos();
        r.skip_value().expect("key");
        let v0 = r.pos();
        r.skip_value().expect("value");
        out.push((r.slice(k0, v0).to_vec(), r.slice(v0, r.pos()).to_vec()));
    }
    assert_eq!(r.remaining(), 0);
    out
}

fn key_of(entry: &(Vec<u8>, Vec<u8>)) -> String {
    Reader::new(&entry.0).str().expect("str key").to_owned()
}

/// Build a map frame from raw entries.
fn join_entries(entries: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    let mut w = Writer::default();
    w.map_len(entries.len()).expect("len");
    for (k, v) in entries {
        w.raw(k);
        w.raw(v);
    }
    w.into_bytes()
}

/// A (key, value) entry with a str key and a raw value.
fn entry(key: &str, value: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let mut w = Writer::default();
    w.str(key).expect("key");
    (w.into_bytes(), value.to_vec())
}

fn enc_str(s: &str) -> Vec<u8> {
    let mut w = Writer::default();
    w.str(s).expect("str");
    w.into_bytes()
}

/// Replace the value of `key` in `frame` (which must contain it).
fn with_value(frame: &[u8], key: &str, value: &[u8]) -> Vec<u8> {
    let mut entries = split_entries(frame);
    let e = entries
        .iter_mut()
        .find(|e| key_of(e) == key)
        .expect("key present");
    e.1 = value.to_vec();
    join_entries(&entries)
}

fn without(frame: &[u8], key: &str) -> Vec<u8> {
    let entries: Vec<_> = split_entries(frame)
        .into_iter()
        .filter(|e| key_of(e) != key)
        .collect();
    join_entries(&entries)
}

/// `frame` with one more entry `"z": value` appended.
fn with_extra(frame: &[u8], value: &[u8]) -> Vec<u8> {
    let mut entries = split_entries(frame);
    entries.push(entry("z", value));
    join_entries(&entries)
}

fn err_of(frame: &[u8]) -> (DecodeError, String) {
    let e = Message::decode(frame).expect_err("decoding must fail");
    let text = e.to_string();
    (e, text)
}

/// splitmix64: tiny deterministic PRNG.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

// ---------------------------------------------------------------- widths

#[test]
fn uint_widths_are_minimal() {
    let cases: &[(u64, &[u8])] = &[
        (0, &[0x00]),
        (127, &[0x7f]),
        (128, &[0xcc, 0x80]),
        (255, &[0xcc, 0xff]),
        (256, &[0xcd, 0x01, 0x00]),
        (65_535, &[0xcd, 0xff, 0xff]),
        (65_536, &[0xce, 0x00, 0x01, 0x00, 0x00]),
        (u64::from(u32::MAX), &[0xce, 0xff, 0xff, 0xff, 0xff]),
        (u64::from(u32::MAX) + 1, &[0xcf, 0, 0, 0, 1, 0, 0, 0, 0]),
    ];
    for &(v, want) in cases {
        let mut w = Writer::default();
        w.uint(v);
        assert_eq!(w.into_bytes(), want, "uint {v}");
    }
}

#[test]
fn int_widths_are_minimal() {
    let cases: &[(i64, &[u8])] = &[
        (1, &[0x01]),
        (300, &[0xcd, 0x01, 0x2c]),
        (-1, &[0xff]),
        (-32, &[0xe0]),
        (-33, &[0xd0, 0xdf]),
        (-128, &[0xd0, 0x80]),
        (-129, &[0xd1, 0xff, 0x7f]),
        (-32_768, &[0xd1, 0x80, 0x00]),
        (-32_769, &[0xd2, 0xff, 0xff, 0x7f, 0xff]),
        (i64::from(i32::MIN), &[0xd2, 0x80, 0, 0, 0]),
        (
            i64::from(i32::MIN) - 1,
            &[0xd3, 0xff, 0xff, 0xff, 0xff, 0x7f, 0xff, 0xff, 0xff],
        ),
    ];
    for &(v, want) in cases {
        let mut w = Writer::default();
        w.int(v);
        assert_eq!(w.into_bytes(), want, "int {v}");
    }
}

#[test]
fn str_array_and_map_widths_are_minimal() {
    for (len, header) in [
        (0usize, vec![0xa0]),
        (31, vec![0xbf]),
        (32, vec![0xd9, 32]),
        (255, vec![0xd9, 255]),
        (256, vec![0xda, 0x01, 0x00]),
        (65_535, vec![0xda, 0xff, 0xff]),
        (65_536, vec![0xdb, 0x00, 0x01, 0x00, 0x00]),
    ] {
        let s = "s".repeat(len);
        let mut w = Writer::default();
        w.str(&s).expect("str");
        let bytes = w.into_bytes();
        assert_eq!(&bytes[..header.len()], header.as_slice(), "str len {len}");
        assert_eq!(bytes.len(), header.len() + len);
    }
    for (len, header) in [
        (0usize, vec![0x90]),
        (15, vec![0x9f]),
        (16, vec![0xdc, 0x00, 0x10]),
        (65_535, vec![0xdc, 0xff, 0xff]),
        (65_536, vec![0xdd, 0x00, 0x01, 0x00, 0x00]),
    ] {
        let mut w = Writer::default();
        w.array_len(len).expect("array");
        assert_eq!(w.into_bytes(), header, "array len {len}");
    }
    for (len, header) in [
        (0usize, vec![0x80]),
        (15, vec![0x8f]),
        (16, vec![0xde, 0x00, 0x10]),
        (65_536, vec![0xdf, 0x00, 0x01, 0x00, 0x00]),
    ] {
        let mut w = Writer::default();
        w.map_len(len).expect("map");
        assert_eq!(w.into_bytes(), header, "map len {len}");
    }
}

#[cfg(target_pointer_width = "64")]
#[test]
fn lengths_beyond_u32_are_rejected_by_the_writer() {
    let mut w = Writer::default();
    let too_big = u32::MAX as usize + 1;
    assert_eq!(w.array_len(too_big).map_err(|e| e.len), Err(too_big));
    assert_eq!(w.map_len(too_big).map_err(|e| e.len), Err(too_big));
    assert!(w.into_bytes().is_empty(), "nothing written on error");
}

#[test]
fn large_message_uses_wide_headers_and_round_trips() {
    let m = PullReadyNotif {
        keys: (0..70_000).map(|i| format!("key-{i}")).collect(),
        sender_buffer_uuids: vec!["u".repeat(70_000)],
        sender_mem_indexes: (0..20).map(|i| u64::MAX - i).collect(),
        fmt: i64::MIN,
        ..pull_ready_notif()
    };
    let frame = m.encode();
    let entries = split_entries(&frame);
    let keys = entries.iter().find(|e| key_of(e) == "keys").expect("keys");
    assert_eq!(keys.1[0], 0xdd, "array32 for 70000 keys");
    let uuids = entries
        .iter()
        .find(|e| key_of(e) == "sender_buffer_uuids")
        .expect("uuids");
    assert_eq!(&uuids.1[..2], &[0x91, 0xdb], "str32 for a 70000-byte str");
    let idx = entries
        .iter()
        .find(|e| key_of(e) == "sender_mem_indexes")
        .expect("indexes");
    assert_eq!(&idx.1[..2], &[0xdc, 0x00], "array16 for 20 elements");
    assert_eq!(PullReadyNotif::decode(&frame), Ok(m));
}

// ---------------------------------------------------------------- round trip

#[test]
fn every_message_round_trips_and_starts_with_type() {
    for m in samples() {
        let frame = m.encode();
        assert_eq!(m.try_encode().as_ref(), Ok(&frame));
        let entries = split_entries(&frame);
        assert_eq!(key_of(&entries[0]), TYPE_KEY);
        assert_eq!(
            Reader::new(&entries[0].1).str(),
            Ok(m.message_type().name())
        );
        assert_eq!(Message::decode(&frame), Ok(m.clone()), "{m:?}");
    }
}

#[test]
fn field_order_on_the_wire_is_the_protocol_order() {
    let expect: [(MessageType, &[&str]); 6] = [
        (
            MessageType::AllocRequest,
            &["type", "keys", "fmt", "shape", "dtype", "last_chunk_toks"],
        ),
        (
            MessageType::AscendAllocResponse,
            &[
                "type",
                "already_sent_indexes",
                "remote_indexes",
                "remote_buffer_uuids",
                "alloc_failed",
            ],
        ),
        (
            MessageType::PullReadyNotif,
            &[
                "type",
                "pull_id",
                "keys",
                "sender_buffer_uuids",
                "sender_mem_indexes",
                "sender_id",
                "sender_done_url",
                "fmt",
                "shape",
                "dtype",
                "last_chunk_toks",
            ],
        ),
        (
            MessageType::PullReadyDoneAck,
            &["type", "already_sent_indexes", "alloc_failed"],
        ),
        (MessageType::PullDoneSignal, &["type", "pull_id"]),
        (MessageType::ProxyNotif, &["type", "req_id"]),
    ];
    let samples = samples();
    for (t, keys) in expect {
        let m = samples
            .iter()
            .find(|m| m.message_type() == t)
            .expect("sample");
        let got: Vec<String> = split_entries(&m.encode()).iter().map(key_of).collect();
        assert_eq!(got, keys, "{t}");
    }
}

#[test]
fn typed_decode_and_conversions() {
    let frame = alloc_request().encode();
    assert_eq!(AllocRequest::decode(&frame), Ok(alloc_request()));
    let e = PullReadyNotif::decode(&frame).expect_err("wrong type");
    assert_eq!(
        e,
        DecodeError::UnexpectedMessage {
            expected: MessageType::PullReadyNotif,
            found: MessageType::AllocRequest
        }
    );
    let text = e.to_string();
    assert!(
        text.contains("PullReadyNotif") && text.contains("AllocRequest"),
        "{text}"
    );

    let m: Message = alloc_request().into();
    assert_eq!(AllocRequest::try_from(m.clone()), Ok(alloc_request()));
    assert_eq!(ProxyNotif::try_from(m.clone()), Err(m));
    assert_eq!(AllocRequest::TYPE, MessageType::AllocRequest);
    for t in MessageType::ALL {
        assert_eq!(MessageType::from_name(t.name()), Some(t));
        assert_eq!(t.to_string(), t.name());
    }
    assert_eq!(MessageType::from_name("allocrequest"), None);
}

// ---------------------------------------------------------------- leniency

#[test]
fn decode_accepts_any_key_order() {
    let mut rng = Rng(7);
    for m in samples() {
        let entries = split_entries(&m.encode());
        let n = entries.len();
        let mut orders: Vec<Vec<usize>> = (0..n)
            .map(|rot| (0..n).map(|i| (i + rot) % n).collect())
            .collect();
        orders.push((0..n).rev().collect());
        for _ in 0..20 {
            let mut p: Vec<usize> = (0..n).collect();
            for i in (1..n).rev() {
                p.swap(i, rng.below(i + 1));
            }
            orders.push(p);
        }
        for order in orders {
            let permuted: Vec<_> = order.iter().map(|&i| entries[i].clone()).collect();
            assert_eq!(
                Message::decode(&join_entries(&permuted)),
                Ok(m.clone()),
                "order {order:?}"
            );
        }
    }
}

/// Values of every msgpack kind, including nested containers.
fn exotic_values() -> Vec<Vec<u8>> {
    let mut nested = Writer::default();
    nested.map_len(4).expect("map");
    nested.str("inner").expect("k");
    nested.array_len(4).expect("arr");
    nested.raw(&[
        0xc0, 0xc3, 0xcb, 0x40, 0x09, 0x21, 0xfb, 0x54, 0x44, 0x2d, 0x18,
    ]);
    nested.map_len(1).expect("map");
    nested.uint(1);
    nested.raw(&[0xc4, 0x02, 0xde, 0xad]);
    nested.raw(&[0xd6, 0x01, 1, 2, 3, 4]);
    nested.int(-5);
    nested.str("type").expect("k");
    nested.str("NotAType").expect("v");
    nested.raw(&[0x90]); // key: empty array
    nested.raw(&[0x80]); // value: empty map
    vec![
        vec![0xc0],                                     // nil
        vec![0xc2],                                     // false
        vec![0xca, 0x3f, 0x80, 0x00, 0x00],             // float32
        vec![0xcb, 0, 0, 0, 0, 0, 0, 0xf0, 0x3f],       // float64
        vec![0xc4, 0x03, 1, 2, 3],                      // bin8
        vec![0xc5, 0x00, 0x01, 0xff],                   // bin16
        vec![0xc6, 0, 0, 0, 1, 0xc1],                   // bin32 holding 0xc1 as data
        vec![0xd4, 0x05, 0x00],                         // fixext1
        vec![0xd5, 0x05, 0, 0],                         // fixext2
        vec![0xd7, 0xff, 0, 0, 0, 0, 0, 0, 0, 0],       // fixext8 (timestamp)
        [vec![0xd8, 0x01], vec![0; 16]].concat(),       // fixext16
        vec![0xc7, 0x02, 0x07, 0xaa, 0xbb],             // ext8
        vec![0xc8, 0x00, 0x01, 0x07, 0xaa],             // ext16
        vec![0xc9, 0, 0, 0, 0, 0x07],                   // ext32, empty
        vec![0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0],          // int64 min
        vec![0xdc, 0x00, 0x02, 0x01, 0xa1, b'x'],       // array16
        vec![0xde, 0x00, 0x01, 0xa1, b'k', 0x91, 0x90], // map16
        vec![0xda, 0x00, 0x02, 0xff, 0xfe],             // str16 with invalid UTF-8
        nested.into_bytes(),
    ]
}

#[test]
fn unknown_keys_with_values_of_any_type_are_ignored() {
    let values = exotic_values();
    for m in samples() {
        let base = split_entries(&m.encode());
        // One unknown entry per exotic value, spread before "type", between
        // fields and at the end.
        let mut entries = Vec::new();
        let mut extra = values
            .iter()
            .enumerate()
            .map(|(i, v)| entry(&format!("unknown_{i}"), v));
        for e in &base {
            entries.extend(extra.by_ref().take(2));
            entries.push(e.clone());
        }
        entries.extend(extra);
        assert_eq!(Message::decode(&join_entries(&entries)), Ok(m.clone()));
    }
}

#[test]
fn fields_of_other_message_types_are_ignored() {
    let frame = ProxyNotif {
        req_id: "r".to_owned(),
    }
    .encode();
    let mut entries = split_entries(&frame);
    entries.push(entry("pull_id", &[0x07])); // wrong type, but not a ProxyNotif field
    entries.push(entry("keys", &[0xc0]));
    assert_eq!(
        ProxyNotif::decode(&join_entries(&entries)).map(|m| m.req_id),
        Ok("r".to_owned())
    );
}

#[test]
fn deeply_nested_unknown_value_does_not_overflow_the_stack() {
    let depth = 300_000;
    let mut value = vec![0x91; depth];
    value.push(0xc0);
    let mut entries = split_entries(&alloc_request().encode());
    entries.insert(1, entry("deep", &value));
    assert_eq!(
        AllocRequest::decode(&join_entries(&entries)),
        Ok(alloc_request())
    );
    // The same, but missing the innermost value: truncated, no panic.
    value.pop();
    entries.remove(1);
    entries.push(entry("deep", &value));
    let (e, text) = err_of(&join_entries(&entries));
    assert!(matches!(e, DecodeError::Truncated { .. }), "{e:?}");
    assert!(text.contains("AllocRequest.deep"), "{text}");
}

#[test]
fn missing_alloc_failed_defaults_to_false() {
    let resp = AscendAllocResponse {
        already_sent_indexes: vec![3],
        remote_indexes: vec![1, 2],
        remote_buffer_uuids: vec!["a".to_owned(), "b".to_owned()],
        alloc_failed: false,
    };
    let frame = without(&resp.encode(), "alloc_failed");
    assert_eq!(split_entries(&frame).len(), 4);
    assert_eq!(AscendAllocResponse::decode(&frame), Ok(resp));

    let ack = PullReadyDoneAck {
        already_sent_indexes: vec![],
        alloc_failed: true,
    };
    let frame = without(&ack.encode(), "alloc_failed");
    assert_eq!(
        PullReadyDoneAck::decode(&frame),
        Ok(PullReadyDoneAck {
            alloc_failed: false,
            ..ack
        })
    );
}

#[test]
fn non_minimal_integer_encodings_are_accepted() {
    let base = alloc_request().encode();
    // fmt = 1 as uint8, uint64, int8, int64
    for fmt in [
        vec![0xcc, 0x01],
        vec![0xcf, 0, 0, 0, 0, 0, 0, 0, 1],
        vec![0xd0, 0x01],
        vec![0xd3, 0, 0, 0, 0, 0, 0, 0, 1],
    ] {
        let frame = with_value(&base, "fmt", &fmt);
        assert_eq!(AllocRequest::decode(&frame), Ok(alloc_request()));
    }
    // shape [2, 36, 256, 1024] with every element in a wide form
    let shape = [
        vec![0x94, 0xd1, 0x00, 0x02],
        vec![0xce, 0, 0, 0, 36],
        vec![0xd2, 0, 0, 1, 0],
        vec![0xcf, 0, 0, 0, 0, 0, 0, 4, 0],
    ]
    .concat();
    let frame = with_value(&base, "shape", &shape);
    assert_eq!(AllocRequest::decode(&frame), Ok(alloc_request()));
    // last_chunk_toks = 77 as int16; re-encoding gives the minimal form back
    let frame = with_value(&base, "last_chunk_toks", &[0xd1, 0x00, 0x4d]);
    let m = Message::decode(&frame).expect("decodes");
    assert_eq!(m.encode(), base);
    // negative fmt is accepted (semantics are the caller's business)
    let frame = with_value(&base, "fmt", &[0xd0, 0x80]);
    assert_eq!(AllocRequest::decode(&frame).map(|m| m.fmt), Ok(-128));
    // u64::MAX index
    let ack = PullReadyDoneAck {
        already_sent_indexes: vec![u64::MAX, 0],
        alloc_failed: false,
    };
    assert_eq!(PullReadyDoneAck::decode(&ack.encode()), Ok(ack));
}

// ---------------------------------------------------------------- errors

#[test]
fn missing_required_field_is_named() {
    let frame = without(&alloc_request().encode(), "keys");
    let (e, text) = err_of(&frame);
    assert_eq!(
        e,
        DecodeError::MissingField {
            msg_type: MessageType::AllocRequest,
            field: "keys"
        }
    );
    assert!(
        text.contains("AllocRequest.keys") && text.contains("missing"),
        "{text}"
    );

    let frame = without(&pull_ready_notif().encode(), "sender_done_url");
    let (_, text) = err_of(&frame);
    assert!(text.contains("PullReadyNotif.sender_done_url"), "{text}");
}

#[test]
fn wrong_value_types_are_named() {
    let base = alloc_request().encode();
    let cases: Vec<(Vec<u8>, &str, &str, &str)> = vec![
        (
            with_value(&base, "fmt", &enc_str("1")),
            "AllocRequest.fmt",
            "int",
            "str",
        ),
        (
            with_value(&base, "fmt", &[0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0]),
            "AllocRequest.fmt",
            "int",
            "float",
        ),
        (
            with_value(&base, "keys", &enc_str("k")),
            "AllocRequest.keys",
            "array",
            "str",
        ),
        (
            with_value(&base, "keys", &[0x92, 0xa1, b'a', 0x05]),
            "AllocRequest.keys[1]",
            "str",
            "int",
        ),
        (
            with_value(&base, "keys", &[0x91, 0xc4, 0x01, b'a']),
            "AllocRequest.keys[0]",
            "str",
            "bin",
        ),
        (
            with_value(&base, "shape", &[0x92, 0x02, 0xc0]),
            "AllocRequest.shape[1]",
            "int",
            "nil",
        ),
        (
            with_value(&base, "dtype", &[0x90]),
            "AllocRequest.dtype",
            "str",
            "array",
        ),
        (
            with_value(&base, "last_chunk_toks", &[0xc3]),
            "AllocRequest.last_chunk_toks",
            "int",
            "bool",
        ),
    ];
    for (frame, at, expected, found) in cases {
        let (e, text) = err_of(&frame);
        assert!(matches!(e, DecodeError::WrongType { .. }), "{e:?}");
        assert!(text.contains(at), "{text} should name {at}");
        assert!(text.contains(&format!("expected {expected}")), "{text}");
        assert!(text.contains(&format!("found {found}")), "{text}");
    }

    let ack = PullReadyDoneAck::default().encode();
    let (e, text) = err_of(&with_value(&ack, "alloc_failed", &[0x01]));
    assert_eq!(
        e,
        DecodeError::WrongType {
            msg_type: MessageType::PullReadyDoneAck,
            field: "alloc_failed".to_owned(),
            expected: "bool",
            found: "int"
        }
    );
    assert!(text.contains("PullReadyDoneAck.alloc_failed"), "{text}");
}

#[test]
fn out_of_range_integers_are_named() {
    let resp = AscendAllocResponse {
        already_sent_indexes: vec![],
        remote_indexes: vec![1, 2],
        remote_buffer_uuids: vec!["a".to_owned(), "b".to_owned()],
        alloc_failed: false,
    }
    .encode();
    let (e, text) = err_of(&with_value(&resp, "remote_indexes", &[0x92, 0x01, 0xff]));
    assert_eq!(
        e,
        DecodeError::OutOfRange {
            msg_type: MessageType::AscendAllocResponse,
            field: "remote_indexes[1]".to_owned(),
            value: -1,
            expected: "a non-negative integer"
        }
    );
    assert!(
        text.contains("AscendAllocResponse.remote_indexes[1]") && text.contains("-1"),
        "{text}"
    );

    let base = alloc_request().encode();
    let (_, text) = err_of(&with_value(&base, "last_chunk_toks", &[0xd0, 0x80]));
    assert!(
        text.contains("AllocRequest.last_chunk_toks") && text.contains("-128"),
        "{text}"
    );
    let (_, text) = err_of(&with_value(
        &base,
        "shape",
        &[0x91, 0xd3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe],
    ));
    assert!(
        text.contains("AllocRequest.shape[0]") && text.contains("-2"),
        "{text}"
    );
    let (e, text) = err_of(&with_value(
        &base,
        "fmt",
        &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
    ));
    assert!(
        matches!(e, DecodeError::OutOfRange { value, .. } if value == i128::from(u64::MAX)),
        "{e:?}"
    );
    assert!(text.contains("AllocRequest.fmt"), "{text}");
}

#[test]
fn type_key_errors() {
    let frame = ProxyNotif {
        req_id: "r".to_owned(),
    }
    .encode();

    let (e, text) = err_of(&with_value(&frame, "type", &enc_str("ProxyNotification")));
    assert_eq!(
        e,
        DecodeError::UnknownType {
            name: "ProxyNotification".to_owned()
        }
    );
    assert!(
        text.contains("unknown") && text.contains("ProxyNotification"),
        "{text}"
    );

    let (e, text) = err_of(&without(&frame, "type"));
    assert_eq!(e, DecodeError::MissingType);
    assert!(text.contains("\"type\""), "{text}");

    let (e, text) = err_of(&with_value(&frame, "type", &[0x03]));
    assert_eq!(e, DecodeError::InvalidTypeTag { found: "int" });
    assert!(text.contains("type") && text.contains("int"), "{text}");

    let mut entries = split_entries(&frame);
    entries.push(entries[0].clone());
    let (e, text) = err_of(&join_entries(&entries));
    assert_eq!(
        e,
        DecodeError::DuplicateField {
            msg_type: MessageType::ProxyNotif,
            field: "type"
        }
    );
    assert!(text.contains("ProxyNotif.type"), "{text}");

    // A very long unknown type name is shortened in the error.
    let (e, _) = err_of(&with_value(&frame, "type", &enc_str(&"X".repeat(10_000))));
    assert!(
        matches!(e, DecodeError::UnknownType { ref name } if name.len() < 100),
        "{e:?}"
    );
}

#[test]
fn duplicate_field_is_rejected() {
    let frame = PullDoneSignal {
        pull_id: "a".to_owned(),
    }
    .encode();
    let mut entries = split_entries(&frame);
    entries.push(entry("pull_id", &enc_str("b")));
    let (e, text) = err_of(&join_entries(&entries));
    assert_eq!(
        e,
        DecodeError::DuplicateField {
            msg_type: MessageType::PullDoneSignal,
            field: "pull_id"
        }
    );
    assert!(text.contains("PullDoneSignal.pull_id"), "{text}");
}

#[test]
fn structural_errors() {
    let frame = ProxyNotif {
        req_id: "req-1".to_owned(),
    }
    .encode();

    // trailing bytes
    let (e, text) = err_of(&[frame.clone(), vec![0xc0, 0xc0]].concat());
    assert_eq!(
        e,
        DecodeError::TrailingBytes {
            msg_type: Some(MessageType::ProxyNotif),
            count: 2
        }
    );
    assert!(
        text.contains("ProxyNotif") && text.contains("trailing"),
        "{text}"
    );

    // truncated inside a field value: names type and field
    let (e, text) = err_of(&frame[..frame.len() - 1]);
    assert_eq!(
        e,
        DecodeError::Truncated {
            msg_type: Some(MessageType::ProxyNotif),
            field: Some("req_id".to_owned())
        }
    );
    assert!(
        text.contains("ProxyNotif.req_id") && text.contains("truncated"),
        "{text}"
    );

    // truncated before the type is known
    let (e, text) = err_of(&frame[..3]);
    assert!(
        matches!(e, DecodeError::Truncated { msg_type: None, .. }),
        "{e:?}"
    );
    assert!(text.contains("unknown type"), "{text}");

    // empty / non-map top level
    assert_eq!(Message::decode(&[]), Err(DecodeError::EmptyFrame));
    for (bytes, kind) in [
        (vec![0x92, 0x01, 0x02], "array"),
        (vec![0x05], "int"),
        (enc_str("AllocRequest"), "str"),
        (vec![0xc0], "nil"),
        (vec![0xc1], "reserved byte 0xc1"),
    ] {
        let (e, text) = err_of(&bytes);
        assert_eq!(e, DecodeError::NotAMap { found: kind });
        assert!(
            text.contains("not a msgpack map") && text.contains(kind),
            "{text}"
        );
    }

    // non-str key
    let mut entries = split_entries(&frame);
    entries.push((vec![0x01], vec![0x02]));
    let (e, text) = err_of(&join_entries(&entries));
    assert_eq!(
        e,
        DecodeError::NonStringKey {
            msg_type: Some(MessageType::ProxyNotif),
            found: "int"
        }
    );
    assert!(
        text.contains("ProxyNotif") && text.contains("key"),
        "{text}"
    );

    // invalid UTF-8 in a field value
    let (e, text) = err_of(&with_value(&frame, "req_id", &[0xa2, 0xc3, 0x28]));
    assert_eq!(
        e,
        DecodeError::InvalidUtf8 {
            msg_type: Some(MessageType::ProxyNotif),
            field: Some("req_id".to_owned())
        }
    );
    assert!(
        text.contains("ProxyNotif.req_id") && text.contains("UTF-8"),
        "{text}"
    );

    // reserved byte inside an unknown value
    let mut entries = split_entries(&frame);
    entries.push(entry("extra", &[0x92, 0x01, 0xc1]));
    let (e, text) = err_of(&join_entries(&entries));
    assert_eq!(
        e,
        DecodeError::ReservedByte {
            msg_type: Some(MessageType::ProxyNotif),
            field: Some("extra".to_owned())
        }
    );
    assert!(
        text.contains("ProxyNotif.extra") && text.contains("0xc1"),
        "{text}"
    );
}

#[test]
fn huge_claimed_lengths_fail_fast() {
    let base = alloc_request().encode();
    let four_g = [0xff, 0xff, 0xff, 0xff];
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "top-level map32",
            [vec![0xdf], four_g.to_vec(), base[1..].to_vec()].concat(),
        ),
        (
            "top-level map16",
            [vec![0xde, 0xff, 0xff], base[1..].to_vec()].concat(),
        ),
        (
            "keys array32",
            with_value(
                &base,
                "keys",
                &[vec![0xdd], four_g.to_vec(), vec![0xa1, b'k']].concat(),
            ),
        ),
        (
            "shape array16",
            with_value(&base, "shape", &[0xdc, 0xff, 0xff, 0x01]),
        ),
        (
            "dtype str32",
            with_value(
                &base,
                "dtype",
                &[vec![0xdb], four_g.to_vec(), b"bf16".to_vec()].concat(),
            ),
        ),
        (
            "unknown map32",
            with_extra(&base, &[vec![0xdf], four_g.to_vec()].concat()),
        ),
        (
            "unknown bin32",
            with_extra(&base, &[vec![0xc6], four_g.to_vec()].concat()),
        ),
        (
            "unknown ext32",
            with_extra(&base, &[vec![0xc9], four_g.to_vec(), vec![0x01]].concat()),
        ),
        (
            "unknown str32",
            with_extra(&base, &[vec![0xdb], four_g.to_vec(), vec![0x01]].concat()),
        ),
        (
            "nested array32s",
            with_extra(&base, &[vec![0xdd], four_g.to_vec()].concat().repeat(1000)),
        ),
    ];
    for (what, frame) in cases {
        let start = Instant::now();
        let r = Message::decode(&frame);
        let elapsed = start.elapsed();
        assert!(
            matches!(r, Err(DecodeError::Truncated { .. })),
            "{what}: expected Truncated, got {r:?}"
        );
        assert!(elapsed < Duration::from_secs(2), "{what}: took {elapsed:?}");
    }
}

// ---------------------------------------------------------------- robustness

const VECTORS: [&[u8]; 8] = [
    include_bytes!("../../tests/data/wire-vectors/alloc_request.msgpack"),
    include_bytes!("../../tests/data/wire-vectors/alloc_response_ok.msgpack"),
    include_bytes!("../../tests/data/wire-vectors/alloc_response_failed.msgpack"),
    include_bytes!("../../tests/data/wire-vectors/proxy_notif.msgpack"),
    include_bytes!("../../tests/data/wire-vectors/pull_ready_notif.msgpack"),
    include_bytes!("../../tests/data/wire-vectors/pull_ready_done_ack.msgpack"),
    include_bytes!("../../tests/data/wire-vectors/pull_ready_done_ack_failed.msgpack"),
    include_bytes!("../../tests/data/wire-vectors/pull_done_signal.msgpack"),
];

/// If a mutated frame decodes, the result must be self-consistent.
fn check_consistent(frame: &[u8]) {
    if let Ok(m) = Message::decode(frame) {
        assert_eq!(Message::decode(&m.encode()), Ok(m));
    }
}

#[test]
fn every_strict_prefix_of_every_vector_is_an_error() {
    for v in VECTORS {
        assert!(Message::decode(v).is_ok());
        for cut in 0..v.len() {
            assert!(
                Message::decode(&v[..cut]).is_err(),
                "prefix {cut} of {v:02x?}"
            );
        }
    }
}

#[test]
fn random_mutations_never_panic() {
    let mut rng = Rng(0x5eed);
    let mut decoded_ok = 0usize;
    for v in VECTORS {
        for _ in 0..3_000 {
            let mut f = v.to_vec();
            for _ in 0..1 + rng.below(4) {
                match rng.below(5) {
                    0 | 1 => {
                        let i = rng.below(f.len());
                        f[i] ^= 1 << rng.below(8);
                    }
                    2 => {
                        let i = rng.below(f.len());
                        f[i] = rng.next() as u8;
                    }
                    3 => {
                        let i = rng.below(f.len() + 1);
                        f.insert(i, rng.next() as u8);
                    }
                    _ => {
                        if f.len() > 1 {
                            let i = rng.below(f.len());
                            f.remove(i);
                        }
                    }
                }
            }
            let cut = if rng.below(4) == 0 {
                rng.below(f.len() + 1)
            } else {
                f.len()
            };
            if Message::decode(&f[..cut]).is_ok() {
                decoded_ok += 1;
            }
            check_consistent(&f[..cut]);
        }
    }
    // Some mutations (e.g. inside string payloads) stay valid; most do not.
    assert!(
        decoded_ok > 0 && decoded_ok < VECTORS.len() * 3_000,
        "{decoded_ok}"
    );
}

#[test]
fn random_garbage_never_panics() {
    let mut rng = Rng(42);
    for _ in 0..20_000 {
        let len = rng.below(64);
        let mut f: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        if !f.is_empty() && rng.below(2) == 0 {
            f[0] = 0x80 | (rng.next() as u8 & 0x0f); // start with a fixmap
        }
        check_consistent(&f);
    }
}

#[test]
fn a_pull_notification_announcing_its_request_round_trips_and_is_plain_without() {
    let m = PullReadyNotif {
        req_id: Some("r-1".into()),
        is_last_batch: Some(false),
        total_chunks: Some(6),
        ..pull_ready_notif()
    };
    let frame = m.encode();
    let keys: Vec<String> = split_entries(&frame)
        .iter()
        .map(|e| key_of(e).to_string())
        .collect();
    assert!(keys.ends_with(&[
        "req_id".into(),
        "is_last_batch".into(),
        "total_chunks".into()
    ]));
    assert_eq!(PullReadyNotif::decode(&frame), Ok(m));
    // Without them the frame is LMCache-Ascend's form, field for field.
    let plain = pull_ready_notif().encode();
    assert!(!split_entries(&plain)
        .iter()
        .any(|e| ["is_last_batch", "total_chunks"].contains(&key_of(e).as_str())));
}
