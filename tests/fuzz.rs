//! Property-based fuzzing of every decoder that reads bytes off the
//! network: the six side-channel messages and our push notices (the
//! request socket tries both on every frame), the channel handshake
//! (hellos, refusals, challenges, clock probes), the tcp transfer
//! server's connection hello and request headers.
//!
//! Inputs are valid frames built from arbitrary field values, then mutated
//! (bytes set, removed, inserted or duplicated, truncation, and huge
//! msgpack length markers spliced in), plus raw random bytes. Each decoder
//! must not panic, must not allocate in proportion to a length the input
//! claims (a counting allocator measures the peak of live bytes while it
//! runs), must refuse with a message, and whatever it accepts must be
//! stable (re-encoded, it decodes to the same value). A tcp request it
//! accepts must address bytes inside one page of a pool.
//!
//! CI runs proptest's default number of cases per property (256); a long
//! campaign: `PROPTEST_CASES=200000 cargo test --release --test fuzz`.

use ascend_pd::channel::handshake::{self, Hello, HANDSHAKE_VERSION};
use ascend_pd::channel::{tcp, BufferDesc, Endpoint};
use ascend_pd::config::{ChannelKind, Role, TransferMode};
use ascend_pd::memory::{BufferRef, DeviceKind};
use ascend_pd::protocol::notice::{decode_reply, encode_reply};
use ascend_pd::protocol::{
    AllocRequest, AscendAllocResponse, Message, ProxyNotif, PullDoneSignal, PullReadyDoneAck,
    PullReadyNotif, PushNotice, PushOutcome,
};
use proptest::collection::vec;
use proptest::prelude::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::Duration;
use uuid::Uuid;

// ------------------------------------------------------------ allocations

/// The system allocator, counting each thread's live bytes and their peak.
struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn note(delta: isize) {
    let _ = LIVE.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

// SAFETY: every call goes to `System` unchanged; the counting beside it
// touches only const-initialised thread-locals, which never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            note(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            note(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded; the caller got `ptr` from us with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        note(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded; the caller got `ptr` from us with `layout`.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            note(new_size as isize - layout.size() as isize);
        }
        p
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// Runs `f`, and the most bytes it had allocated at once on this thread.
fn peak_bytes<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let start = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(start));
    let r = f();
    let peak = PEAK.with(Cell::get);
    (r, (peak - start).max(0) as usize)
}

/// What decoding `n` input bytes may allocate at most: a small multiple of
/// the input (a decoded value is never much larger than its encoding),
/// plus a constant for error messages. A decoder that sized anything by a
/// claimed length would blow through it.
fn bound(n: usize) -> usize {
    64 * n + 64 * 1024
}

// -------------------------------------------------------------- mutations

/// One change to a valid frame.
#[derive(Clone, Debug)]
enum Mutation {
    Set(usize, u8),
    Truncate(usize),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
    Duplicate(usize, usize),
    /// A msgpack marker claiming 4 G elements or bytes (array32, map32,
    /// str32, bin32, ext32), written over the frame at a position.
    HugeLength(usize, u8),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), vec(any::<u8>(), 1..16)).prop_map(|(i, v)| Mutation::Insert(i, v)),
        (any::<usize>(), 1usize..16).prop_map(|(i, n)| Mutation::Remove(i, n)),
        (any::<usize>(), 1usize..64).prop_map(|(i, n)| Mutation::Duplicate(i, n)),
        (
            any::<usize>(),
            prop::sample::select(vec![0xdd_u8, 0xdf, 0xdb, 0xc6, 0xc9])
        )
            .prop_map(|(i, m)| Mutation::HugeLength(i, m)),
    ]
}

