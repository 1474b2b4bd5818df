//! The ACL runtime path against the CANN emulator, through the real loader.

mod common;

use std::time::Duration;

use ascend_sys::{Acl, Error, MemcpyKind};
use common::{emulator, pattern};

const WAIT: Duration = Duration::from_secs(20);

fn acl_code(err: &Error) -> i32 {
    match err {
        Error::Acl { code, .. } => *code,
        other => panic!("expected an ACL error, got {other:?}"),
    }
}

#[test]
fn the_runtime_is_one_per_process_and_reports_where_it_came_from() {
    let acl = emulator();
    let again = Acl::init_from_dir(ascend_emu::install_dir().unwrap()).unwrap();
    assert_eq!(acl.library_path(), again.library_path());
    assert_eq!(acl.device_count().unwrap(), 8);
    assert!(acl.one_sided_supported());
    let err = Acl::init_from_dir(std::env::temp_dir()).unwrap_err();
    assert!(matches!(err, Error::AlreadyLoaded { .. }), "{err:?}");
}

#[test]
fn host_device_round_trips_keep_every_byte() {
    let dev = emulator().device(0).unwrap();
    let len = 3 * 1024 * 1024 + 17;
    let a = dev.alloc(len).unwrap();
    let b = dev.alloc(len).unwrap();
    let data = pattern(1, len);

    a.copy_from_host(0, &data).unwrap();
    let mut back = vec![0u8; len];
    a.copy_to_host(0, &mut back).unwrap();
    assert_eq!(back, data, "H2D then D2H");

    b.copy_from_device(0, &a, 0, len).unwrap();
    let mut back2 = vec![0u8; len];
    b.copy_to_host(0, &mut back2).unwrap();
    assert_eq!(back2, data, "D2D");

    // Offsets: move a middle slice to the front of b.
    b.copy_from_device(0, &a, 1000, 4096).unwrap();
    let mut head = vec![0u8; 4096];
    b.copy_to_host(0, &mut head).unwrap();
    assert_eq!(head, data[1000..5096]);

    b.fill(10, 20, 0xab).unwrap();
    let mut filled = vec![0u8; 40];
    b.copy_to_host(0, &mut filled).unwrap();
    assert_eq!(&filled[10..30], &[0xab; 20]);
    assert_eq!(&filled[30..40], &data[1030..1040]);
}

#[test]
fn async_copies_through_pinned_memory_complete_in_order() {
    let dev = emulator().device(0).unwrap();
    let len = 1 << 20;
    let stream = dev.create_stream().unwrap();
    let mut src = dev.alloc_host(len).unwrap();
    let dst = dev.alloc_host(len).unwrap();
    assert!(
        dst.as_slice().iter().all(|b| *b == 0),
        "pinned memory starts zeroed"
    );
    let data = pattern(2, len);
    src.as_mut_slice().copy_from_slice(&data);
    let buf = dev.alloc(len).unwrap();
    // SAFETY: all buffers outlive the completion we wait for below, and the
    // host buffers are not touched until then.
    let done = unsafe {
        stream.copy_host_to_device(&buf, 0, &src, 0, len).unwrap();
        stream.copy_device_to_host(&dst, 0, &buf, 0, len).unwrap();
        stream.completion().unwrap()
    };
    done.wait(WAIT).unwrap();
    assert!(done.is_complete().unwrap());
    assert_eq!(dst.as_slice(), &data[..]);
}

#[test]
fn an_event_orders_work_across_streams() {
    let dev = emulator().device(0).unwrap();
    let chunk = 1 << 20;
    let rounds = 24u8;
    let producer = dev.create_stream().unwrap();
    let consumer = dev.create_stream().unwrap();
    let target = dev.alloc(chunk).unwrap();
    let out = dev.alloc_host(chunk).unwrap();
    let sources: Vec<_> = (1..=rounds)
        .map(|r| {
            let mut h = dev.alloc_host(chunk).unwrap();
            h.as_mut_slice().fill(r);
            h
        })
        .collect();
    let ready = dev.create_event().unwrap();
    // SAFETY: every buffer lives until the final completion has been waited on.
    let done = unsafe {
        // The producer overwrites `target` round after round; only the last
        // value may be observed by the consumer, which waits on `ready`.
        for h in &sources {
            producer
                .copy_host_to_device(&target, 0, h, 0, chunk)
                .unwrap();
        }
        producer.record(&ready).unwrap();
        consumer.wait_event(&ready).unwrap();
        consumer
            .copy_device_to_host(&out, 0, &target, 0, chunk)
            .unwrap();
        consumer.completion().unwrap()
    };
    done.wait(WAIT).unwrap();
    assert!(ready.is_complete().unwrap());
    assert!(
        out.as_slice().iter().all(|b| *b == rounds),
        "consumer ran before the producer finished"
    );
    producer.synchronize().unwrap();
}

