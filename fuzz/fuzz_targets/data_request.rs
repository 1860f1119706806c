#![no_main]
//! See `kvpool_fuzz::data_request`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvpool_fuzz::data_request(data));
