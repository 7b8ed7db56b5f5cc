//! The host's memory as a process sees it: the memory cgroup's limit, the
//! OOM kills the kernel recorded, and a process group's resident memory.
//!
//! In containers and on SLURM nodes a training process may use only what its
//! memory cgroup allows, and the kernel ends it with SIGKILL when it asks for
//! more: no Python exception, no message, exit code 137. The cgroup's own
//! counters (`memory.events` under cgroup v2, `memory.oom_control` under v1)
//! and the kernel's (`oom_kill` in `/proc/vmstat`) are what tell that death
//! from any other SIGKILL. Everything here reads `/proc` and `/sys`, never
//! writes, and answers `None` where the files are absent (not Linux, or no
//! memory controller).

use std::path::{Path, PathBuf};

/// A limit at or above this many bytes is no limit: cgroup v1 writes its
/// "unlimited" as the largest page-aligned signed 64-bit number (about 2^63).
const UNLIMITED_FROM: u64 = 1 << 60;

/// Which cgroup hierarchy holds the memory controller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CgroupVersion {
    /// The legacy per-controller hierarchy (`memory.limit_in_bytes`).
    V1,
    /// The unified hierarchy (`memory.max`).
    V2,
}

/// The memory cgroup of one process: its directory and the mount it sits under.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryCgroup {
    /// The cgroup's directory, e.g. `/sys/fs/cgroup/memory/slurm/uid_1000/job_42`.
    pub dir: PathBuf,
    /// The mount point of its hierarchy: the walk up to ancestors stops here.
    pub mount: PathBuf,
    /// Which hierarchy it is.
    pub version: CgroupVersion,
}

/// One line of `/proc/<pid>/mountinfo` that mounts a cgroup hierarchy.
struct CgroupMount {
    root: String,
    point: PathBuf,
    version: CgroupVersion,
}

/// The cgroup mounts in the text of `/proc/<pid>/mountinfo` that carry the memory controller.
fn memory_mounts(mountinfo: &str) -> Vec<CgroupMount> {
    mountinfo
        .lines()
        .filter_map(|line| {
            // "id parent maj:min root point options [optional...] - fstype source superoptions"
            let (left, right) = line.split_once(" - ")?;
            let mut l = left.split_whitespace();
            let root = unescape(l.nth(3)?);
            let point = PathBuf::from(unescape(l.next()?));
            let mut r = right.split_whitespace();
            let fstype = r.next()?;
            let superopts = r.nth(1).unwrap_or("");
            let version = match fstype {
                "cgroup2" => CgroupVersion::V2,
                "cgroup" if superopts.split(',').any(|o| o == "memory") => CgroupVersion::V1,
                _ => return None,
            };
            Some(CgroupMount {
                root,
                point,
                version,
            })
        })
        .collect()
}

/// mountinfo escapes space, tab, newline and backslash as a backslash and three octal digits.
fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let code = (b[i] == b'\\')
            .then(|| field.get(i + 1..i + 4))
            .flatten()
            .and_then(|d| u8::from_str_radix(d, 8).ok());
        match code {
            Some(v) => {
                out.push(v);
                i += 4;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The memory cgroup path of a process from the text of `/proc/<pid>/cgroup`:
/// the v1 memory controller's line where there is one, else the v2 line.
fn cgroup_paths(text: &str) -> (Option<String>, Option<String>) {
    let mut v1 = None;
    let mut v2 = None;
    for line in text.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        if id == "0" && controllers.is_empty() {
            v2 = Some(path.to_string());
        } else if controllers.split(',').any(|c| c == "memory") {
            v1 = Some(path.to_string());
        }
    }
    (v1, v2)
}

/// The directory of cgroup `path` under `mount`, whose root inside the hierarchy is `root`.
fn dir_under(mount: &CgroupMount, path: &str) -> PathBuf {
    // Inside a cgroup namespace the mount's root is the process's own cgroup
    // and /proc shows paths relative to it; outside one, the root is "/" or
    // a prefix of the path.
    let rel = if mount.root == "/" {
        path
    } else {
        path.strip_prefix(mount.root.as_str()).unwrap_or("")
    };
    let rel = rel.trim_start_matches('/');
    if rel.is_empty() {
        mount.point.clone()
    } else {
        mount.point.join(rel)
    }
}

/// Finds the memory cgroup from the texts of `/proc/<pid>/cgroup` and `/proc/<pid>/mountinfo`.
fn locate(cgroup: &str, mountinfo: &str) -> Option<MemoryCgroup> {
    let mounts = memory_mounts(mountinfo);
    let (v1, v2) = cgroup_paths(cgroup);
    let pick = |version: CgroupVersion, path: &Option<String>| {
        let path = path.as_deref()?;
        let mount = mounts.iter().find(|m| m.version == version)?;
        Some(MemoryCgroup {
            dir: dir_under(mount, path),
            mount: mount.point.clone(),
            version,
        })
    };
    // On hybrid systems v2 is mounted with no controllers: v1's memory wins.
    pick(CgroupVersion::V1, &v1).or_else(|| pick(CgroupVersion::V2, &v2))
}

/// The memory cgroup of `pid` (this process for `None`), where Linux shows one.
pub fn memory_cgroup(pid: Option<u32>) -> Option<MemoryCgroup> {
    let base = match pid {
        Some(p) => format!("/proc/{p}"),
        None => "/proc/self".to_string(),
    };
    let cgroup = std::fs::read_to_string(format!("{base}/cgroup")).ok()?;
    let mountinfo = std::fs::read_to_string(format!("{base}/mountinfo")).ok()?;
    locate(&cgroup, &mountinfo)
}

/// A limit from the text of `memory.max` or `memory.limit_in_bytes`; `None` for "max" or unlimited.
fn parse_limit(text: &str) -> Option<u64> {
    let v: u64 = text.trim().parse().ok()?;
    (v < UNLIMITED_FROM).then_some(v)
}

/// The `oom_kill` count in the text of `memory.events` or `memory.oom_control`.
fn parse_oom_kills(text: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut f = l.split_whitespace();
        (f.next()? == "oom_kill").then(|| f.next()?.parse().ok())?
    })
}

