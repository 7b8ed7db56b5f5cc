//! One module per command: its flags (`Args`) and its body (`run`), which
//! turns the flags into the library's options, calls it and prints.

pub(crate) mod analyze;
pub(crate) mod demo;
pub(crate) mod diff;
pub(crate) mod estimate;
pub(crate) mod explain;
pub(crate) mod export;
pub(crate) mod find_batch;
pub(crate) mod gpus;
pub(crate) mod preflight;
pub(crate) mod report;
pub(crate) mod run;
pub(crate) mod whatif;