fn apply(frame: &mut Vec<u8>, m: &Mutation) {
    let at = |i: usize, len: usize| if len == 0 { 0 } else { i % len };
    match *m {
        Mutation::Set(i, b) => {
            if !frame.is_empty() {
                let i = at(i, frame.len());
                frame[i] = b;
            }
        }
        Mutation::Truncate(n) => frame.truncate(at(n, frame.len() + 1)),
        Mutation::Insert(i, ref v) => {
            let i = at(i, frame.len() + 1);
            frame.splice(i..i, v.iter().copied());
        }
        Mutation::Remove(i, n) => {
            let i = at(i, frame.len() + 1);
            let end = (i + n).min(frame.len());
            frame.drain(i..end);
        }
        Mutation::Duplicate(i, n) => {
            let i = at(i, frame.len() + 1);
            let end = (i + n).min(frame.len());
            let copy: Vec<u8> = frame[i..end].to_vec();
            frame.splice(end..end, copy);
        }
        Mutation::HugeLength(i, marker) => {
            let i = at(i, frame.len() + 1);
            let huge = [marker, 0xff, 0xff, 0xff, 0xf0];
            let end = (i + huge.len()).min(frame.len());
            frame.splice(i..end, huge);
        }
    }
}

fn mutated(mut frame: Vec<u8>, ms: &[Mutation]) -> Vec<u8> {
    for m in ms {
        apply(&mut frame, m);
    }
    frame
}

fn mutations() -> impl Strategy<Value = Vec<Mutation>> {
    vec(mutation(), 1..5)
}

// ----------------------------------------------------------------- values

fn text(max: usize) -> impl Strategy<Value = String> {
    vec(any::<char>(), 0..max).prop_map(|v| v.into_iter().collect())
}

fn texts(max: usize) -> impl Strategy<Value = Vec<String>> {
    vec(text(24), 0..max)
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        (
            texts(8),
            any::<i64>(),
            vec(any::<u64>(), 0..6),
            text(12),
            any::<u64>()
        )
            .prop_map(|(keys, fmt, shape, dtype, last_chunk_toks)| {
                Message::AllocRequest(AllocRequest {
                    keys,
                    fmt,
                    shape,
                    dtype,
                    last_chunk_toks,
                    ..Default::default()
                })
            }),
        (
            vec(any::<u64>(), 0..8),
            vec(any::<u64>(), 0..8),
            texts(8),
            any::<bool>()
        )
            .prop_map(|(a, r, u, f)| {
                Message::AscendAllocResponse(AscendAllocResponse {
                    already_sent_indexes: a,
                    remote_indexes: r,
                    remote_buffer_uuids: u,
                    alloc_failed: f,
                })
            }),
        (
            (text(40), texts(8), texts(8), vec(any::<u64>(), 0..8)),
            (text(30), text(30), any::<i64>(), vec(any::<u64>(), 0..6)),
            (text(12), any::<u64>()),
        )
            .prop_map(
                |((pull_id, keys, uuids, idx), (sid, url, fmt, shape), (dtype, last))| {
                    Message::PullReadyNotif(PullReadyNotif {
                        pull_id,
                        keys,
                        sender_buffer_uuids: uuids,
                        sender_mem_indexes: idx,
                        sender_id: sid,
                        sender_done_url: url,
                        fmt,
                        shape,
                        dtype,
                        last_chunk_toks: last,
                        ..Default::default()
                    })
                }
            ),
        (vec(any::<u64>(), 0..8), any::<bool>()).prop_map(|(a, f)| {
            Message::PullReadyDoneAck(PullReadyDoneAck {
                already_sent_indexes: a,
                alloc_failed: f,
            })
        }),
        text(40).prop_map(|pull_id| Message::PullDoneSignal(PullDoneSignal { pull_id })),
        text(40).prop_map(|req_id| Message::ProxyNotif(ProxyNotif { req_id })),
    ]
}

fn buffer_ref() -> impl Strategy<Value = BufferRef> {
    (any::<u128>(), any::<u32>()).prop_map(|(u, page)| BufferRef {
        uuid: Uuid::from_u128(u),
        page,
    })
}

fn push_notice() -> impl Strategy<Value = PushNotice> {
    (text(30), any::<bool>(), vec(buffer_ref(), 0..8)).prop_map(|(route, landed, refs)| {
        PushNotice {
            route,
            outcome: if landed {
                PushOutcome::Landed
            } else {
                PushOutcome::Aborted
            },
            refs,
        }
    })
}

