//! The allocator's settings: read from a snapshot's `allocator_settings`,
//! and parsed from `PYTORCH_CUDA_ALLOC_CONF`'s syntax as
//! `c10/core/AllocatorConfig.cpp` parses it.

use crate::error::AllocatorError;
use crate::rules::{
    division_class, round_size, should_split, PoolKind, K_LARGE_BUFFER, ROUNDUP_INTERVALS,
};
use serde_json::Value;

/// One mebibyte, the unit of the `_mb` settings.
const MB: u64 = 1 << 20;

/// The settings of PyTorch's CUDA caching allocator that change where memory goes.
#[derive(Clone, Debug, PartialEq)]
pub struct AllocatorConfig {
    /// Blocks this large or larger are never split (`max_split_size_mb`); `u64::MAX` for no limit, the default.
    pub max_split_size: u64,
    /// How much larger than a request an unsplit oversize block may be (`max_non_split_rounding_mb`, default 20 MiB).
    pub max_non_split_rounding: u64,
    /// Reclaim cached blocks above this share of the allowed memory (`garbage_collection_threshold`); 0 is off.
    pub garbage_collection_threshold: f64,
    /// One growing segment per stream and pool instead of one `cudaMalloc` per segment (`expandable_segments`).
    pub expandable_segments: bool,
    /// Divisions between powers of two that sizes round up to, per size class (`roundup_power2_divisions`); 0 or 1 is off.
    pub roundup_power2_divisions: [u64; ROUNDUP_INTERVALS],
    /// `torch.cuda.set_per_process_memory_fraction`: the share of the device the allocator may hold, if set.
    pub memory_fraction: Option<f64>,
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig {
            max_split_size: u64::MAX,
            max_non_split_rounding: K_LARGE_BUFFER,
            garbage_collection_threshold: 0.0,
            expandable_segments: false,
            roundup_power2_divisions: [0; ROUNDUP_INTERVALS],
            memory_fraction: None,
        }
    }
}

/// Settings that `PYTORCH_CUDA_ALLOC_CONF` accepts but that do not change
/// where device memory goes (pinned host memory, locking), accepted and
/// left out of the model.
const NO_EFFECT: [&str; 8] = [
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
    "graph_capture_record_stream_reuse",
];

impl AllocatorConfig {
    /// The divisions `roundup_power2_divisions` sets for a size.
    pub fn divisions_for(&self, size: u64) -> u64 {
        self.roundup_power2_divisions[division_class(size)]
    }

    /// The size a request is served with under these settings (`round_size`).
    pub fn round(&self, size: u64) -> u64 {
        round_size(size, self.divisions_for(size))
    }

    /// Whether a free block of `block` bytes given to a request of `size`
    /// is split under these settings (`should_split`).
    pub fn splits(&self, pool: PoolKind, block: u64, size: u64) -> bool {
        should_split(
            pool,
            block,
            size,
            self.expandable_segments,
            self.max_split_size,
        )
    }

    /// Applies settings written as `PYTORCH_CUDA_ALLOC_CONF` writes them
    /// (`expandable_segments:True,max_split_size_mb:128`) on top of these,
    /// checking each value as PyTorch does; `per_process_memory_fraction:F`
    /// stands for `torch.cuda.set_per_process_memory_fraction(F)`.
    pub fn apply(&mut self, conf: &str) -> Result<(), AllocatorError> {
        let tokens = lex(conf);
        let mut t = Tokens {
            items: &tokens,
            at: 0,
            conf,
        };
        while let Some(key) = t.next() {
            t.expect(":", key)?;
            match key {
                "max_split_size_mb" => self.max_split_size = t.megabytes(key)?,
                "max_non_split_rounding_mb" => self.max_non_split_rounding = t.megabytes(key)?,
                "garbage_collection_threshold" => {
                    let v = t.number(key)?;
                    if !(v > 0.0 && v < 1.0) {
                        return Err(t.bad(key, "must be between 0 and 1"));
                    }
                    self.garbage_collection_threshold = v;
                }
                "expandable_segments" => self.expandable_segments = t.boolean(key)?,
                "roundup_power2_divisions" => self.roundup_power2_divisions = t.divisions(key)?,
                "per_process_memory_fraction" => {
                    let v = t.number(key)?;
                    if !(v > 0.0 && v <= 1.0) {
                        return Err(t.bad(key, "must be above 0 and at most 1"));
                    }
                    self.memory_fraction = Some(v);
                }
                "backend" => match t.next() {
                    Some("native") => {}
                    Some("cudaMallocAsync") => {
                        return Err(AllocatorError::NotModelled(
                            "backend:cudaMallocAsync hands memory to the CUDA driver's own pool, which this model of the native caching allocator does not follow".into(),
                        ))
                    }
                    _ => return Err(t.bad(key, "must be native or cudaMallocAsync")),
                },
                k if NO_EFFECT.contains(&k) => t.skip_value(),
                other => {
                    return Err(AllocatorError::Setting {
                        conf: conf.into(),
                        problem: format!("unknown setting {other:?}"),
                    })
                }
            }
            if t.peek().is_some() {
                t.expect(",", key)?;
            }
        }
        Ok(())
    }

