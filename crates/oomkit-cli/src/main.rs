//! The `oomkit` binary.

fn main() -> std::process::ExitCode {
    std::process::ExitCode::from(oomkit_cli::main(std::env::args_os()))
}