fn device() -> impl Strategy<Value = DeviceKind> {
    prop_oneof![Just(DeviceKind::Cpu), (0u32..16).prop_map(DeviceKind::Npu)]
}

fn buffer_desc() -> impl Strategy<Value = BufferDesc> {
    (
        any::<u128>(),
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        device(),
    )
        .prop_map(|(u, base, len, page_size, device)| BufferDesc {
            uuid: Uuid::from_u128(u),
            base,
            len,
            page_size,
            device,
        })
}

fn endpoint() -> impl Strategy<Value = Endpoint> {
    prop_oneof![
        (any::<u32>(), vec(any::<i32>(), 0..4)).prop_map(|(pid, fds)| Endpoint::Shm { pid, fds }),
        text(30).prop_map(|addr| Endpoint::Tcp { addr }),
    ]
}

fn hello() -> impl Strategy<Value = Hello> {
    (
        (text(40), any::<bool>(), 0usize..3, 0usize..3),
        (
            0u64..1 << 40,
            vec(buffer_desc(), 0..4),
            endpoint(),
            any::<u64>(),
        ),
        (text(40), any::<bool>()),
    )
        .prop_map(
            |(
                (node, sender, mode, channel),
                (lease_ms, buffers, endpoint, clock_us),
                (model, named),
            )| Hello {
                version: HANDSHAKE_VERSION,
                node,
                role: if sender { Role::Sender } else { Role::Receiver },
                mode: [
                    TransferMode::Push,
                    TransferMode::PullEager,
                    TransferMode::PullDelay,
                ][mode],
                channel: [ChannelKind::Shm, ChannelKind::Tcp, ChannelKind::Hccl][channel],
                lease: Duration::from_millis(lease_ms),
                buffers,
                endpoint,
                clock_us,
                incarnation: clock_us.rotate_left(7),
                tp: None,
                lib: named.then(|| "0.1.0".to_string()),
                // An identity is never empty (a decoder refuses one).
                model: (named && !model.is_empty()).then_some(model),
            },
        )
}

// ------------------------------------------------------------- properties

/// What every decoder must do with any input: return within the
/// allocation bound, refusing with a message.
fn check_refusal(what: &str, e: &str) -> Result<(), TestCaseError> {
    prop_assert!(!e.trim().is_empty(), "{what}: a refusal without a message");
    Ok(())
}

/// The request socket's view of a frame: a push notice, or a message.
fn request_socket(frame: &[u8]) -> Result<(), TestCaseError> {
    let (notice, peak) = peak_bytes(|| PushNotice::decode(frame));
    prop_assert!(
        peak <= bound(frame.len()),
        "push notice decoder: {peak} bytes for {} of input",
        frame.len()
    );
    match notice {
        Some(Ok(n)) => prop_assert_eq!(PushNotice::decode(&n.encode()), Some(Ok(n))),
        Some(Err(e)) => check_refusal("push notice", &e)?,
        None => {
            let (msg, peak) = peak_bytes(|| Message::decode(frame));
            prop_assert!(
                peak <= bound(frame.len()),
                "message decoder: {peak} bytes for {} of input",
                frame.len()
            );
            match msg {
                Ok(m) => prop_assert_eq!(Message::decode(&m.encode()), Ok(m)),
                Err(e) => check_refusal("message", &e.to_string())?,
            }
        }
    }
    Ok(())
}

/// The handshake socket's view of a frame: every decoder it may apply.
fn handshake_socket(frame: &[u8]) -> Result<(), TestCaseError> {
    let (hello, peak) = peak_bytes(|| Hello::decode(frame));
    prop_assert!(
        peak <= bound(frame.len()),
        "hello decoder: {peak} bytes for {} of input",
        frame.len()
    );
    match hello {
        Ok((h, error)) => {
            let again = Hello::decode(&h.encode(error.as_deref())).map_err(|e| e.to_string());
            prop_assert_eq!(again, Ok((h, error)));
        }
        Err(e) => check_refusal("hello", &e.to_string())?,
    }
    let (_, peak) = peak_bytes(|| {
        (
            handshake::refusal_reason(frame),
            handshake::fuzzing::decode_challenge_answer(frame),
            handshake::fuzzing::single_value(frame, "auth_challenge"),
            handshake::fuzzing::is_clock_probe(frame),
            handshake::fuzzing::decode_clock_answer(frame),
        )
    });
    prop_assert!(peak <= bound(frame.len()));
    Ok(())
}