    /// The settings a snapshot recorded (`allocator_settings`, torch 2.5 on),
    /// with the names of any that this model does not follow.
    pub fn from_settings(settings: &Value) -> (AllocatorConfig, Vec<String>) {
        let mut c = AllocatorConfig::default();
        let mut unknown = Vec::new();
        let Some(map) = settings.as_object() else {
            return (c, vec!["allocator_settings is not a dict".into()]);
        };
        // The string itself carries what has no field of its own
        // (max_non_split_rounding_mb); the fields below then take precedence.
        if let Some(s) = map.get("PYTORCH_CUDA_ALLOC_CONF").and_then(Value::as_str) {
            if let Err(e) = c.apply(s) {
                unknown.push(e.to_string());
            }
        }
        for (k, v) in map {
            match k.as_str() {
                "max_split_size" => match v.as_i64() {
                    Some(n) if n > 0 => c.max_split_size = n as u64,
                    _ => c.max_split_size = u64::MAX,
                },
                "max_non_split_rounding_size" => {
                    if let Some(n) = v.as_u64() {
                        c.max_non_split_rounding = n;
                    }
                }
                "garbage_collection_threshold" => {
                    c.garbage_collection_threshold = v.as_f64().unwrap_or(0.0)
                }
                "expandable_segments" => c.expandable_segments = v.as_bool().unwrap_or(false),
                "roundup_power2_divisions" => match read_divisions(v) {
                    Some(d) => c.roundup_power2_divisions = d,
                    None => unknown.push(format!("roundup_power2_divisions: {v}")),
                },
                "PYTORCH_CUDA_ALLOC_CONF" => {}
                k if NO_EFFECT.contains(&k) || k.starts_with("pinned_") => {}
                other => unknown.push(other.to_string()),
            }
        }
        (c, unknown)
    }

    /// The settings that differ from PyTorch's defaults, in `PYTORCH_CUDA_ALLOC_CONF`'s syntax (empty for none).
    pub fn describe(&self) -> String {
        let d = AllocatorConfig::default();
        let mut parts = Vec::new();
        if self.expandable_segments != d.expandable_segments {
            parts.push(format!(
                "expandable_segments:{}",
                if self.expandable_segments {
                    "True"
                } else {
                    "False"
                }
            ));
        }
        if self.max_split_size != d.max_split_size {
            parts.push(format!("max_split_size_mb:{}", self.max_split_size / MB));
        }
        if self.max_non_split_rounding != d.max_non_split_rounding {
            parts.push(format!(
                "max_non_split_rounding_mb:{}",
                self.max_non_split_rounding / MB
            ));
        }
        if self.garbage_collection_threshold != d.garbage_collection_threshold {
            parts.push(format!(
                "garbage_collection_threshold:{}",
                self.garbage_collection_threshold
            ));
        }
        if self.roundup_power2_divisions != d.roundup_power2_divisions {
            let r = &self.roundup_power2_divisions;
            if r.iter().all(|&x| x == r[0]) {
                parts.push(format!("roundup_power2_divisions:{}", r[0]));
            } else {
                let items: Vec<String> = r
                    .iter()
                    .enumerate()
                    .map(|(i, x)| format!("{}:{x}", 1u64 << i))
                    .collect();
                parts.push(format!("roundup_power2_divisions:[{}]", items.join(",")));
            }
        }
        if let Some(f) = self.memory_fraction {
            parts.push(format!("per_process_memory_fraction:{f}"));
        }
        parts.join(",")
    }
}

