//! Conformance with the reference encodings produced by msgspec (the
//! encoder LMCache-Ascend peers use), copied from `shared/wire-vectors/`
//! into `tests/data/wire-vectors/`.
//!
//! For every entry of `index.json`: the hand-written expected message must
//! encode to exactly the bytes of `NAME.msgpack`, and decoding the file must
//! give that message back. The expected values are additionally checked
//! against `index.json` itself (parsed by a tiny JSON reader below, to avoid
//! a dev-dependency), field names and order included.

use std::path::PathBuf;

use ascend_pd::protocol::{
    AllocRequest, AscendAllocResponse, CacheQueryRequest, CacheQueryResponse, CancelNotif,
    DecodeError, Message, ProxyNotif, PullDoneSignal, PullReadyDoneAck, PullReadyNotif,
};

fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/wire-vectors")
}

fn read(name: &str) -> Vec<u8> {
    let path = data_dir().join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| (*s).to_owned()).collect()
}

const KEY1: &str = "vllm@Qwen/Qwen3-8B@2@0@1a2b3c4d5e6f7081@bfloat16";
const KEY2: &str = "vllm@Qwen/Qwen3-8B@2@0@1a2b3c4d5e6f7082@bfloat16";
const KEY3: &str = "vllm@Qwen/Qwen3-8B@2@0@1a2b3c4d5e6f7083@bfloat16";
const PULL_ID: &str = "9d3c1b2a4e5f60718293a4b5c6d7e8f9";

/// The hand-written expected message of every vector.
fn expected() -> Vec<(&'static str, Message)> {
    let remote_uuid = "5f0c2a8e9b7d4c1e8a6f3b2d1c0e9f8a";
    let sender_uuid = "0b1c2d3e4f5061728394a5b6c7d8e9f0";
    vec![
        (
            "alloc_request",
            AllocRequest {
                keys: strings(&[KEY1, KEY2, KEY3]),
                fmt: 1,
                shape: vec![2, 36, 256, 1024],
                dtype: "bfloat16".to_owned(),
                last_chunk_toks: 77,
                ..Default::default()
            }
            .into(),
        ),
        (
            "alloc_response_ok",
            AscendAllocResponse {
                already_sent_indexes: vec![0],
                remote_indexes: vec![4, 5],
                remote_buffer_uuids: strings(&[remote_uuid, remote_uuid]),
                alloc_failed: false,
            }
            .into(),
        ),
        (
            "alloc_response_failed",
            AscendAllocResponse {
                already_sent_indexes: vec![0],
                remote_indexes: vec![],
                remote_buffer_uuids: vec![],
                alloc_failed: true,
            }
            .into(),
        ),
        (
            "proxy_notif",
            ProxyNotif {
                req_id: "cmpl-3f2a9c1d-0".to_owned(),
            }
            .into(),
        ),
        (
            "pull_ready_notif",
            PullReadyNotif {
                pull_id: PULL_ID.to_owned(),
                keys: strings(&[KEY1, KEY2]),
                sender_buffer_uuids: strings(&[sender_uuid, sender_uuid]),
                sender_mem_indexes: vec![12, 13],
                sender_id: "10.0.0.5:7600".to_owned(),
                sender_done_url: "10.0.0.5:7600".to_owned(),
                fmt: 1,
                shape: vec![2, 36, 256, 1024],
                dtype: "bfloat16".to_owned(),
                last_chunk_toks: 256,
                ..Default::default()
            }
            .into(),
        ),
        (
            "pull_ready_done_ack",
            PullReadyDoneAck {
                already_sent_indexes: vec![],
                alloc_failed: false,
            }
            .into(),
        ),
        (
            "pull_ready_done_ack_failed",
            PullReadyDoneAck {
                already_sent_indexes: vec![1],
                alloc_failed: true,
            }
            .into(),
        ),
        (
            "pull_done_signal",
            PullDoneSignal {
                pull_id: PULL_ID.to_owned(),
            }
            .into(),
        ),
    ]
}