impl MemoryCgroup {
    /// This cgroup's directory and its ancestors' up to the hierarchy's mount, nearest first.
    fn chain(&self) -> impl Iterator<Item = &Path> {
        let mount = self.mount.clone();
        self.dir
            .ancestors()
            .take_while(move |d| d.starts_with(&mount))
    }

    fn file(&self, dir: &Path, v1: &str, v2: &str) -> Option<String> {
        let name = match self.version {
            CgroupVersion::V1 => v1,
            CgroupVersion::V2 => v2,
        };
        std::fs::read_to_string(dir.join(name)).ok()
    }

    /// The least memory limit on this cgroup and its ancestors, or `None` where none is set.
    pub fn limit_bytes(&self) -> Option<u64> {
        self.chain()
            .filter_map(|d| self.file(d, "memory.limit_in_bytes", "memory.max"))
            .filter_map(|t| parse_limit(&t))
            .min()
    }

    /// The OOM kills recorded on this cgroup and each ancestor, nearest first; a kill under any limit on the chain raises one of them.
    pub fn oom_kills(&self) -> Vec<u64> {
        self.chain()
            .map(|d| {
                self.file(d, "memory.oom_control", "memory.events")
                    .and_then(|t| parse_oom_kills(&t))
                    .unwrap_or(0)
            })
            .collect()
    }
}

/// The OOM kills the kernel made since boot, machine-wide (`/proc/vmstat`, Linux 4.13+).
pub fn kernel_oom_kills() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/vmstat").ok()?;
    parse_oom_kills(&text)
}

/// Physical memory of the machine.
pub fn physical_bytes() -> Option<u64> {
    // SAFETY: sysconf reads constants of the running system.
    let (pages, size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    (pages > 0 && size > 0).then(|| pages as u64 * size as u64)
}

/// Where a process's memory capacity comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CapacitySource {
    /// The machine's physical memory.
    Physical,
    /// A memory cgroup's limit, lower than the physical memory.
    Cgroup,
}

/// The memory a process may use: its cgroup's limit where one is set below the machine's memory, else the machine's.
pub fn host_capacity(pid: Option<u32>) -> Option<(u64, CapacitySource)> {
    let physical = physical_bytes();
    let limit = memory_cgroup(pid).and_then(|c| c.limit_bytes());
    match (physical, limit) {
        (Some(p), Some(l)) if l < p => Some((l, CapacitySource::Cgroup)),
        (None, Some(l)) => Some((l, CapacitySource::Cgroup)),
        (Some(p), _) => Some((p, CapacitySource::Physical)),
        (None, None) => None,
    }
}

/// The counters read before a command starts, to tell afterwards whether the kernel killed it for memory.
#[derive(Clone, Debug)]
pub struct OomKillWatch {
    cgroup: Option<MemoryCgroup>,
    cgroup_kills: Vec<u64>,
    kernel_kills: Option<u64>,
}

/// Evidence that the kernel's OOM killer ended a command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OomKill {
    /// The cgroup whose counter rose, where one did (else the kernel's counter rose).
    pub cgroup: Option<PathBuf>,
    /// The memory limit in force there, where one was set.
    pub limit_bytes: Option<u64>,
}