/// The tcp server's view of a connection's first bytes.
fn tcp_hello(bytes: &[u8]) -> Result<Option<String>, TestCaseError> {
    let (r, peak) = peak_bytes(|| tcp::fuzzing::read(bytes));
    prop_assert!(peak <= bound(bytes.len()), "tcp hello: {peak} bytes");
    match r {
        Ok(node) => Ok(Some(node)),
        Err(e) => {
            check_refusal("tcp hello", &e)?;
            Ok(None)
        }
    }
}

/// Pools of a tcp server: (uuid, pages, page size).
fn pools() -> Vec<(Uuid, usize, usize)> {
    vec![
        (Uuid::from_u128(1), 8, 4096),
        (Uuid::from_u128(2), 3, 1 << 20),
    ]
}

/// A tcp request the server accepts touches one page of one pool.
fn tcp_request(header: &[u8]) -> Result<(), TestCaseError> {
    let pools = pools();
    match tcp::fuzzing::check(header, &pools) {
        Ok((at, len)) => {
            let fits = pools.iter().any(|&(_, pages, page_size)| {
                let page = at / page_size;
                page < pages && at % page_size + len <= page_size
            });
            prop_assert!(fits, "accepted {len} bytes at {at}: outside every page");
        }
        Err(e) => check_refusal("tcp request", &e)?,
    }
    Ok(())
}

proptest! {
    #[test]
    fn side_channel_messages_round_trip(m in message()) {
        prop_assert_eq!(Message::decode(&m.encode()), Ok(m));
    }

    #[test]
    fn mutated_side_channel_messages_are_refused_by_name_or_decode_stably(
        m in message(),
        ms in mutations(),
    ) {
        request_socket(&mutated(m.encode(), &ms))?;
    }

    #[test]
    fn push_notices_round_trip_and_mutated_ones_never_panic(
        n in push_notice(),
        ms in mutations(),
        reply in prop::option::of(text(60)),
    ) {
        prop_assert_eq!(PushNotice::decode(&n.encode()), Some(Ok(n.clone())));
        request_socket(&mutated(n.encode(), &ms))?;
        let result = reply.clone().map_or(Ok(()), Err);
        prop_assert_eq!(decode_reply(&encode_reply(&result)), Ok(result.clone()));
        let bytes = mutated(encode_reply(&result), &ms);
        let (r, peak) = peak_bytes(|| decode_reply(&bytes));
        prop_assert!(peak <= bound(bytes.len()));
        if let Err(e) = r {
            check_refusal("push notice reply", &e)?;
        }
    }

    #[test]
    fn random_bytes_on_every_socket_never_panic(bytes in vec(any::<u8>(), 0..512)) {
        request_socket(&bytes)?;
        handshake_socket(&bytes)?;
        tcp_hello(&bytes)?;
        tcp_request(&bytes)?;
    }

    #[test]
    fn hellos_round_trip_and_mutated_ones_are_refused_by_name(
        h in hello(),
        error in prop::option::of(text(40)),
        ms in mutations(),
    ) {
        let frame = h.encode(error.as_deref());
        let decoded = Hello::decode(&frame).map_err(|e| e.to_string());
        prop_assert_eq!(decoded, Ok((h, error)));
        handshake_socket(&mutated(frame, &ms))?;
    }

    #[test]
    fn handshake_challenges_and_clock_answers_decode_only_when_whole(
        nonce in any::<[u8; 16]>(),
        proof in any::<[u8; 32]>(),
        ms in mutations(),
    ) {
        let answer = handshake::fuzzing::challenge_answer(&nonce, &proof);
        prop_assert_eq!(handshake::fuzzing::decode_challenge_answer(&answer), Some((nonce, proof)));
        handshake_socket(&mutated(answer, &ms))?;
        let challenge = handshake::fuzzing::single("auth_challenge", "00ff");
        prop_assert_eq!(handshake::fuzzing::single_value(&challenge, "auth_challenge"), Some("00ff"));
        handshake_socket(&mutated(challenge, &ms))?;
    }

    #[test]
    fn tcp_connection_hellos_decode_or_are_refused_by_name(
        node in text(64),
        nonce in any::<[u8; 16]>(),
        ms in mutations(),
    ) {
        let hello = tcp::fuzzing::hello(&node, nonce);
        let whole = tcp_hello(&hello)?;
        if !node.is_empty() {
            prop_assert_eq!(whole, Some(node));
        }
        tcp_hello(&mutated(hello, &ms))?;
    }

    #[test]
    fn tcp_requests_the_server_accepts_stay_inside_one_page(
        pool in 0usize..2,
        write in any::<bool>(),
        page in 0u32..10,
        offset in 0u32..(1 << 21),
        len in 0u64..(1 << 21),
        tag in prop::option::of(any::<u64>()),
        ms in mutations(),
    ) {
        let uuid = pools()[pool].0;
        let header = tcp::fuzzing::request(write, BufferRef { uuid, page }, offset, len, tag);
        prop_assert_eq!(header.len(), tcp::fuzzing::REQUEST_LEN);
        tcp_request(&header)?;
        tcp_request(&mutated(header, &ms))?;
    }
}