#[test]
fn devices_have_separate_memory() {
    let acl = emulator();
    let d0 = acl.device(0).unwrap();
    let d1 = acl.device(1).unwrap();
    let a = d0.alloc(4096).unwrap();
    let b = d1.alloc(4096).unwrap();
    a.copy_from_host(0, &[1u8; 4096]).unwrap();
    b.copy_from_host(0, &[2u8; 4096]).unwrap();
    let (mut ra, mut rb) = (vec![0u8; 4096], vec![0u8; 4096]);
    a.copy_to_host(0, &mut ra).unwrap();
    b.copy_to_host(0, &mut rb).unwrap();
    assert!(ra.iter().all(|x| *x == 1) && rb.iter().all(|x| *x == 2));

    // Device 1's memory used while device 0 is current is refused.
    d0.bind().unwrap();
    let mut host = [0u8; 16];
    // SAFETY: the call is refused before touching memory; the arguments are
    // otherwise valid (16 writable host bytes, a live device allocation).
    let err = unsafe {
        d0.memcpy(
            host.as_mut_ptr().cast(),
            16,
            b.as_ptr(),
            16,
            MemcpyKind::DeviceToHost,
        )
    }
    .unwrap_err();
    assert_eq!(acl_code(&err), 107_000);
    assert!(err.to_string().contains("memory of device 1"), "{err}");
}

#[test]
fn misuse_returns_the_runtime_error_codes_and_text() {
    let acl = emulator();
    let dev = acl.device(0).unwrap();
    let buf = dev.alloc(4096).unwrap();
    let mut host = vec![0u8; 8192];

    // Reading past the end of the allocation.
    // SAFETY: refused by the runtime before any byte moves.
    let err = unsafe {
        dev.memcpy(
            host.as_mut_ptr().cast(),
            host.len(),
            buf.as_ptr(),
            8192,
            MemcpyKind::DeviceToHost,
        )
    }
    .unwrap_err();
    assert_eq!(acl_code(&err), 107_000);
    let text = err.to_string();
    assert!(
        text.starts_with("aclrtMemcpy failed with ACL error 107000: ACL_ERROR_RT_PARAM_INVALID"),
        "{text}"
    );
    assert!(
        text.contains("runs past the end of device 0 memory"),
        "{text}"
    );
    assert!(
        text.contains("[ascend-emu]"),
        "the emulator's own text comes through: {text}"
    );

    // More bytes than the destination holds.
    // SAFETY: refused before any byte moves.
    let err = unsafe {
        dev.memcpy(
            buf.as_ptr(),
            16,
            host.as_ptr().cast(),
            32,
            MemcpyKind::HostToDevice,
        )
    }
    .unwrap_err();
    assert_eq!(acl_code(&err), 107_000);
    assert!(
        err.to_string().contains("count 32 exceeds destMax 16"),
        "{err}"
    );

    // A host pointer where the kind says device.
    // SAFETY: refused before any byte moves.
    let err = unsafe {
        dev.memcpy(
            host.as_mut_ptr().cast(),
            64,
            host.as_ptr().cast(),
            64,
            MemcpyKind::DeviceToDevice,
        )
    }
    .unwrap_err();
    assert_eq!(acl_code(&err), 107_000);
    assert!(
        err.to_string().contains("is not device memory of device 0"),
        "{err}"
    );

    // NULL is an invalid parameter at the ACL layer.
    // SAFETY: refused before any byte moves.
    let err = unsafe {
        dev.memcpy(
            std::ptr::null_mut(),
            64,
            host.as_ptr().cast(),
            64,
            MemcpyKind::HostToDevice,
        )
    }
    .unwrap_err();
    assert_eq!(acl_code(&err), 100_000);

    // A device that does not exist.
    let err = acl.device(99).unwrap_err();
    assert_eq!(acl_code(&err), 107_001);
    assert!(err.to_string().contains("aclrtSetDevice"), "{err}");

    // The safe layer refuses out-of-range spans itself.
    let err = buf.copy_from_host(4000, &[0u8; 200]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
}

#[test]
fn an_unrecorded_event_is_complete_and_waits_time_out_only_when_work_is_pending() {
    let dev = emulator().device(2).unwrap();
    let ev = dev.create_event().unwrap();
    assert!(ev.is_complete().unwrap());
    ev.wait_timeout(Duration::from_millis(10)).unwrap();
    let s = dev.create_stream().unwrap();
    s.record(&ev).unwrap();
    ev.wait_timeout(WAIT).unwrap();
    ev.synchronize().unwrap();
    assert!(ev.is_complete().unwrap());
}
