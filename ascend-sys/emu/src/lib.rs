//! A CANN emulator: a shared library exporting the ACL runtime and HCCL
//! symbols that ascend-pd uses, with CANN's C signatures, so the product
//! loads it through exactly the same loader as a real CANN install.
//!
//! It really moves bytes. Device and pinned host memory are memfd-backed
//! shared mappings owned by the emulator; copies are checked against the
//! known allocations and fail with the runtime's error codes on misuse;
//! streams run their work in order on a worker thread each; events give
//! real cross-stream ordering. HCCL's root info names a loopback socket for
//! a real two-process rendezvous; registered memory is mapped by the peer
//! and `HcclBatchPut` / `HcclBatchGet` copy into or out of that mapping in
//! stream order, rejecting anything outside the enabled regions. With
//! `ASCEND_PD_EMU_LINK` set, those batches are also accounted on a modeled
//! link ([`link`]), readable through the emulator-only C function
//! `ascend_emu_link_stats`. HIXL's client/server API (`HixlCS*`) is a real
//! TCP server and client that map each other's memory the same way; its
//! batches are accounted on the link's `hixl` path. Tests make copies
//! fail (refused when queued, or failing on their stream) with the
//! emulator-only C function `ascend_emu_inject_copy_fault`.
//!
//! This is an emulator. It has not been compared against Ascend hardware,
//! and passing tests against it says nothing about the real path.
//!
//! Use from tests: [`install_dir`] gives a directory in which
//! `libascendcl.so`, `libhccl.so` and `libcann_hixl.so` all point at this
//! library.

#![warn(missing_docs)]

mod fault;
mod ffi;
mod ffi_hixl;
mod hccl;
mod hixl;
mod install;
pub mod link;
mod memory;
mod runtime;
mod status;
mod stream;

pub use install::{install_dir, library_path, LIBRARY_FILE};
