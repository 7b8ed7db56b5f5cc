//! Who runs a process and with what command, read from /proc.

use std::collections::HashMap;

/// The owner's name and the command line of `pid`, where /proc shows them.
pub(crate) fn describe(pid: u32, users: &HashMap<u32, String>) -> (Option<String>, Option<String>) {
    let command = std::fs::read(format!("/proc/{pid}/cmdline"))
        .ok()
        .filter(|b| !b.is_empty())
        .map(|b| {
            let parts: Vec<String> = b
                .split(|c| *c == 0)
                .filter(|p| !p.is_empty())
                .map(|p| String::from_utf8_lossy(p).into_owned())
                .collect();
            parts.join(" ")
        });
    let user = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|uid| uid.parse::<u32>().ok())
        })
        .map(|uid| users.get(&uid).cloned().unwrap_or_else(|| uid.to_string()));
    (user, command)
}

/// User ids to names from /etc/passwd; empty where it cannot be read.
pub(crate) fn user_names() -> HashMap<u32, String> {
    std::fs::read_to_string("/etc/passwd")
        .map(|text| {
            text.lines()
                .filter_map(|l| {
                    let mut f = l.split(':');
                    let name = f.next()?;
                    let uid = f.nth(1)?.parse().ok()?;
                    Some((uid, name.to_string()))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Field `n` of /proc/`pid`/stat, counting from the state field (0) after the command name.
pub fn stat_field(pid: u32, n: usize) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses, so count fields after the last ')'.
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(n)?.parse().ok()
}

/// The start time of `pid` in clock ticks since boot, which tells a live process from a reused pid.
pub fn start_time(pid: u32) -> Option<u64> {
    stat_field(pid, 19)
}

/// The process group of `pid`.
pub fn process_group(pid: u32) -> Option<u64> {
    stat_field(pid, 2)
}