/// Hex dump with the first differing offset, for readable failures.
fn diff(got: &[u8], want: &[u8]) -> String {
    let first = got
        .iter()
        .zip(want)
        .position(|(a, b)| a != b)
        .unwrap_or(got.len().min(want.len()));
    format!(
        "first difference at byte {first} (got {} bytes, want {})\n got: {:02x?}\nwant: {:02x?}",
        got.len(),
        want.len(),
        &got[first.saturating_sub(8)..got.len().min(first + 16)],
        &want[first.saturating_sub(8)..want.len().min(first + 16)],
    )
}

#[test]
fn every_vector_encodes_byte_for_byte() {
    for (name, msg) in expected() {
        let want = read(&format!("{name}.msgpack"));
        let got = msg.encode();
        assert!(got == want, "{name}: {}", diff(&got, &want));
    }
}

#[test]
fn every_vector_decodes_to_the_expected_message() {
    for (name, msg) in expected() {
        let bytes = read(&format!("{name}.msgpack"));
        assert_eq!(Message::decode(&bytes), Ok(msg), "{name}");
    }
}

#[test]
fn typed_decoders_accept_their_vectors_and_reject_others() {
    for (name, msg) in expected() {
        let bytes = read(&format!("{name}.msgpack"));
        let t = msg.message_type();
        let results = [
            (
                AllocRequest::TYPE,
                AllocRequest::decode(&bytes).map(Message::from),
            ),
            (
                AscendAllocResponse::TYPE,
                AscendAllocResponse::decode(&bytes).map(Message::from),
            ),
            (
                PullReadyNotif::TYPE,
                PullReadyNotif::decode(&bytes).map(Message::from),
            ),
            (
                PullReadyDoneAck::TYPE,
                PullReadyDoneAck::decode(&bytes).map(Message::from),
            ),
            (
                PullDoneSignal::TYPE,
                PullDoneSignal::decode(&bytes).map(Message::from),
            ),
            (
                ProxyNotif::TYPE,
                ProxyNotif::decode(&bytes).map(Message::from),
            ),
            (
                CancelNotif::TYPE,
                CancelNotif::decode(&bytes).map(Message::from),
            ),
            (
                CacheQueryRequest::TYPE,
                CacheQueryRequest::decode(&bytes).map(Message::from),
            ),
            (
                CacheQueryResponse::TYPE,
                CacheQueryResponse::decode(&bytes).map(Message::from),
            ),
        ];
        for (decoder, result) in results {
            if decoder == t {
                assert_eq!(result, Ok(msg.clone()), "{name}");
            } else {
                assert_eq!(
                    result,
                    Err(DecodeError::UnexpectedMessage {
                        expected: decoder,
                        found: t
                    }),
                    "{name} with the {decoder} decoder"
                );
            }
        }
    }
}

/// Upstream LMCache's newer messages (from `upstream/`): encoded byte for
/// byte, decoded back, and checked against `upstream/index.json`; every
/// entry of that index has a test.
fn upstream_expected() -> Vec<(&'static str, Message)> {
    vec![
        (
            "alloc_request_async",
            AllocRequest {
                keys: strings(&[KEY1, KEY2]),
                fmt: 1,
                shape: vec![2, 36, 256, 1024],
                dtype: "bfloat16".to_owned(),
                last_chunk_toks: 256,
                req_id: Some("cmpl-3f2a9c1d-0".to_owned()),
                is_last_batch: Some(true),
                total_chunks: Some(2),
            }
            .into(),
        ),
        (
            "cache_query_request",
            CacheQueryRequest {
                keys: strings(&[KEY1, KEY2, KEY3]),
            }
            .into(),
        ),
        (
            "cache_query_response",
            CacheQueryResponse {
                cached_keys: strings(&[KEY1, KEY3]),
                cached_indexes: vec![0, 2],
            }
            .into(),
        ),
        (
            "cancel_notif",
            CancelNotif {
                req_id: "cmpl-3f2a9c1d-0".to_owned(),
                keys: strings(&[KEY1, KEY2]),
            }
            .into(),
        ),
    ]
}

