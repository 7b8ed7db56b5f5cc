//! `oomkit gpus`, `run` and `find-batch` against the fake GPU backend, with
//! small shell scripts standing in for training commands.

mod common;
use common::{demo_file, python_script};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const GIB: u64 = 1 << 30;

/// A fresh directory for one test, with its own claims and fake GPUs.
struct Sandbox {
    dir: PathBuf,
}

impl Sandbox {
    fn new(name: &str) -> Sandbox {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("supervise-{name}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Sandbox { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Writes the fake GPU list: (total GiB, free GiB) per GPU.
    fn gpus(&self, gpus: &[(u64, u64)]) {
        let list: Vec<Value> = gpus
            .iter()
            .enumerate()
            .map(|(i, (total, free))| {
                json!({
                    "index": i, "name": "Fake H100", "uuid": format!("GPU-fake-{i}"),
                    "total_bytes": total * GIB, "free_bytes": free * GIB,
                    "used_bytes": (total - free) * GIB, "utilization_percent": 0,
                    "processes": []
                })
            })
            .collect();
        // Written whole and renamed, so a waiting oomkit never reads half a file.
        let tmp = self.path("gpus.json.tmp");
        std::fs::write(&tmp, serde_json::to_vec(&list).unwrap()).unwrap();
        std::fs::rename(&tmp, self.path("gpus.json")).unwrap();
    }

    fn script(&self, name: &str, body: &str) -> PathBuf {
        let p = self.path(name);
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_oomkit"));
        c.args(args)
            .env("OOMKIT_FAKE_GPUS", self.path("gpus.json"))
            .env("OOMKIT_CLAIMS_DIR", self.path("claims"))
            .env("OOMKIT_CACHE_DIR", self.path("cache"))
            .env("NO_COLOR", "1")
            .current_dir(&self.dir);
        c
    }

    fn run(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("run oomkit")
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Prints OOM the way PyTorch does when the micro-batch ($1) is above $LIMIT.
const OOM_ABOVE_LIMIT: &str = r#"echo "micro=$1 accum=$2 env=$OOMKIT_MICRO_BATCH/$OOMKIT_GRAD_ACCUM attempt=$OOMKIT_ATTEMPT gpus=$CUDA_VISIBLE_DEVICES order=$CUDA_DEVICE_ORDER" >> log.txt
if [ "$1" -gt "$LIMIT" ]; then
  echo "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.12 GiB is free. Including non-PyTorch memory, this process has 78.02 GiB memory in use. Of the allocated memory 75.12 GiB is allocated by PyTorch, and 200.00 MiB is reserved by PyTorch but unallocated." >&2
  exit 1
fi
echo trained"#;

#[test]
fn gpus_lists_the_fake_backend() {
    let s = Sandbox::new("gpus");
    s.gpus(&[(80, 10), (80, 80)]);
    let out = s.run(&["gpus", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let list = v.as_array().unwrap();
    assert_eq!(list.len(), 2);
    for field in [
        "index",
        "name",
        "total_bytes",
        "free_bytes",
        "used_bytes",
        "processes",
    ] {
        assert!(list[0].get(field).is_some(), "missing {field}");
    }
    assert_eq!(list[1]["free_bytes"], 80 * GIB);
    let table = text(&s.run(&["gpus"]).stdout);
    assert!(
        table.contains("Fake H100") && table.contains("10.0 GiB"),
        "{table}"
    );
}

#[test]
fn gpus_without_any_gpu_is_one_line_and_exit_3() {
    let s = Sandbox::new("nogpu");
    s.gpus(&[]);
    let out = s.run(&["gpus"]);
    assert_eq!(out.status.code(), Some(3));
    let err = text(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("no GPU"), "{err}");
}

#[test]
fn a_broken_fake_file_is_named() {
    let s = Sandbox::new("badfake");
    std::fs::write(s.path("gpus.json"), "{not json").unwrap();
    let out = s.run(&["gpus"]);
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(
        err.contains("gpus.json") && err.contains("OOMKIT_FAKE_GPUS"),
        "{err}"
    );
}

#[test]
fn run_retries_with_the_same_effective_batch() {
    let s = Sandbox::new("retry");
    s.gpus(&[(80, 20), (80, 70)]);
    let train = s.script("train.sh", OOM_ABOVE_LIMIT);
    let out = s
        .command(&[
            "run",
            "--batch-size",
            "32",
            "--effective-batch",
            "128",
            "--summary-json",
            "summary.json",
            "--",
            train.to_str().unwrap(),
            "{batch_size}",
            "{grad_accum}",
        ])
        .env("LIMIT", "8")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let log = std::fs::read_to_string(s.path("log.txt")).unwrap();
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(
        lines,
        [
            "micro=32 accum=4 env=32/4 attempt=1 gpus=1 order=PCI_BUS_ID",
            "micro=16 accum=8 env=16/8 attempt=2 gpus=1 order=PCI_BUS_ID",
            "micro=8 accum=16 env=8/16 attempt=3 gpus=1 order=PCI_BUS_ID",
        ]
    );
    let summary: Value =
        serde_json::from_slice(&std::fs::read(s.path("summary.json")).unwrap()).unwrap();
    let attempts = summary["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 3);
    for (a, (b, acc, oom)) in attempts
        .iter()
        .zip([(32, 4, true), (16, 8, true), (8, 16, false)])
    {
        assert_eq!(a["batch_size"], b);
        assert_eq!(a["grad_accum"], acc);
        assert_eq!(a["oom"], oom);
        assert_eq!(a["gpus"], json!([1]));
        assert_eq!(a["exit_code"], if oom { 1 } else { 0 });
    }
    assert_eq!(summary["outcome"], "succeeded");
    // The summary file is never overwritten.
    let again = s.run(&["run", "--summary-json", "summary.json", "--", "true"]);
    assert_eq!(again.status.code(), Some(125));
    assert!(text(&again.stderr).contains("already exists"));
}

#[test]
fn run_stops_at_the_floor_and_passes_the_exit_code() {
    let s = Sandbox::new("floor");
    s.gpus(&[(80, 80)]);
    let train = s.script("train.sh", OOM_ABOVE_LIMIT);
    let out = s
        .command(&[
            "run",
            "--batch-size",
            "8",
            "--min-batch-size",
            "4",
            "--json",
            "--",
            train.to_str().unwrap(),
            "{batch_size}",
            "1",
        ])
        .env("LIMIT", "2")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stdout = text(&out.stdout);
    let json_start = stdout.find('{').unwrap();
    let summary: Value = serde_json::from_str(&stdout[json_start..]).unwrap();
    assert_eq!(summary["outcome"], "oom");
    assert_eq!(summary["attempts"].as_array().unwrap().len(), 2);
    assert!(text(&out.stderr).contains("the smallest allowed"));
}

#[test]
fn run_falls_back_to_the_cpu_when_asked() {
    let s = Sandbox::new("cpu");
    s.gpus(&[(80, 80)]);
    let train = s.script(
        "train.sh",
        r#"echo "device=$OOMKIT_DEVICE gpus=[$CUDA_VISIBLE_DEVICES]" >> log.txt
[ "$OOMKIT_DEVICE" = cpu ] && exit 0
echo "RuntimeError: CUDA error: out of memory" >&2; exit 1"#,
    );
    let out = s.run(&[
        "run",
        "--batch-size",
        "2",
        "--cpu-fallback",
        "--",
        train.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let log = std::fs::read_to_string(s.path("log.txt")).unwrap();
    assert_eq!(log.lines().last(), Some("device=cpu gpus=[]"));
    assert_eq!(log.lines().count(), 3);
}

#[test]
fn run_asks_for_framework_callbacks_unless_told_not_to() {
    let s = Sandbox::new("autocallback");
    s.gpus(&[(80, 80)]);
    let show = ["sh", "-c", "echo auto=[${OOMKIT_AUTO_CALLBACK-unset}]"];
    let out = s.run(&[&["run", "--gpus", "0", "--"][..], &show[..]].concat());
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "auto=[1]");
    let out = s.run(
        &[
            &["run", "--gpus", "0", "--no-auto-callback", "--"][..],
            &show[..],
        ]
        .concat(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "auto=[unset]");
}

#[test]
fn run_without_gpu_warns_or_fails_with_require_gpu() {
    let s = Sandbox::new("runnogpu");
    s.gpus(&[]);
    let out = s.run(&[
        "run",
        "--",
        "sh",
        "-c",
        "echo cvd=[${CUDA_VISIBLE_DEVICES-unset}]",
    ]);
    assert!(out.status.success());
    assert_eq!(text(&out.stdout).trim(), "cvd=[unset]");
    assert!(text(&out.stderr).contains("warning"));
    let out = s.run(&["run", "--require-gpu", "--", "true"]);
    assert_eq!(out.status.code(), Some(125));
}

#[test]
fn run_passes_exit_codes_and_signals_through() {
    let s = Sandbox::new("codes");
    s.gpus(&[(80, 80)]);
    assert_eq!(
        s.run(&["run", "--", "sh", "-c", "exit 7"]).status.code(),
        Some(7)
    );
    assert_eq!(
        s.run(&["run", "--", "sh", "-c", "kill -TERM $$"])
            .status
            .code(),
        Some(143)
    );
    let missing = s.run(&["run", "--", "no-such-command-oomkit"]);
    assert_eq!(missing.status.code(), Some(127));
    assert!(text(&missing.stderr).contains("no-such-command-oomkit"));
    // A failure without an OOM message is not retried.
    let out = s.run(&[
        "run",
        "--batch-size",
        "4",
        "--",
        "sh",
        "-c",
        "echo boom >&2; exit 3",
    ]);
    assert_eq!(out.status.code(), Some(3));
    assert!(text(&out.stderr).contains("failed after 1 attempt"));
}

fn alive(pid: i32) -> bool {
    // Zombies count as gone: they hold no memory and are waiting to be reaped.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z'),
        Err(_) => false,
    }
}

/// Starts `oomkit run -- script` and waits until the script's processes have written
/// `count` process ids to `pids.txt`, one a line.
fn run_until_started(s: &Sandbox, script: &Path, count: usize) -> (std::process::Child, Vec<i32>) {
    let mut child = s
        .command(&["run", "--", script.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let pids = loop {
        let text = std::fs::read_to_string(s.path("pids.txt")).unwrap_or_default();
        let pids: Vec<i32> = text.lines().filter_map(|l| l.trim().parse().ok()).collect();
        if pids.len() == count || started.elapsed() > Duration::from_secs(10) {
            break pids;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    if pids.len() != count {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the command never started");
    }
    (child, pids)
}

/// Whether every process is gone within 5 s; those still there are killed.
fn all_gone(pids: &[i32]) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while pids.iter().any(|p| alive(*p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let left: Vec<i32> = pids.iter().copied().filter(|p| alive(*p)).collect();
    for &p in &left {
        unsafe_kill(p, 9);
    }
    left.is_empty()
}

#[test]
fn sigterm_reaches_the_whole_group_and_nothing_is_left() {
    let s = Sandbox::new("signals");
    s.gpus(&[(80, 80)]);
    // A launcher with two workers, like torchrun; the workers ignore nothing.
    let launcher = s.script(
        "launch.sh",
        "sleep 300 & echo $! >> pids.txt\nsleep 300 & echo $! >> pids.txt\necho $$ >> pids.txt\nwait",
    );
    let (mut child, pids) = run_until_started(&s, &launcher, 3);
    unsafe_kill(child.id() as i32, 15);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(143), "exit code is 128 + SIGTERM");
    assert!(all_gone(&pids), "a process of {pids:?} was left behind");
}

/// A killed oomkit (SIGKILL, which it cannot pass on) leaves no command running: the
/// command gets SIGTERM, as from a signal passed on.
#[test]
fn a_killed_supervisor_ends_its_command() {
    let s = Sandbox::new("killed");
    s.gpus(&[(80, 80)]);
    let command = s.script("train.sh", "echo $$ > pids.txt\nexec sleep 300");
    let (mut child, pids) = run_until_started(&s, &command, 1);
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(all_gone(&pids), "the command outlived its supervisor");
}

fn unsafe_kill(pid: i32, sig: i32) {
    let status = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(status.success());
}

#[test]
fn concurrent_runs_never_share_a_gpu_before_it_fills() {
    let s = Sandbox::new("claims");
    // Free memory never changes in the fake file, as in the seconds before a job allocates.
    s.gpus(&[(80, 80), (80, 80)]);
    let job = s.script(
        "job.sh",
        r#"echo "start $CUDA_VISIBLE_DEVICES $(date +%s%N)" >> events.txt
sleep 0.6
echo "end $CUDA_VISIBLE_DEVICES $(date +%s%N)" >> events.txt"#,
    );
    let children: Vec<_> = (0..4)
        .map(|_| {
            s.command(&[
                "run",
                "--min-free",
                "50GiB",
                "--wait",
                "30s",
                "--poll",
                "100ms",
                "--",
                job.to_str().unwrap(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
        })
        .collect();
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
    let events = std::fs::read_to_string(s.path("events.txt")).unwrap();
    let mut spans: std::collections::HashMap<String, Vec<(u128, u128)>> = Default::default();
    let mut open: std::collections::HashMap<String, Vec<u128>> = Default::default();
    for line in events.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (kind, gpu, t) = (f[0], f[1].to_string(), f[2].parse::<u128>().unwrap());
        if kind == "start" {
            open.entry(gpu).or_default().push(t);
        } else {
            let start = open.get_mut(&gpu).unwrap().remove(0);
            spans.entry(gpu).or_default().push((start, t));
        }
    }
    assert_eq!(spans.values().map(|v| v.len()).sum::<usize>(), 4);
    for (gpu, mut v) in spans {
        v.sort();
        for w in v.windows(2) {
            assert!(w[0].1 <= w[1].0, "two jobs shared GPU {gpu}: {v:?}");
        }
    }
    // Claims are gone once the jobs are.
    let left: Vec<_> = std::fs::read_dir(s.path("claims"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "claim"))
        .collect();
    assert!(left.is_empty(), "claims left behind: {left:?}");
}

#[test]
fn run_waits_for_a_gpu_and_says_why() {
    let s = Sandbox::new("wait");
    s.gpus(&[(80, 5)]);
    let timeout = s.run(&[
        "run",
        "--min-free",
        "40GiB",
        "--wait",
        "300ms",
        "--poll",
        "100ms",
        "--",
        "true",
    ]);
    assert_eq!(timeout.status.code(), Some(124));
    let err = text(&timeout.stderr);
    assert!(
        err.contains("40.0 GiB free") && err.contains("5.00 GiB"),
        "{err}"
    );

    let waiting = s
        .command(&[
            "run",
            "--min-free",
            "40GiB",
            "--wait",
            "20s",
            "--poll",
            "100ms",
            "--",
            "sh",
            "-c",
            "echo got $CUDA_VISIBLE_DEVICES",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    s.gpus(&[(80, 60)]);
    let out = waiting.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "got 0");
    assert!(text(&out.stderr).contains("waiting for GPUs"));
}

/// A training stand-in whose peak is `fixed + per_sample * batch` and that OOMs above the GPU's free memory.
fn affine_job(s: &Sandbox, fixed_mib: u64, per_sample_mib: u64, free_mib: u64) -> PathBuf {
    affine_job_failing_with(
        s,
        fixed_mib,
        per_sample_mib,
        free_mib,
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB",
    )
}

/// The same stand-in, failing above `limit_mib` with the OOM message given.
fn affine_job_failing_with(
    s: &Sandbox,
    fixed_mib: u64,
    per_sample_mib: u64,
    limit_mib: u64,
    oom_message: &str,
) -> PathBuf {
    s.script(
        "probe_job.sh",
        &format!(
            r#"b=$1
peak=$(( ({fixed_mib} + {per_sample_mib} * b) * 1048576 ))
echo "$b" >> batches.txt
if [ $peak -gt $(( {limit_mib} * 1048576 )) ]; then
  echo "{oom_message}" >&2; exit 1
fi
echo "{{\"peak_bytes\": $peak}}" > "$OOMKIT_PROBE_FILE""#
        ),
    )
}

#[test]
fn find_batch_predicts_and_confirms() {
    let s = Sandbox::new("findbatch");
    s.gpus(&[(80, 80)]);
    let job = affine_job(&s, 6000, 700, 80 * 1024);
    let out = s.run(&[
        "find-batch",
        "--json",
        "--effective",
        "256",
        "--",
        job.to_str().unwrap(),
        "{batch_size}",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    let budget = (80.0 * 1024.0 * 0.9) as u64;
    let truth = (budget - 6000) / 700;
    let got = r["recommended_batch"].as_u64().unwrap();
    assert!(
        got <= truth && got as f64 >= truth as f64 * 0.95,
        "got {got}, truth {truth}"
    );
    let trials = r["trials"].as_array().unwrap();
    assert!(trials.len() <= 4, "{trials:?}");
    for t in trials {
        assert!(t.get("batch").is_some() && t.get("ok").is_some() && t.get("peak_bytes").is_some());
    }
    let accum = r["grad_accum"].as_u64().unwrap();
    assert_eq!(accum, 256u64.div_ceil(got));
    let micro = r["micro_batch_for_effective"].as_u64().unwrap();
    assert!(micro <= got && micro * accum >= 256 && (micro - 1) * accum < 256);
}

#[test]
fn find_batch_searches_within_the_process_s_own_cap() {
    // As on the H200 of VALIDATION.md: the GPU has 80 GiB free, but the
    // script caps itself (set_per_process_memory_fraction) at 30 GiB, which
    // only its OOM message says. The budget is the cap's, not the GPU's.
    let s = Sandbox::new("findcapped");
    s.gpus(&[(80, 80)]);
    let job = affine_job_failing_with(
        &s,
        6000,
        700,
        30 * 1024,
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 700.00 MiB. GPU 0 has a total capacity of 80.00 GiB of which 50.00 GiB is free. Including non-PyTorch memory, this process has 29.90 GiB memory in use. 30.00 GiB allowed; Of the allocated memory 29.50 GiB is allocated by PyTorch, and 100.00 MiB is reserved by PyTorch but unallocated.",
    );
    let out = s.run(&[
        "find-batch",
        "--json",
        "--",
        job.to_str().unwrap(),
        "{batch_size}",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["capacity_source"], "process_cap");
    assert_eq!(r["capacity_bytes"], 30u64 << 30);
    let budget = (30.0 * 1024.0 * 0.9) as u64;
    let truth = (budget - 6000) / 700;
    let got = r["recommended_batch"].as_u64().unwrap();
    assert!(got <= truth && got + 2 >= truth, "got {got}, truth {truth}");
    // Each batch ran once, though the search ran twice.
    let trials = r["trials"].as_array().unwrap();
    let mut batches: Vec<u64> = trials
        .iter()
        .map(|t| t["batch"].as_u64().unwrap())
        .collect();
    let n = batches.len();
    batches.sort_unstable();
    batches.dedup();
    assert_eq!(batches.len(), n, "{trials:?}");
    assert!(
        text(&out.stderr).contains("searching again within"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn find_batch_reports_when_nothing_fits() {
    let s = Sandbox::new("findnothing");
    s.gpus(&[(8, 8)]);
    let job = affine_job(&s, 9000, 100, 8 * 1024);
    let out = s.run(&[
        "find-batch",
        "--start",
        "4",
        "--",
        job.to_str().unwrap(),
        "{batch_size}",
    ]);
    assert_eq!(out.status.code(), Some(5));
    assert!(text(&out.stdout).contains("no micro-batch fits"));
}

#[test]
fn find_batch_with_stated_capacity_and_no_gpu() {
    let s = Sandbox::new("findcap");
    s.gpus(&[]);
    let job = affine_job(&s, 1000, 50, 1 << 20);
    let out = s.run(&[
        "find-batch",
        "--capacity",
        "10GiB",
        "--margin",
        "0",
        "--json",
        "--",
        job.to_str().unwrap(),
        "{batch_size}",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    // Predictions aim 1% under the line's crossing, so noise cannot turn the confirming run into a miss.
    let truth = (10 * 1024 - 1000) / 50;
    let got = r["recommended_batch"].as_u64().unwrap();
    assert!(
        got <= truth && got as f64 >= truth as f64 * 0.98,
        "{got} vs {truth}"
    );
    let no_cap = s.run(&["find-batch", "--", "true"]);
    assert_eq!(no_cap.status.code(), Some(3));
    assert!(text(&no_cap.stderr).contains("--capacity"));
}

/// A command with no tracker and no GPU: its host memory is read from
/// outside (the group's resident sets and the kernel's peak at exit), so
/// every trial has a measured peak and the recommendation is one of them.
#[test]
fn find_batch_measures_host_memory_from_outside_without_a_tracker() {
    let s = Sandbox::new("findrss");
    s.gpus(&[]);
    // 8 MiB a sample, touched so that it is resident.
    let job = s.script(
        "rss_job.sh",
        r#"exec python3 -c "import sys; a = bytearray((40 + 8 * int(sys.argv[1])) << 20); a[::4096] = b'x' * len(a[::4096])" "$1""#,
    );
    let out = s.run(&[
        "find-batch",
        "--capacity",
        "400MiB",
        "--margin",
        "0",
        "--max",
        "128",
        "--json",
        "--",
        job.to_str().unwrap(),
        "{batch_size}",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["measured_on"], "host");
    assert_eq!(r["capacity_source"], "capacity_flag");
    let budget = r["budget_bytes"].as_u64().unwrap();
    let trials = r["trials"].as_array().unwrap();
    for t in trials {
        assert_eq!(t["peak_source"], "rss", "{t}");
        let b = t["batch"].as_u64().unwrap();
        let peak = t["peak_bytes"].as_u64().unwrap();
        // At least what the command touched, and not absurdly more (Python's own memory).
        assert!(peak >= (40 + 8 * b) << 20, "{t}");
        assert!(peak <= ((40 + 8 * b) << 20) + (64 << 20), "{t}");
        assert_eq!(t["ok"], peak <= budget, "{t}");
    }
    let got = r["recommended_batch"].as_u64().unwrap();
    let fits = |b: u64| trials.iter().any(|t| t["batch"] == b && t["ok"] == true);
    assert!(fits(got), "the recommendation was measured: {trials:?}");
    // 45 samples fill the 400 MiB with nothing else held; Python's own ~20 MiB leave 42-43.
    assert!((40..=45).contains(&got), "{got}: {trials:?}");
    // The fitted line passes within 10% of every peak it rests on.
    let (fixed, slope) = (
        r["fixed_bytes"].as_f64().unwrap(),
        r["per_sample_bytes"].as_f64().unwrap(),
    );
    for t in trials {
        let b = t["batch"].as_f64().unwrap();
        let peak = t["peak_bytes"].as_f64().unwrap();
        assert!(
            ((fixed + slope * b) - peak).abs() <= 0.1 * peak,
            "{t} vs {fixed} + {slope} b"
        );
    }
    assert!(r["fit_max_error"].as_f64().unwrap() <= 0.1);
}

/// A trial that finishes with nothing measured (no tracker, and NVML sees
/// none of its memory) ends the search with no recommendation and exit 6.
#[test]
fn find_batch_refuses_to_recommend_what_it_never_measured() {
    let s = Sandbox::new("findunmeasured");
    s.gpus(&[(80, 80)]);
    let out = s.run(&["find-batch", "--json", "--", "true", "{batch_size}"]);
    assert_eq!(out.status.code(), Some(6), "{}", text(&out.stderr));
    assert!(out.stdout.is_empty(), "no report: {}", text(&out.stdout));
    let err = text(&out.stderr);
    assert!(
        err.contains("trial 1 (micro-batch 1) finished, but no peak was measured")
            && err.contains("oomkit.Tracker"),
        "{err}"
    );
    assert!(!err.contains("recommended"), "{err}");
}

/// A retry reruns the command in the same place: an output folder the
/// first attempt made stops the second, unless the command names it with
/// `{attempt}` (docs/commands.md, "Each attempt in its own place").
#[test]
fn attempt_in_the_command_gives_each_retry_its_own_output_folder() {
    let s = Sandbox::new("attemptdir");
    s.gpus(&[(80, 80)]);
    let job = s.script(
        "outdir_job.sh",
        r#"mkdir "$1" || exit 3
if [ "$OOMKIT_ATTEMPT" = 1 ]; then
  echo "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.12 GiB is free." >&2
  exit 1
fi"#,
    );
    let same = s.run(&[
        "run",
        "--batch-size",
        "8",
        "--json",
        "--",
        job.to_str().unwrap(),
        "out",
    ]);
    let v: Value = serde_json::from_slice(&same.stdout).unwrap();
    assert_eq!(
        v["outcome"], "failed",
        "the second attempt finds the first one's folder"
    );
    assert_eq!(v["attempts"][1]["exit_code"], 3);
    let own = s.run(&[
        "run",
        "--batch-size",
        "8",
        "--json",
        "--",
        job.to_str().unwrap(),
        "each{attempt}",
    ]);
    let v: Value = serde_json::from_slice(&own.stdout).unwrap();
    assert_eq!(v["outcome"], "succeeded", "{}", text(&own.stderr));
    assert!(s.path("each1").is_dir() && s.path("each2").is_dir());
}

#[test]
fn run_help_gives_the_exit_codes_it_uses() {
    let s = Sandbox::new("runhelp");
    let help = text(&s.run(&["run", "--help"]).stdout);
    assert!(help.contains("(exit 125)"), "{help}");
    assert!(!help.contains("exit 3"), "{help}");
}

#[test]
fn run_usage_errors_are_125_and_the_commands_codes_pass_through() {
    let s = Sandbox::new("usage");
    s.gpus(&[(80, 80)]);
    let out = s.run(&["run", "--", "echo", "{batch_size}"]);
    assert_eq!(out.status.code(), Some(125));
    assert!(text(&out.stderr).contains("--batch-size"));
    assert_eq!(
        s.run(&["run", "--wait", "soon", "--", "true"])
            .status
            .code(),
        Some(125)
    );
    assert_eq!(s.run(&["run"]).status.code(), Some(125));
    // The command's own codes pass through, 1 to 5 included: oomkit's are 124 to 127.
    for code in 1..=5 {
        let out = s.run(&[
            "run",
            "--gpus",
            "0",
            "--",
            "sh",
            "-c",
            &format!("exit {code}"),
        ]);
        assert_eq!(out.status.code(), Some(code), "{}", text(&out.stderr));
    }
    let _ = Path::new(".");
}

/// The lines the stand-in script wrote to log.txt.
fn log_lines(s: &Sandbox) -> Vec<String> {
    std::fs::read_to_string(s.path("log.txt"))
        .unwrap()
        .lines()
        .map(String::from)
        .collect()
}

/// Runs `oomkit run --batch-size B --summary-json summary.json -- SCRIPT {batch_size}`.
fn run_batch(s: &Sandbox, batch: &str, script: &Path) -> Output {
    s.run(&[
        "run",
        "--batch-size",
        batch,
        "--summary-json",
        "summary.json",
        "--",
        script.to_str().unwrap(),
        "{batch_size}",
    ])
}

/// Reads the summary JSON a run wrote.
fn summary_of(s: &Sandbox) -> Value {
    serde_json::from_slice(&std::fs::read(s.path("summary.json")).unwrap()).unwrap()
}

/// Each attempt's (micro-batch, GPUs, cause, action).
fn steps(summary: &Value) -> Vec<(Value, Value, Value, Value)> {
    summary["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["batch_size"].clone(),
                a["gpus"].clone(),
                a["cause"].clone(),
                a["action"].clone(),
            )
        })
        .collect()
}

/// Runs out of memory from fragmentation (6.08 GiB reserved but unallocated
/// against a 2 GiB request) unless expandable segments are on.
const FRAGMENTED_UNLESS_EXPANDABLE: &str = r#"echo "conf=[$PYTORCH_CUDA_ALLOC_CONF] micro=$1" >> log.txt
case "$PYTORCH_CUDA_ALLOC_CONF" in *expandable_segments:True*) echo trained; exit 0;; esac
echo "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.12 GiB is free. Including non-PyTorch memory, this process has 78.02 GiB memory in use. Of the allocated memory 71.44 GiB is allocated by PyTorch, and 6.08 GiB is reserved by PyTorch but unallocated." >&2
exit 1"#;

#[test]
fn fragmentation_is_retried_with_expandable_segments_at_the_same_batch() {
    let s = Sandbox::new("fragmented");
    s.gpus(&[(80, 80)]);
    let train = s.script("train.sh", FRAGMENTED_UNLESS_EXPANDABLE);
    let out = s
        .command(&[
            "run",
            "--batch-size",
            "64",
            "--summary-json",
            "summary.json",
            "--",
            train.to_str().unwrap(),
            "{batch_size}",
        ])
        .env("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let log = std::fs::read_to_string(s.path("log.txt")).unwrap();
    assert_eq!(
        log.lines().collect::<Vec<_>>(),
        [
            "conf=[max_split_size_mb:128] micro=64",
            "conf=[max_split_size_mb:128,expandable_segments:True] micro=64",
        ]
    );
    let summary = summary_of(&s);
    assert_eq!(
        steps(&summary),
        [
            (
                json!(64),
                json!([0]),
                json!("fragmentation"),
                json!("expandable_segments")
            ),
            (json!(64), json!([0]), json!(null), json!(null)),
        ]
    );
    let notes = summary["notes"].to_string();
    assert!(
        notes.contains("PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128,expandable_segments:True"),
        "{notes}"
    );
    // Without --batch-size a fix that needs no batch change is still tried.
    let s2 = Sandbox::new("fragmented-nobatch");
    s2.gpus(&[(80, 80)]);
    let train2 = s2.script("train.sh", FRAGMENTED_UNLESS_EXPANDABLE);
    let out = s2.run(&["run", "--", train2.to_str().unwrap(), "1"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn another_process_on_the_gpu_sends_the_same_plan_to_another_gpu() {
    let s = Sandbox::new("otherprocess");
    s.gpus(&[(80, 80), (80, 78)]);
    // Another process took GPU 0 after oomkit chose it.
    let train = s.script(
        "train.sh",
        r#"echo "gpus=$CUDA_VISIBLE_DEVICES micro=$1" >> log.txt
[ "$CUDA_VISIBLE_DEVICES" = 1 ] && exit 0
echo "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 3.12 GiB is free. Process 4242 has 60.00 GiB memory in use. Including non-PyTorch memory, this process has 16.02 GiB memory in use. Of the allocated memory 15.12 GiB is allocated by PyTorch, and 200.00 MiB is reserved by PyTorch but unallocated." >&2
exit 1"#,
    );
    let out = run_batch(&s, "32", &train);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(log_lines(&s), ["gpus=0 micro=32", "gpus=1 micro=32"]);
    assert_eq!(
        steps(&summary_of(&s)),
        [
            (
                json!(32),
                json!([0]),
                json!("other_processes"),
                json!("other_gpu")
            ),
            (json!(32), json!([1]), json!(null), json!(null)),
        ]
    );
    assert!(text(&out.stderr).contains("retrying the same plan on GPU 1"));
}

#[test]
fn capacity_steps_down_and_a_request_larger_than_the_device_stops_at_the_floor() {
    let s = Sandbox::new("causes");
    s.gpus(&[(80, 80)]);
    let train = s.script("train.sh", OOM_ABOVE_LIMIT);
    let out = s
        .command(&[
            "run",
            "--batch-size",
            "16",
            "--summary-json",
            "summary.json",
            "--",
            train.to_str().unwrap(),
            "{batch_size}",
            "1",
        ])
        .env("LIMIT", "8")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        steps(&summary_of(&s)),
        [
            (json!(16), json!([0]), json!("capacity"), json!("step_down")),
            (json!(8), json!([0]), json!(null), json!(null)),
        ]
    );
    assert!(summary_of(&s)["notes"]
        .to_string()
        .contains("--batch-size 8 --grad-accum 2"));

    // 100 GiB asked of an 80 GiB GPU at the smallest batch: no retry can help.
    let s2 = Sandbox::new("toolarge");
    s2.gpus(&[(80, 80)]);
    let train = s2.script(
        "train.sh",
        r#"echo "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 100.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 78.00 GiB is free. Including non-PyTorch memory, this process has 1.02 GiB memory in use. Of the allocated memory 500.00 MiB is allocated by PyTorch, and 12.00 MiB is reserved by PyTorch but unallocated." >&2; exit 1"#,
    );
    let out = s2.run(&[
        "run",
        "--batch-size",
        "1",
        "--summary-json",
        "summary.json",
        "--",
        train.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let summary = summary_of(&s2);
    assert_eq!(
        steps(&summary),
        [(
            json!(1),
            json!([0]),
            json!("request_exceeds_capacity"),
            json!("stop")
        )]
    );
    assert!(summary["notes"].to_string().contains("no batch can fix it"));
}

#[test]
fn a_memory_fraction_cap_is_named_as_the_cause() {
    let s = Sandbox::new("fraction");
    s.gpus(&[(80, 80)]);
    let train = s.script(
        "train.sh",
        r#"[ "$1" -le 4 ] && exit 0
echo "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 996.00 MiB. GPU 0 has a total capacity of 44.43 GiB of which 9.06 GiB is free. Including non-PyTorch memory, this process has 17.81 GiB memory in use. 17.69 GiB allowed; Of the allocated memory 17.44 GiB is allocated by PyTorch, and 59.88 MiB is reserved by PyTorch but unallocated." >&2; exit 1"#,
    );
    let out = run_batch(&s, "8", &train);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let summary = summary_of(&s);
    assert_eq!(
        steps(&summary)[0],
        (
            json!(8),
            json!([0]),
            json!("memory_fraction_limit"),
            json!("step_down")
        )
    );
    assert!(summary["notes"]
        .to_string()
        .contains("set_per_process_memory_fraction"));
}

#[test]
fn the_next_run_of_the_same_command_starts_from_the_plan_that_finished() {
    let s = Sandbox::new("remember");
    s.gpus(&[(80, 80)]);
    let train = s.script("train.sh", OOM_ABOVE_LIMIT);
    let run = |extra: &[&str]| {
        let mut args = vec!["run", "--batch-size", "32", "--effective-batch", "64"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&[
            "--",
            train.to_str().unwrap(),
            "{batch_size}",
            "{grad_accum}",
        ]);
        s.command(&args).env("LIMIT", "8").output().unwrap()
    };
    let first = run(&[]);
    assert!(first.status.success(), "{}", text(&first.stderr));
    let second = run(&[]);
    assert!(second.status.success(), "{}", text(&second.stderr));
    let said = text(&second.stderr);
    assert!(
        said.contains("starting from micro-batch 8 x accumulation 8, which finished last time for this command on Fake H100"),
        "{said}"
    );
    let fresh = run(&["--fresh"]);
    assert!(fresh.status.success());
    let log = std::fs::read_to_string(s.path("log.txt")).unwrap();
    let micro: Vec<&str> = log.lines().map(|l| l.split(' ').next().unwrap()).collect();
    // First run: 32, 16, 8. Second: straight to 8. With --fresh: 32, 16, 8 again.
    assert_eq!(
        micro,
        ["micro=32", "micro=16", "micro=8", "micro=8", "micro=32", "micro=16", "micro=8"]
    );
    assert!(s.path("cache").join("plans.json").exists());
}

#[test]
fn a_failure_far_past_the_device_jumps_to_the_predicted_micro_batch() {
    let s = Sandbox::new("jump");
    s.gpus(&[(80, 80)]);
    // At micro-batch 64 the process held 19 GiB and asked for 57 GiB more with
    // 1 GiB free: 64 x 20 / 76 is about 16, so halving to 32 would fail again.
    let train = s.script(
        "train.sh",
        r#"echo "micro=$1" >> log.txt
[ "$1" -le 16 ] && exit 0
echo "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 57.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.00 GiB is free. Including non-PyTorch memory, this process has 19.00 GiB memory in use. Of the allocated memory 18.50 GiB is allocated by PyTorch, and 200.00 MiB is reserved by PyTorch but unallocated." >&2; exit 1"#,
    );
    let out = run_batch(&s, "64", &train);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(log_lines(&s), ["micro=64", "micro=16"]);
    assert_eq!(
        steps(&summary_of(&s))[0],
        (json!(64), json!([0]), json!("capacity"), json!("step_down"))
    );
}

#[test]
fn capacity_finishes_at_the_largest_exact_micro_batch_that_fits() {
    let s = Sandbox::new("largest");
    s.gpus(&[(80, 80)]);
    let train = s.script("train.sh", OOM_ABOVE_LIMIT);
    // Up to 20 fits; 48's divisors are 24, 16, 12: halving would stop at 12.
    let out = s
        .command(&[
            "run",
            "--batch-size",
            "48",
            "--summary-json",
            "summary.json",
            "--",
            train.to_str().unwrap(),
            "{batch_size}",
            "{grad_accum}",
        ])
        .env("LIMIT", "20")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let micro: Vec<Value> = steps(&summary_of(&s)).into_iter().map(|s| s.0).collect();
    assert_eq!(micro, [json!(48), json!(24), json!(16)]);
    assert_eq!(summary_of(&s)["attempts"][2]["effective_batch"], json!(48));
}

#[test]
fn the_trackers_oom_record_is_read_when_the_command_prints_another_error() {
    let s = Sandbox::new("trackerrecord");
    s.gpus(&[(80, 80)]);
    // What the tracker writes to $OOMKIT_EVENTS_FILE, while a framework prints its own line.
    let train = s.script(
        "train.sh",
        r#"echo "conf=[$PYTORCH_CUDA_ALLOC_CONF]" >> log.txt
case "$PYTORCH_CUDA_ALLOC_CONF" in *expandable_segments:True*) exit 0;; esac
echo '{"message": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.12 GiB is free. Including non-PyTorch memory, this process has 78.02 GiB memory in use. Of the allocated memory 71.44 GiB is allocated by PyTorch, and 6.08 GiB is reserved by PyTorch but unallocated.", "step": 3, "stage": "backward"}' >> "$OOMKIT_EVENTS_FILE"
echo "RuntimeError: the training loop gave up" >&2
exit 1"#,
    );
    let out = run_batch(&s, "64", &train);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let summary = summary_of(&s);
    assert_eq!(
        steps(&summary)[0],
        (
            json!(64),
            json!([0]),
            json!("fragmentation"),
            json!("expandable_segments")
        )
    );
    assert!(summary["attempts"][0]["oom_message"]
        .as_str()
        .unwrap()
        .contains("6.08 GiB is reserved by PyTorch but unallocated"));
    assert_eq!(log_lines(&s).len(), 2);
}

#[test]
fn json_commands_print_json_alone_and_the_commands_output_goes_to_stderr() {
    let s = Sandbox::new("jsononly");
    s.gpus(&[(80, 80)]);
    // A training script that talks on stdout, as they all do.
    let train = s.script(
        "train.sh",
        r#"echo "epoch 1 loss 2.31"
if [ -n "$OOMKIT_PROBE_FILE" ]; then
  echo "{\"peak_bytes\": $(( ($1 * 100 + 1000) * 1048576 ))}" > "$OOMKIT_PROBE_FILE"
fi"#,
    );
    for args in [
        vec!["run", "--json", "--batch-size", "8", "--"],
        vec!["find-batch", "--json", "--max", "64", "--"],
    ] {
        let mut args = args;
        args.extend_from_slice(&[train.to_str().unwrap(), "{batch_size}"]);
        let out = s.run(&args);
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        let parsed: Result<Value, _> = serde_json::from_slice(&out.stdout);
        assert!(
            parsed.is_ok(),
            "{args:?}: stdout is not JSON alone: {}",
            text(&out.stdout)
        );
        assert!(text(&out.stderr).contains("epoch 1 loss 2.31"), "{args:?}");
    }
    // Without --json the command's output stays on stdout.
    let out = s.run(&["run", "--", train.to_str().unwrap(), "1"]);
    assert!(text(&out.stdout).contains("epoch 1 loss 2.31"));
}

/// Runs out of memory from fragmentation unless expandable segments are on,
/// and tells `oomkit run` of the snapshot its tracker dumped at the OOM
/// (`$SNAPSHOT`), as the tracker does through `OOMKIT_EVENTS_FILE`.
const FRAGMENTED_WITH_SNAPSHOT: &str = r#"echo "conf=[$PYTORCH_CUDA_ALLOC_CONF] micro=$1" >> log.txt
case "$PYTORCH_CUDA_ALLOC_CONF" in *expandable_segments:True*) echo trained; exit 0;; esac
[ "$1" -le 16 ] && { echo trained; exit 0; }
msg="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.12 GiB is free. Including non-PyTorch memory, this process has 78.02 GiB memory in use. Of the allocated memory 71.44 GiB is allocated by PyTorch, and 6.08 GiB is reserved by PyTorch but unallocated."
printf '{"message": "%s", "step": 3, "stage": "forward", "snapshot": "%s"}\n' "$msg" "$SNAPSHOT" >> "$OOMKIT_EVENTS_FILE"
echo "$msg" >&2
exit 1"#;

/// `oomkit run` of the stand-in that fails with a fragmentation OOM and
/// leaves `snapshot` (in the sandbox) as the OOM's snapshot.
fn run_leaving_snapshot(s: &Sandbox, snapshot: &str) -> std::process::Output {
    let train = s.script("train.sh", FRAGMENTED_WITH_SNAPSHOT);
    s.command(&[
        "run",
        "--batch-size",
        "32",
        "--summary-json",
        "summary.json",
        "--",
        train.to_str().unwrap(),
        "{batch_size}",
    ])
    .env("SNAPSHOT", s.path(snapshot))
    .output()
    .unwrap()
}

#[test]
fn a_fragmentation_oom_with_a_snapshot_retries_with_the_setting_only_if_its_replay_avoids_it() {
    // The replay of a fragmentation OOM that expandable segments avoid: retried with them.
    let s = Sandbox::new("fragmented-snapshot");
    s.gpus(&[(80, 80)]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fragmented_snapshot.py");
    python_script(script, &[s.path("frag.pickle").as_os_str()]);
    let out = run_leaving_snapshot(&s, "frag.pickle");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(
        err.contains("retrying the same plan with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (replaying")
            && err.contains("the OOM at event 15 does not happen"),
        "{err}"
    );
    assert_eq!(
        log_lines(&s),
        [
            "conf=[] micro=32",
            "conf=[expandable_segments:True] micro=32"
        ]
    );
    let summary = summary_of(&s);
    assert_eq!(summary["attempts"][0]["replayed"]["avoided"], json!(true));
    assert_eq!(summary["attempts"][0]["replayed"]["event"], json!(15));

    // The demo's OOM is the device being full: its replay with expandable
    // segments still runs out, so the setting is skipped for a smaller batch.
    let s2 = Sandbox::new("fragmented-snapshot-full");
    s2.gpus(&[(80, 80)]);
    std::fs::copy(demo_file(), s2.path("demo.pickle")).unwrap();
    let out = run_leaving_snapshot(&s2, "demo.pickle");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(
        err.contains("the OOM at event 7923 still happens")
            && err.contains("stepping the micro-batch down instead"),
        "{err}"
    );
    assert_eq!(log_lines(&s2), ["conf=[] micro=32", "conf=[] micro=16"]);
    let summary = summary_of(&s2);
    assert_eq!(summary["attempts"][0]["replayed"]["avoided"], json!(false));
    assert_eq!(summary["attempts"][0]["action"], json!("step_down"));
}

/// A script that fails for a reason other than memory (here Python's
/// ModuleNotFoundError) is not "too large": find-batch stops at once with
/// the script's own error and exit 7, and `run` does not retry it and names it.
#[test]
fn a_failure_that_is_not_memory_stops_the_search_and_the_retries() {
    let s = Sandbox::new("notmemory");
    s.gpus(&[]);
    let job = s.script(
        "import_error.sh",
        r#"exec python3 -c "import sys; import not_a_module_oomkit" "$1""#,
    );
    let out = s.run(&[
        "find-batch",
        "--capacity",
        "1GiB",
        "--json",
        "--",
        job.to_str().unwrap(),
        "{batch_size}",
    ]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{err}");
    assert!(out.stdout.is_empty(), "no report: {}", text(&out.stdout));
    assert!(
        err.contains("trial 1 (micro-batch 1) failed with exit code 1, not for memory (ModuleNotFoundError: No module named 'not_a_module_oomkit')"),
        "{err}"
    );
    assert!(
        !err.contains("too large") && !err.contains("fits in"),
        "{err}"
    );

    let summary = s.dir.join("summary.json");
    let out = s.run(&[
        "run",
        "--batch-size",
        "8",
        "--summary-json",
        summary.to_str().unwrap(),
        "--",
        job.to_str().unwrap(),
        "{batch_size}",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("attempt 1 failed with exit code 1, not for memory (ModuleNotFoundError: No module named 'not_a_module_oomkit'): not retried"),
        "{err}"
    );
    let r: Value = serde_json::from_slice(&std::fs::read(&summary).unwrap()).unwrap();
    assert_eq!(r["outcome"], "failed");
    assert_eq!(r["attempts"].as_array().unwrap().len(), 1);
    assert_eq!(
        r["attempts"][0]["error"],
        "ModuleNotFoundError: No module named 'not_a_module_oomkit'"
    );
    assert_eq!(r["attempts"][0]["oom"], false);
}

/// Running out of host memory is a memory failure: the CPU allocator's
/// message counts a trial as too large, as CUDA's does.
#[test]
fn the_cpu_allocator_s_failure_counts_as_too_large() {
    let s = Sandbox::new("cpuoom");
    s.gpus(&[]);
    let job = affine_job_failing_with(
        &s,
        100,
        10,
        500,
        "RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate 5242880000 bytes. Error code 12 (Cannot allocate memory)",
    );
    let out = s.run(&[
        "find-batch",
        "--capacity",
        "1GiB",
        "--margin",
        "0",
        "--json",
        "--",
        job.to_str().unwrap(),
        "{batch_size}",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["recommended_batch"], 40);
    assert!(r["trials"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["oom"] == true));
}

#[test]
fn run_keeps_the_order_of_stdout_and_stderr_where_both_go_to_one_file() {
    let s = Sandbox::new("one-stream");
    s.gpus(&[]);
    let script = s.script(
        "talk.sh",
        "i=0; while [ $i -lt 200 ]; do echo out$i; echo err$i >&2; i=$((i+1)); done",
    );
    let log = std::fs::File::create(s.path("both.log")).unwrap();
    let status = s
        .command(&["run", "--", script.to_str().unwrap()])
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .status()
        .unwrap();
    assert!(status.success());
    let text = std::fs::read_to_string(s.path("both.log")).unwrap();
    let said: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("out") || l.starts_with("err"))
        .collect();
    let expected: Vec<String> = (0..200)
        .flat_map(|i| [format!("out{i}"), format!("err{i}")])
        .collect();
    assert_eq!(said, expected, "{text}");
}
