//! The backends over hccl and with NPU pools, against the CANN emulator
//! (nothing here has run on Ascend hardware): every mode over hccl (its
//! comm path) and hixl, and a
//! CPU-offloading sender whose chunks come from host memory while its
//! small NPU pool stays idle.

mod common;

use ascend_pd::backend::{PutOutcome, Receiver, Sender};
use ascend_pd::config::{BufferDevice, ChannelKind, PdConfig, TransferMode};
use ascend_pd::memory::npu::{read_page, AclRuntime};
use ascend_pd::memory::{pattern, DeviceKind, Page, SealedMemObj};
use common::*;
use std::time::Duration;

fn emulator() {
    let dir = ascend_emu::install_dir().expect("the emulator is built as a dev-dependency");
    AclRuntime::from_dir(&dir).expect("the emulator loads");
}

fn bytes_of(o: &Page) -> Vec<u8> {
    let mut v = vec![0u8; o.byte_len()];
    read_page(o, 0, &mut v).unwrap();
    v
}

fn verify(r: &Receiver, mode: TransferMode, ks: &[String]) {
    let got: Vec<(String, SealedMemObj)> = match mode {
        TransferMode::PullDelay => r.fetch(ks).unwrap(),
        _ => ks
            .iter()
            .map(|k| (k.clone(), r.get_wait(k, Duration::from_secs(10)).expect(k)))
            .collect(),
    };
    for (k, o) in &got {
        assert_eq!(
            pattern::first_mismatch(&bytes_of(o), seed_of(k)),
            None,
            "{mode:?} {k}"
        );
    }
    drop(got);
    for k in ks {
        r.remove(k);
    }
}

/// Puts five chunks (the last of 11 tokens) named `prefix`, checks every
/// byte at the receiver, and waits for the sender to drain.
fn put_and_verify(r: &Receiver, rc: &PdConfig, s: &Sender, mode: TransferMode, prefix: &str) {
    let ks = keys(prefix, 5);
    let c = chunks(s, &ks, 11);
    let out = s.put(&ks, &c, &spec_for(rc, "h", true)).unwrap();
    assert!(
        matches!(
            out,
            PutOutcome::Pushed { written: 5, .. } | PutOutcome::Announced { announced: 5, .. }
        ),
        "{mode:?}: {out:?}"
    );
    drop(c);
    verify(r, mode, &ks);
    assert!(s.drain(Duration::from_secs(10)), "{mode:?}");
}

#[test]
fn every_mode_over_hccl_and_hixl_moves_every_byte() {
    emulator();
    for ch in [ChannelKind::Hccl, ChannelKind::Hixl] {
        for mode in [
            TransferMode::Push,
            TransferMode::PullEager,
            TransferMode::PullDelay,
        ] {
            let (r, rc, s) = pair(ch, mode, 32);
            let what = format!("{}-{}", ch.name(), mode.name());
            put_and_verify(&r, &rc, &s, mode, &what);
            assert_no_pages(s.stats().pools.cpu.unwrap(), &what);
            assert_no_pages(r.stats().pools.cpu.unwrap(), &what);
        }
    }
}

#[test]
fn an_offloading_npu_sender_is_read_from_host_memory_into_npu_pages() {
    emulator();
    for ch in [ChannelKind::Tcp, ChannelKind::Hccl, ChannelKind::Hixl] {
        let mode = TransferMode::PullDelay;
        let mut rc = receiver_config(ch, mode, 16);
        rc.buffer_device = BufferDevice::Npu(Some(0));
        let r = Receiver::start(&rc, 0).unwrap();
        let mut sc = sender_config(ch, mode, 2);
        sc.buffer_device = BufferDevice::Npu(Some(0));
        sc.use_cpu_offload = true;
        sc.cpu_buffer_size = Some(16 * sc.page_bytes());
        let s = Sender::start(&sc, 0, Default::default()).unwrap();
        let ks = keys(&format!("offload-{}", ch.name()), 4);
        let c = chunks(&s, &ks, CHUNK);
        assert!(
            c.iter().all(|o| o.device() == DeviceKind::Cpu),
            "offload pages are host pages"
        );
        s.put(&ks, &c, &spec_for(&rc, "o", true)).unwrap();
        drop(c);
        let got = r.fetch(&ks).unwrap();
        for (k, o) in &got {
            assert_eq!(
                o.device(),
                DeviceKind::Npu(0),
                "{ch:?}: the receiver reads into NPU pages"
            );
            assert_eq!(
                pattern::first_mismatch(&bytes_of(o), seed_of(k)),
                None,
                "{ch:?} {k}"
            );
        }
        drop(got);
        assert!(s.drain(Duration::from_secs(10)), "{ch:?}");
        let st = s.stats().pools;
        assert_no_pages(st.cpu.unwrap(), &format!("{ch:?} sender host pool"));
        assert_eq!(
            st.cpu.unwrap().pinned_high_water,
            4,
            "{ch:?}: host pages were pinned"
        );
        assert_eq!(
            st.npu.unwrap().high_water,
            0,
            "{ch:?}: the NPU pool was never used"
        );
        assert_no_pages(r.stats().pools.npu.unwrap(), "receiver NPU pool");
    }
}

/// With a deployment secret the hccl (and hixl) liveness link's hello
/// carries a proof (issue 25): the genuine links of both sides are still
/// taken, so every mode moves every byte and no hello was refused.
#[test]
fn every_mode_over_hccl_with_a_secret_moves_every_byte() {
    emulator();
    let dir = std::env::temp_dir().join(format!("apd-npu-secret-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let secret = dir.join("secret");
    std::fs::write(&secret, "the hccl deployment's secret\n").unwrap();
    for (ch, mode) in [
        (ChannelKind::Hccl, TransferMode::Push),
        (ChannelKind::Hccl, TransferMode::PullDelay),
        (ChannelKind::Hixl, TransferMode::Push),
        (ChannelKind::Hixl, TransferMode::PullDelay),
    ] {
        let mut rc = receiver_config(ch, mode, 32);
        rc.auth_secret_file = Some(secret.clone());
        let r = Receiver::start(&rc, 0).unwrap();
        let mut sc = sender_config(ch, mode, 32);
        sc.auth_secret_file = Some(secret.clone());
        let s = Sender::start(&sc, 0, Default::default()).unwrap();
        let what = format!("{}-auth-{}", ch.name(), mode.name());
        put_and_verify(&r, &rc, &s, mode, &what);
        assert_eq!(r.stats().grants.unauthenticated, 0, "{what}");
        assert_eq!(s.stats().grants.unauthenticated, 0, "{what}");
        assert_no_pages(s.stats().pools.cpu.unwrap(), &what);
        assert_no_pages(r.stats().pools.cpu.unwrap(), &what);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