#[test]
fn upstream_messages_encode_and_decode_byte_for_byte() {
    let text = String::from_utf8(read("upstream/index.json")).expect("UTF-8");
    let Json::Obj(entries) = Json::parse(&text).expect("upstream/index.json parses") else {
        panic!("upstream/index.json: top level is not an object");
    };
    let mut listed: Vec<&str> = entries.iter().map(|(k, _)| k.as_str()).collect();
    let mut tested: Vec<&str> = upstream_expected().iter().map(|(n, _)| *n).collect();
    listed.sort_unstable();
    tested.sort_unstable();
    assert_eq!(listed, tested, "every upstream vector has a test");
    for (name, msg) in upstream_expected() {
        let want = read(&format!("upstream/{name}.msgpack"));
        let got = msg.encode();
        assert!(got == want, "{name}: {}", diff(&got, &want));
        assert_eq!(Message::decode(&want), Ok(msg.clone()), "{name}");
        let entry = &entries.iter().find(|(n, _)| n == name).expect("listed").1;
        assert_eq!(entry.get("fields"), Some(&to_json(&msg)), "{name}: fields");
        assert_eq!(
            entry.get("bytes"),
            Some(&Json::Int(want.len() as i64)),
            "{name}: byte count"
        );
    }
}

#[test]
fn index_json_entries_all_have_a_test_and_agree_with_it() {
    let text = String::from_utf8(read("index.json")).expect("index.json is UTF-8");
    let index = Json::parse(&text).expect("index.json parses");
    let Json::Obj(entries) = index else {
        panic!("index.json: top level is not an object");
    };
    let expected = expected();

    let index_names: Vec<&str> = entries.iter().map(|(k, _)| k.as_str()).collect();
    let mut tested: Vec<&str> = expected.iter().map(|(n, _)| *n).collect();
    let mut listed = index_names.clone();
    tested.sort_unstable();
    listed.sort_unstable();
    assert_eq!(
        tested, listed,
        "every index.json entry has exactly one test"
    );

    for (name, entry) in &entries {
        let msg = &expected
            .iter()
            .find(|(n, _)| n == name)
            .expect("checked above")
            .1;
        let bytes = read(&format!("{name}.msgpack"));
        assert_eq!(
            entry.get("type"),
            Some(&Json::Str(msg.message_type().name().to_owned())),
            "{name}: type"
        );
        assert_eq!(
            entry.get("bytes"),
            Some(&Json::Int(bytes.len() as i64)),
            "{name}: byte count"
        );
        assert_eq!(
            entry.get("fields"),
            Some(&to_json(msg)),
            "{name}: fields (values and order)"
        );
    }
}

// ------------------------------------------------- Message -> JSON view

fn strs(v: &[String]) -> Json {
    Json::Arr(v.iter().map(|s| Json::Str(s.clone())).collect())
}

fn ints(v: &[u64]) -> Json {
    Json::Arr(
        v.iter()
            .map(|&x| Json::Int(i64::try_from(x).expect("small test value")))
            .collect(),
    )
}

fn uint(x: u64) -> Json {
    Json::Int(i64::try_from(x).expect("small test value"))
}

