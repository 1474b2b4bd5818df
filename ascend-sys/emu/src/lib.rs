//! Emulator of the CANN ACL runtime and HCCL symbols.