/// The harness itself: a decoder that sized a buffer by a claimed length
/// is caught by the bound.
#[test]
fn the_allocation_bound_catches_a_decoder_that_trusts_a_claimed_length() {
    let frame = [0xc6, 0x00, 0x10, 0x00, 0x00];
    let trusting = |f: &[u8]| {
        let claimed = u32::from_be_bytes([f[1], f[2], f[3], f[4]]) as usize;
        Vec::<u8>::with_capacity(claimed).capacity()
    };
    let (cap, peak) = peak_bytes(|| trusting(&frame));
    assert_eq!(cap, 1 << 20);
    assert!(peak > bound(frame.len()), "{peak}");
}

/// The frames the issue names, by hand: each claims far more than it
/// holds, and none may make its decoder allocate what it claims.
#[test]
fn frames_claiming_huge_lengths_are_refused_without_allocating_them() {
    let claims: [&[u8]; 6] = [
        // {"type": "AllocRequest", "keys": [<4 G strings>]}
        b"\x82\xa4type\xacAllocRequest\xa4keys\xdd\xff\xff\xff\xff",
        // a 4 GB type name
        b"\x81\xa4type\xdb\xff\xff\xff\xff",
        // a map of 4 G entries
        b"\xdf\xff\xff\xff\xff",
        // {"push_notice": ..., "refs": [<4 G refs>]}
        b"\x82\xabpush_notice\xa6landed\xa4refs\xdd\xff\xff\xff\xff",
        // a hello whose buffers claim 4 G entries
        b"\x81\xa7buffers\xdd\xff\xff\xff\xff",
        // a bin32 of 4 GB
        b"\xc6\xff\xff\xff\xff",
    ];
    for frame in claims {
        let (r, peak) = peak_bytes(|| {
            (
                Message::decode(frame).is_err(),
                PushNotice::decode(frame).is_none_or(|r| r.is_err()),
                Hello::decode(frame).is_err(),
            )
        });
        assert_eq!(r, (true, true, true), "{frame:?}");
        assert!(peak <= bound(frame.len()), "{frame:?}: {peak} bytes");
    }
    // A tcp hello claiming a node id longer than any is refused before it
    // is read.
    let mut hello = b"APDH".to_vec();
    hello.extend_from_slice(&u16::MAX.to_le_bytes());
    let (r, peak) = peak_bytes(|| tcp::fuzzing::read(&hello));
    assert!(r.unwrap_err().contains("node id of 65535 bytes"));
    assert!(peak <= bound(hello.len()));
}