/// The `fields` object index.json gives for a message, in wire order.
fn to_json(m: &Message) -> Json {
    let mut f: Vec<(&str, Json)> = vec![("type", Json::Str(m.message_type().name().to_owned()))];
    match m {
        Message::AllocRequest(m) => {
            f.push(("keys", strs(&m.keys)));
            f.push(("fmt", Json::Int(m.fmt)));
            f.push(("shape", ints(&m.shape)));
            f.push(("dtype", Json::Str(m.dtype.clone())));
            f.push(("last_chunk_toks", uint(m.last_chunk_toks)));
            if let Some(r) = &m.req_id {
                f.push(("req_id", Json::Str(r.clone())));
            }
            if let Some(b) = m.is_last_batch {
                f.push(("is_last_batch", Json::Bool(b)));
            }
            if let Some(n) = m.total_chunks {
                f.push(("total_chunks", uint(n)));
            }
        }
        Message::AscendAllocResponse(m) => {
            f.push(("already_sent_indexes", ints(&m.already_sent_indexes)));
            f.push(("remote_indexes", ints(&m.remote_indexes)));
            f.push(("remote_buffer_uuids", strs(&m.remote_buffer_uuids)));
            f.push(("alloc_failed", Json::Bool(m.alloc_failed)));
        }
        Message::PullReadyNotif(m) => {
            f.push(("pull_id", Json::Str(m.pull_id.clone())));
            f.push(("keys", strs(&m.keys)));
            f.push(("sender_buffer_uuids", strs(&m.sender_buffer_uuids)));
            f.push(("sender_mem_indexes", ints(&m.sender_mem_indexes)));
            f.push(("sender_id", Json::Str(m.sender_id.clone())));
            f.push(("sender_done_url", Json::Str(m.sender_done_url.clone())));
            f.push(("fmt", Json::Int(m.fmt)));
            f.push(("shape", ints(&m.shape)));
            f.push(("dtype", Json::Str(m.dtype.clone())));
            f.push(("last_chunk_toks", uint(m.last_chunk_toks)));
        }
        Message::PullReadyDoneAck(m) => {
            f.push(("already_sent_indexes", ints(&m.already_sent_indexes)));
            f.push(("alloc_failed", Json::Bool(m.alloc_failed)));
        }
        Message::PullDoneSignal(m) => f.push(("pull_id", Json::Str(m.pull_id.clone()))),
        Message::ProxyNotif(m) => f.push(("req_id", Json::Str(m.req_id.clone()))),
        Message::CancelNotif(m) => {
            f.push(("req_id", Json::Str(m.req_id.clone())));
            f.push(("keys", strs(&m.keys)));
        }
        Message::CacheQueryRequest(m) => f.push(("keys", strs(&m.keys))),
        Message::CacheQueryResponse(m) => {
            f.push(("cached_keys", strs(&m.cached_keys)));
            f.push(("cached_indexes", ints(&m.cached_indexes)));
        }
        Message::RegisterDecode(m) => {
            f.push(("transfer_id", Json::Str(m.transfer_id.clone())));
            f.push(("receiver_host", Json::Str(m.receiver_host.clone())));
            f.push(("receiver_init_port", ints(&m.receiver_init_port)));
            f.push(("receiver_alloc_port", ints(&m.receiver_alloc_port)));
            f.push(("held_tokens", uint(m.held_tokens)));
        }
        Message::RegisterDecodeAck(m) => {
            f.push(("accepted", Json::Bool(m.accepted)));
            f.push(("error", Json::Str(m.error.clone())));
        }
    }
    Json::Obj(f.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
}

// ------------------------------------------------- tiny JSON reader

/// The subset of JSON that index.json uses (no floats); objects keep their
/// key order.
#[derive(Debug, Clone, PartialEq)]
enum Json {
    Null,
    Bool(bool),
    Int(i64),
    Str(String),
    Arr(Vec<Json>),
    Obj(Vec<(String, Json)>),
}

impl Json {
    fn parse(text: &str) -> Result<Json, String> {
        let mut p = Parser {
            s: text.as_bytes(),
            i: 0,
        };
        let v = p.value()?;
        p.ws();
        if p.i != p.s.len() {
            return Err(format!("trailing data at {}", p.i));
        }
        Ok(v)
    }

    fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Obj(entries) => entries.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.s.get(self.i).copied()
    }

    fn expect(&mut self, c: u8) -> Result<(), String> {
        if self.peek() == Some(c) {
            self.i += 1;
            Ok(())
        } else {
            Err(format!("expected {:?} at {}", c as char, self.i))
        }
    }

    fn literal(&mut self, word: &str, v: Json) -> Result<Json, String> {
        if self.s[self.i..].starts_with(word.as_bytes()) {
            self.i += word.len();
            Ok(v)
        } else {
            Err(format!("bad literal at {}", self.i))
        }
    }

    fn value(&mut self) -> Result<Json, String> {
        match self.peek().ok_or("unexpected end")? {
            b'{' => {
                self.i += 1;
                let mut entries = Vec::new();
                if self.peek() == Some(b'}') {
                    self.i += 1;
                    return Ok(Json::Obj(entries));
                }
                loop {
                    let key = self.string()?;
                    self.expect(b':')?;
                    entries.push((key, self.value()?));
                    match self.peek() {
                        Some(b',') => self.i += 1,
                        Some(b'}') => {
                            self.i += 1;
                            return Ok(Json::Obj(entries));
                        }
                        _ => return Err(format!("bad object at {}", self.i)),
                    }
                }
            }
            b'[' => {
                self.i += 1;
                let mut items = Vec::new();
                if self.peek() == Some(b']') {
                    self.i += 1;
                    return Ok(Json::Arr(items));
                }
                loop {
                    items.push(self.value()?);
                    match self.peek() {
                        Some(b',') => self.i += 1,
                        Some(b']') => {
                            self.i += 1;
                            return Ok(Json::Arr(items));
                        }
                        _ => return Err(format!("bad array at {}", self.i)),
                    }
                }
            }
            b'"' => Ok(Json::Str(self.string()?)),
            b't' => self.literal("true", Json::Bool(true)),
            b'f' => self.literal("false", Json::Bool(false)),
            b'n' => self.literal("null", Json::Null),
            b'-' | b'0'..=b'9' => {
                let start = self.i;
                self.i += 1;
                while self.i < self.s.len() && self.s[self.i].is_ascii_digit() {
                    self.i += 1;
                }
                let digits =
                    std::str::from_utf8(&self.s[start..self.i]).map_err(|e| e.to_string())?;
                digits
                    .parse()
                    .map(Json::Int)
                    .map_err(|e| format!("number {digits:?}: {e}"))
            }
            c => Err(format!("unexpected {:?} at {}", c as char, self.i)),
        }
    }

    fn string(&mut self) -> Result<String, String> {
        self.expect(b'"')?;
        let mut out = Vec::new();
        loop {
            let c = *self.s.get(self.i).ok_or("unterminated string")?;
            self.i += 1;
            match c {
                b'"' => return String::from_utf8(out).map_err(|e| e.to_string()),
                b'\\' => {
                    let e = *self.s.get(self.i).ok_or("unterminated escape")?;
                    self.i += 1;
                    match e {
                        b'"' | b'\\' | b'/' => out.push(e),
                        b'n' => out.push(b'\n'),
                        b't' => out.push(b'\t'),
                        b'r' => out.push(b'\r'),
                        _ => return Err(format!("unsupported escape \\{}", e as char)),
                    }
                }
                _ => out.push(c),
            }
        }
    }
}

// ------------------------------------------------- robustness on the vectors

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

#[test]
fn truncations_and_bit_flips_of_every_vector_never_panic() {
    let mut rng = Rng(0xa5ce_d0d0);
    for (name, _) in expected() {
        let bytes = read(&format!("{name}.msgpack"));
        for cut in 0..bytes.len() {
            assert!(
                Message::decode(&bytes[..cut]).is_err(),
                "{name}: prefix of {cut} bytes decoded"
            );
        }
        for _ in 0..5_000 {
            let mut f = bytes.clone();
            for _ in 0..1 + rng.below(3) {
                let i = rng.below(f.len());
                f[i] ^= 1 << rng.below(8);
            }
            let cut = if rng.below(3) == 0 {
                rng.below(f.len() + 1)
            } else {
                f.len()
            };
            // Ok or Err are both fine; a decoded message must re-encode to
            // something that decodes to itself.
            if let Ok(m) = Message::decode(&f[..cut]) {
                assert_eq!(Message::decode(&m.encode()), Ok(m), "{name}");
            }
        }
    }
}