/// Reads `roundup_power2_divisions` as snapshots record it: a dict from
/// the size class in MiB (`"1"` to `"32768"`) to divisions, or a list of 16.
fn read_divisions(v: &Value) -> Option<[u64; ROUNDUP_INTERVALS]> {
    let mut d = [0; ROUNDUP_INTERVALS];
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let mb: u64 = k.parse().ok()?;
                if !mb.is_power_of_two() {
                    return None;
                }
                let i = (63 - mb.leading_zeros()) as usize;
                *d.get_mut(i)? = x.as_u64()?;
            }
        }
        Value::Array(a) if a.len() == ROUNDUP_INTERVALS => {
            for (i, x) in a.iter().enumerate() {
                d[i] = x.as_u64()?;
            }
        }
        Value::Number(n) => d = [n.as_u64()?; ROUNDUP_INTERVALS],
        _ => return None,
    }
    Some(d)
}

/// Splits a setting string into words and the punctuation `, : [ ]`,
/// dropping spaces, as `AllocatorConfig::lexArgs` does.
fn lex(conf: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    for c in conf.chars() {
        match c {
            ',' | ':' | '[' | ']' => {
                if !word.is_empty() {
                    out.push(std::mem::take(&mut word));
                }
                out.push(c.to_string());
            }
            ' ' => {}
            c => word.push(c),
        }
    }
    if !word.is_empty() {
        out.push(word);
    }
    out
}

/// A cursor over the words of a setting string.
struct Tokens<'a> {
    items: &'a [String],
    at: usize,
    conf: &'a str,
}

