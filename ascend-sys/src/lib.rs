//! Bindings to the CANN ACL runtime and HCCL, loaded at run time.
