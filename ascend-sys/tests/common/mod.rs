//! Shared test setup: the CANN emulator, loaded through the real loader.

use ascend_sys::Acl;

/// The process-wide runtime, loaded from the emulator's install directory.
pub fn emulator() -> Acl {
    let dir = ascend_emu::install_dir().expect("emulator library is built as a dev-dependency");
    Acl::init_from_dir(&dir).expect("emulator loads through the CANN loader")
}

/// Deterministic bytes for (seed, position).
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| {
            let x =
                (i ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)).wrapping_mul(0x2545_f491_4f6c_dd1d);
            (x >> 56) as u8
        })
        .collect()
}
