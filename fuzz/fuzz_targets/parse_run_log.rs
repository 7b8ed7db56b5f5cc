//! Feeds arbitrary bytes through the run-log reader and its analysis: a log
//! torn by a crash, edited by hand or from another version must give an
//! error or a report, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(run) = oomkit_runlog::Run::parse(data) {
        let _ = oomkit_runlog::analyze(&run);
    }
});
