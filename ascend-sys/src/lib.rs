//! Bindings to the CANN ACL runtime and HCCL, loaded at run time.
//!
//! Three layers, as in cudarc:
//! - [`sys`]: bindgen output (committed, C names), in dynamic-loading form:
//!   `sys::AclLib` and `sys::HcclLib` are tables of function pointers over a
//!   `libloading::Library`, so nothing links against CANN at build time.
//! - `result` (crate-private checks plus the public name tables in
//!   [`result`]): every status becomes a `Result` carrying the failing call
//!   and the library's own text (`aclGetRecentErrMsg`, `HcclGetErrorString`).
//! - safe wrappers: [`Acl`], [`Device`], [`DeviceBuffer`], [`HostBuffer`],
//!   [`Stream`], [`Event`], [`Completion`], [`Comm`], [`RegisteredMem`],
//!   [`RemoteMem`], and HIXL's client/server API ([`Hixl`],
//!   [`HixlServer`], [`HixlClient`]; `libcann_hixl.so`, optional, loaded
//!   on first use by [`Acl::hixl`]).
//!
//! The libraries are found by [`search_locations`] (first
//! `ASCEND_PD_CANN_LIB_DIR`) or given explicitly with
//! [`Acl::init_from_dir`]. A missing library or required symbol is an
//! error listing what was tried; a missing optional symbol (the HCCL
//! one-sided API on older CANN) is [`Error::Unsupported`].
//!
//! Nothing here has run on Ascend hardware; the test suite runs against the
//! CANN emulator in `ascend-sys/emu`. See ascend-sys/README.md.

#![warn(missing_docs)]

mod acl;
pub mod emulator;
mod error;
mod hccl;
mod hixl;
pub mod link;
mod loader;
mod memory;
pub mod result;
mod stream;

/// Generated bindings (see ascend-sys/gen); C names kept.
#[rustfmt::skip]
#[allow(
    warnings,
    clippy::all,
    clippy::pedantic,
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    missing_docs
)]
pub mod sys;

pub use acl::{Acl, Device};
pub use error::{Error, LoadAttempt, Result};
pub use hccl::{
    batch_op_limit_for_soc, Comm, MemDescriptor, MemKind, OneSidedOp, RegisteredMem, RemoteMem,
    RootInfo, BATCH_OP_LIMIT, BATCH_OP_LIMIT_ASCEND950, BATCH_OP_LIMIT_ENV, MEM_DESCRIPTOR_LEN,
    REGISTRATION_LIMIT, ROOT_INFO_LEN,
};
pub use hixl::{
    Hixl, HixlClient, HixlEndpoint, HixlMemId, HixlOp, HixlProtocol, HixlRemoteMem, HixlServer,
    HixlTransfer, HixlTransferState, EMU_SERVER_PORT_SYMBOL, HIXL_BUILTIN_TAG_PREFIX,
    HIXL_DEFAULT_SERVICE_LEVEL, HIXL_DEFAULT_TRAFFIC_CLASS, HIXL_LIBRARY, HIXL_OPS_IN_FLIGHT_LIMIT,
    HIXL_UNQUERIED_TRANSFER_LIMIT,
};
pub use loader::{
    available, search_locations, CannLibraries, SearchLocation, ACL_LIBRARY,
    DEFAULT_TOOLKIT_LIB_DIR, HCCL_LIBRARY, HCOMM_LIBRARY, LIB_DIR_ENV,
};
pub use memory::{DeviceBuffer, HostBuffer, MemcpyKind};
pub use stream::{Completion, Event, Stream};