impl<'a> Tokens<'a> {
    fn next(&mut self) -> Option<&'a str> {
        let t = self.items.get(self.at)?;
        self.at += 1;
        Some(t.as_str())
    }

    fn peek(&self) -> Option<&'a str> {
        self.items.get(self.at).map(String::as_str)
    }

    fn bad(&self, key: &str, problem: &str) -> AllocatorError {
        AllocatorError::Setting {
            conf: self.conf.into(),
            problem: format!("{key} {problem}"),
        }
    }

    fn expect(&mut self, punct: &str, key: &str) -> Result<(), AllocatorError> {
        match self.next() {
            Some(p) if p == punct => Ok(()),
            Some(p) => Err(self.bad(
                key,
                &format!("is followed by {p:?} where {punct:?} belongs"),
            )),
            None => Err(self.bad(key, &format!("needs {punct:?} and a value"))),
        }
    }

    fn value(&mut self, key: &str) -> Result<&'a str, AllocatorError> {
        match self.next() {
            Some(v) if ![",", ":", "[", "]"].contains(&v) => Ok(v),
            _ => Err(self.bad(key, "has no value")),
        }
    }

    fn number(&mut self, key: &str) -> Result<f64, AllocatorError> {
        let v = self.value(key)?;
        v.parse::<f64>()
            .ok()
            .filter(|x| x.is_finite())
            .ok_or_else(|| self.bad(key, &format!("takes a number, not {v:?}")))
    }

    fn whole(&mut self, key: &str) -> Result<u64, AllocatorError> {
        let v = self.value(key)?;
        v.parse::<u64>()
            .map_err(|_| self.bad(key, &format!("takes a whole number, not {v:?}")))
    }

    /// A size in MiB, at least 20 as PyTorch insists.
    fn megabytes(&mut self, key: &str) -> Result<u64, AllocatorError> {
        let mb = self.whole(key)?;
        if mb < K_LARGE_BUFFER / MB {
            return Err(self.bad(key, &format!("must be at least {}", K_LARGE_BUFFER / MB)));
        }
        Ok(mb.saturating_mul(MB))
    }

    fn boolean(&mut self, key: &str) -> Result<bool, AllocatorError> {
        match self.value(key)? {
            "True" => Ok(true),
            "False" => Ok(false),
            v => Err(self.bad(key, &format!("takes True or False, not {v:?}"))),
        }
    }

    fn skip_value(&mut self) {
        if self.peek() == Some("[") {
            while let Some(t) = self.next() {
                if t == "]" {
                    break;
                }
            }
        } else {
            self.next();
        }
    }

    /// `N` for every size class, or `[MB:N,...,>:N]` per class.
    fn divisions(&mut self, key: &str) -> Result<[u64; ROUNDUP_INTERVALS], AllocatorError> {
        let mut d = [0; ROUNDUP_INTERVALS];
        if self.peek() != Some("[") {
            let n = self.whole(key)?;
            if !n.is_power_of_two() {
                return Err(self.bad(key, "takes a power of two"));
            }
            return Ok([n; ROUNDUP_INTERVALS]);
        }
        self.next();
        let mut first = true;
        let mut last = 0;
        loop {
            let size = self.value(key)?;
            self.expect(":", key)?;
            let n = self.whole(key)?;
            if n != 0 && !n.is_power_of_two() {
                return Err(self.bad(key, "takes divisions that are powers of two, or 0"));
            }
            if size == ">" {
                d[last..].iter_mut().for_each(|x| *x = n);
            } else {
                let mb: u64 = size
                    .parse()
                    .ok()
                    .filter(|m: &u64| m.is_power_of_two())
                    .ok_or_else(|| {
                        self.bad(
                            key,
                            &format!("takes sizes in MiB that are powers of two, not {size:?}"),
                        )
                    })?;
                let i = ((63 - mb.leading_zeros()) as usize).min(ROUNDUP_INTERVALS - 1);
                if first {
                    d[..i].iter_mut().for_each(|x| *x = n);
                    first = false;
                }
                d[i] = n;
                last = i;
            }
            match self.next() {
                Some("]") => return Ok(d),
                Some(",") => {}
                _ => return Err(self.bad(key, "has a list that is not closed with ]")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_common_settings_parse() {
        let mut c = AllocatorConfig::default();
        c.apply("expandable_segments:True,max_split_size_mb:128")
            .unwrap();
        assert!(c.expandable_segments);
        assert_eq!(c.max_split_size, 128 << 20);
        c.apply(" garbage_collection_threshold : 0.6 ").unwrap();
        assert_eq!(c.garbage_collection_threshold, 0.6);
        c.apply("roundup_power2_divisions:4").unwrap();
        assert_eq!(c.roundup_power2_divisions, [4; 16]);
        c.apply("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
            .unwrap();
        // Classes below the first named one take its value, then each its
        // own; ">" fills from the last named class on, that class included,
        // as AllocatorConfig.cpp's std::fill does.
        assert_eq!(c.roundup_power2_divisions[..8], [1; 8]);
        assert_eq!(c.roundup_power2_divisions[8..11], [1, 2, 8]);
        assert_eq!(c.roundup_power2_divisions[11..], [8; 5]);
        assert_eq!(
            c.describe(),
            "expandable_segments:True,max_split_size_mb:128,garbage_collection_threshold:0.6,roundup_power2_divisions:[1:1,2:1,4:1,8:1,16:1,32:1,64:1,128:1,256:1,512:2,1024:8,2048:8,4096:8,8192:8,16384:8,32768:8]"
        );
        c.apply("release_lock_on_cudamalloc:True,pinned_num_register_threads:8,backend:native")
            .unwrap();
    }

    #[test]
    fn bad_settings_are_named() {
        let mut c = AllocatorConfig::default();
        for (conf, says) in [
            ("max_split_size_mb:10", "at least 20"),
            ("expandable_segments:yes", "True or False"),
            ("garbage_collection_threshold:1.5", "between 0 and 1"),
            ("roundup_power2_divisions:3", "power of two"),
            ("colour:blue", "unknown setting \"colour\""),
            ("expandable_segments", "needs \":\""),
            (
                "expandable_segments:True;max_split_size_mb:64",
                "True or False",
            ),
            ("backend:cudaMallocAsync", "driver's own pool"),
        ] {
            let e = c.apply(conf).unwrap_err().to_string();
            assert!(e.contains(says), "{conf}: {e}");
        }
    }

    #[test]
    fn recorded_settings_are_read() {
        let v: Value = serde_json::json!({
            "PYTORCH_CUDA_ALLOC_CONF": "max_non_split_rounding_mb:64",
            "max_split_size": -1,
            "garbage_collection_threshold": 0.0,
            "expandable_segments": true,
            "pinned_num_register_threads": 1,
            "roundup_power2_divisions": {"1": 0, "2": 4, "4": 0, "8": 0, "16": 0, "32": 0, "64": 0, "128": 0,
                "256": 0, "512": 0, "1024": 0, "2048": 0, "4096": 0, "8192": 0, "16384": 0, "32768": 2},
            "something_new": 3,
        });
        let (c, unknown) = AllocatorConfig::from_settings(&v);
        assert!(c.expandable_segments);
        assert_eq!(c.max_split_size, u64::MAX);
        assert_eq!(c.max_non_split_rounding, 64 << 20);
        assert_eq!(c.roundup_power2_divisions[1], 4);
        assert_eq!(c.roundup_power2_divisions[15], 2);
        assert_eq!(unknown, vec!["something_new".to_string()]);
    }
}