impl OomKillWatch {
    /// Reads the counters of this process's memory cgroup (which a child inherits) and the kernel's.
    pub fn start() -> OomKillWatch {
        let cgroup = memory_cgroup(None);
        let cgroup_kills = cgroup.as_ref().map(|c| c.oom_kills()).unwrap_or_default();
        OomKillWatch {
            cgroup,
            cgroup_kills,
            kernel_kills: kernel_oom_kills(),
        }
    }

    /// Whether an OOM kill was recorded since [`OomKillWatch::start`]: where, and under which limit.
    pub fn since(&self) -> Option<OomKill> {
        if let Some(c) = &self.cgroup {
            let now = c.oom_kills();
            let rose = c
                .chain()
                .zip(now.iter().zip(&self.cgroup_kills))
                .find(|(_, (n, b))| n > b)
                .map(|(d, _)| d.to_path_buf());
            if let Some(dir) = rose {
                return Some(OomKill {
                    cgroup: Some(dir),
                    limit_bytes: c.limit_bytes(),
                });
            }
        }
        match (self.kernel_kills, kernel_oom_kills()) {
            (Some(before), Some(now)) if now > before => Some(OomKill {
                cgroup: None,
                limit_bytes: self.cgroup.as_ref().and_then(|c| c.limit_bytes()),
            }),
            _ => None,
        }
    }
}

/// Resident memory of every process in process group `pgid`, summed; 0 where none is visible.
pub fn group_rss_bytes(pgid: u32) -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| crate::procinfo::process_group(*pid) == Some(u64::from(pgid)))
        .filter_map(process_rss_bytes)
        .sum()
}

/// Resident memory of `pid` from `/proc/<pid>/statm`.
pub fn process_rss_bytes(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    let pages: u64 = text.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf reads a constant of the running system.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * page.max(4096) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO_V1: &str = "\
25 30 0:22 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
31 25 0:27 / /sys/fs/cgroup/memory rw,relatime shared:12 - cgroup cgroup rw,memory
32 25 0:28 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct
40 25 0:35 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw";

    #[test]
    fn v1_memory_controller_wins_on_hybrid_systems() {
        let cg = "4:memory:/slurm/uid_1000/job_42\n2:cpu,cpuacct:/\n0::/user.slice\n";
        let c = locate(cg, MOUNTINFO_V1).expect("found");
        assert_eq!(c.version, CgroupVersion::V1);
        assert_eq!(
            c.dir,
            PathBuf::from("/sys/fs/cgroup/memory/slurm/uid_1000/job_42")
        );
        let chain: Vec<_> = c.chain().map(Path::to_path_buf).collect();
        assert_eq!(chain.len(), 4, "{chain:?}");
        assert_eq!(chain.last(), Some(&PathBuf::from("/sys/fs/cgroup/memory")));
    }

    #[test]
    fn v2_alone_and_a_namespaced_root() {
        let mi = "29 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate";
        let c = locate("0::/system.slice/train.service\n", mi).expect("found");
        assert_eq!(c.version, CgroupVersion::V2);
        assert_eq!(
            c.dir,
            PathBuf::from("/sys/fs/cgroup/system.slice/train.service")
        );
        // Inside a container's cgroup namespace the mount's root is the container's cgroup.
        let ns = "29 23 0:26 /kubepods/pod1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw";
        let c = locate("0::/kubepods/pod1\n", ns).expect("found");
        assert_eq!(c.dir, PathBuf::from("/sys/fs/cgroup"));
        let c = locate("0::/\n", ns).expect("found");
        assert_eq!(c.dir, PathBuf::from("/sys/fs/cgroup"));
    }

    #[test]
    fn no_memory_controller_is_none() {
        let mi = "32 25 0:28 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu";
        assert_eq!(locate("2:cpu:/\n", mi), None);
    }

    #[test]
    fn limits_and_counters() {
        assert_eq!(parse_limit("max\n"), None);
        assert_eq!(parse_limit("9223372036854771712\n"), None);
        assert_eq!(parse_limit("1288490188\n"), Some(1_288_490_188));
        let events = "low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\noom_group_kill 0\n";
        assert_eq!(parse_oom_kills(events), Some(1));
        let control = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n";
        assert_eq!(parse_oom_kills(control), Some(3));
        assert_eq!(parse_oom_kills("oom_kill_disable 0\n"), None);
    }

    #[test]
    fn escaped_mount_points() {
        assert_eq!(unescape(r"/mnt/with\040space"), "/mnt/with space");
        assert_eq!(unescape("/plain"), "/plain");
    }

    #[test]
    fn this_process_is_readable_where_linux_shows_it() {
        if std::fs::metadata("/proc/self/statm").is_err() {
            return;
        }
        assert!(process_rss_bytes(std::process::id()).unwrap_or(0) > 0);
        let (cap, _) = host_capacity(None).expect("physical memory");
        assert!(cap > 0);
    }
}
