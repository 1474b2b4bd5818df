//! Finding the emulator's shared library and presenting it under the names
//! the CANN loader looks for: the implementation is `ascend_sys::emulator`,
//! shared with `ASCEND_PD_CANN_LIB_DIR=emulator`.

pub use ascend_sys::emulator::{install_dir, library_path, LIBRARY_FILE};
