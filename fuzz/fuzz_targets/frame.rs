#![no_main]
//! See `kvpool_fuzz::frame`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvpool_fuzz::frame(data));
