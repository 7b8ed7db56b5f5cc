//! The terminal form of `oomkit gpus`.

use oomkit_gpu::Gpu;
use oomkit_units::human_bytes;
use std::fmt::Write;

/// The GPUs as a table for the terminal: one line per GPU, its processes indented below.
pub fn gpus(gpus: &[Gpu]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<4} {:<28} {:>10} {:>10} {:>10} {:>5}",
        "GPU", "name", "total", "used", "free", "util"
    );
    for g in gpus {
        let util = g
            .utilization_percent
            .map(|u| format!("{u}%"))
            .unwrap_or_else(|| "-".into());
        let name: String = g.name.chars().take(28).collect();
        let _ = writeln!(
            out,
            "{:<4} {:<28} {:>10} {:>10} {:>10} {:>5}",
            g.index,
            name,
            human_bytes(g.total_bytes),
            human_bytes(g.used_bytes),
            human_bytes(g.free_bytes),
            util
        );
        for p in &g.processes {
            let cmd: String = p
                .command
                .as_deref()
                .unwrap_or("(not visible from here)")
                .chars()
                .take(60)
                .collect();
            let _ = writeln!(
                out,
                "     pid {:<8} {:<10} {:>10}  {cmd}",
                p.pid,
                p.user.as_deref().unwrap_or("?"),
                p.used_bytes.map(human_bytes).unwrap_or_else(|| "?".into()),
            );
        }
    }
    out
}
