//! Fuzz target: weft_fuzz::share (see crates/weft-fuzz).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| weft_fuzz::share(data));
