//! A model's `config.json` named as `estimate --config` takes it: a file, a model folder, or a
//! Hugging Face hub id, whose config alone is read from the hub's cache or fetched (never its weights).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The file every model folder and hub repository keeps its architecture in.
const CONFIG_FILE: &str = "config.json";

/// The longest part of a hub id (an owner or a repository name) the hub accepts.
const MAX_ID_PART: usize = 96;

/// Values of `HF_HUB_OFFLINE` that switch the hub off, as `huggingface_hub` reads them.
const TRUE_VALUES: [&str; 4] = ["1", "on", "yes", "true"];

/// Fetches one file of a repository through the user's `huggingface_hub` (its cache, token and
/// offline mode) and prints `ok<TAB>path`, or `error<TAB>why` in one line.
const FETCH_CONFIG: &str = r#"
import sys
try:
    from huggingface_hub import hf_hub_download
    try:
        from huggingface_hub.errors import EntryNotFoundError, GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError:
        from huggingface_hub.utils import EntryNotFoundError, GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError
except ImportError:
    print("error\thuggingface_hub is not installed for this Python (pip install huggingface_hub), so a hub id cannot be fetched")
    sys.exit(0)
repo = sys.argv[1]
try:
    print("ok\t" + hf_hub_download(repo, "config.json"))
except GatedRepoError:
    print("error\tthe repository is gated: accept its terms on the hub and log in (hf auth login), or give a folder holding its config.json")
except RepositoryNotFoundError:
    print("error\tno such repository on the hub (or it is private and no token that can read it is set)")
except LocalEntryNotFoundError:  # (an EntryNotFoundError too: asked first)
    print("error\tnot in the hub's cache, and the hub cannot be reached (offline?)")
except EntryNotFoundError:
    print("error\tthe repository has no config.json")
except Exception as e:
    print("error\t" + (" ".join(str(e).split()) or type(e).__name__))
"#;

/// The `config.json` that `arg` names: the file itself, a folder's own, or a hub id's from the
/// cache (fetched, config alone, where the cache lacks it and the hub is not switched off).
pub(crate) fn config_file(arg: &Path, python: &std::ffi::OsStr) -> Result<PathBuf, String> {
    let shown = arg.display();
    if arg.is_file() {
        return Ok(arg.to_path_buf());
    }
    if arg.is_dir() {
        let file = arg.join(CONFIG_FILE);
        return if file.is_file() {
            Ok(file)
        } else {
            Err(format!(
                "{shown}: a model folder needs a {CONFIG_FILE}, and this one has none"
            ))
        };
    }
    let id = arg
        .to_str()
        .filter(|s| is_hub_id(s))
        .ok_or_else(|| format!("{shown}: no such file or folder, and not a hub id (owner/name)"))?;
    let cache = hub_cache(&|k| std::env::var(k).ok());
    if let Some(file) = cached_config(&cache, id) {
        return Ok(file);
    }
    let offline = std::env::var("HF_HUB_OFFLINE")
        .map(|v| TRUE_VALUES.contains(&v.trim().to_ascii_lowercase().as_str()))
        .unwrap_or(false);
    if offline {
        return Err(format!(
            "{id}: not in the hub's cache ({}), and HF_HUB_OFFLINE is set: nothing is fetched",
            cache.display()
        ));
    }
    fetched_config(id, python)
}

/// Whether `s` reads as a hub repository id: `name` or `owner/name`, of the hub's characters
/// (a name ending in `.json` is a config file that is not there, not a repository).
fn is_hub_id(s: &str) -> bool {
    let parts: Vec<&str> = s.split('/').collect();
    !s.ends_with(".json")
        && parts.len() <= 2
        && parts.iter().all(|p| {
            !p.is_empty()
                && p.len() <= MAX_ID_PART
                && !p.contains("..")
                && p.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        })
}

/// The hub's cache folder, as `huggingface_hub` finds it: `HF_HUB_CACHE`, else `HF_HOME/hub`,
/// else `XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`.
fn hub_cache(var: &dyn Fn(&str) -> Option<String>) -> PathBuf {
    let set = |k: &str| var(k).filter(|v| !v.is_empty());
    if let Some(dir) = set("HF_HUB_CACHE").or_else(|| set("HUGGINGFACE_HUB_CACHE")) {
        return PathBuf::from(dir);
    }
    let home = set("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
        let cache = set("XDG_CACHE_HOME").map(PathBuf::from).unwrap_or_else(|| {
            PathBuf::from(set("HOME").unwrap_or_else(|| ".".to_string())).join(".cache")
        });
        cache.join("huggingface")
    });
    home.join("hub")
}

/// A hub id's `config.json` in the cache, at the revision `main` points to, if it is there.
fn cached_config(cache: &Path, id: &str) -> Option<PathBuf> {
    let repo = cache.join(format!("models--{}", id.replace('/', "--")));
    let revision = std::fs::read_to_string(repo.join("refs").join("main")).ok()?;
    let revision = revision.trim();
    if revision.is_empty() || !revision.chars().all(|c| c.is_ascii_alphanumeric()) {
        return None;
    }
    let file = repo.join("snapshots").join(revision).join(CONFIG_FILE);
    file.is_file().then_some(file)
}

/// A hub id's `config.json`, fetched by the user's `huggingface_hub`, or one line saying why not.
fn fetched_config(id: &str, python: &std::ffi::OsStr) -> Result<PathBuf, String> {
    let out = Command::new(python)
        .args(["-c", FETCH_CONFIG, id])
        .output()
        .map_err(|e| {
            format!(
                "{id}: cannot run {} to fetch its config: {e}",
                python.to_string_lossy()
            )
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with("ok\t") || l.starts_with("error\t"));
    match line.and_then(|l| l.split_once('\t')) {
        Some(("ok", path)) if Path::new(path).is_file() => Ok(PathBuf::from(path)),
        Some(("error", why)) => Err(format!("{id}: {why}")),
        _ => Err(format!(
            "{id}: {} could not fetch its config (is huggingface_hub installed for it? set OOMKIT_PYTHON)",
            python.to_string_lossy()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids_are_told_from_paths() {
        for id in [
            "meta-llama/Llama-3.1-8B",
            "gpt2",
            "Qwen/Qwen2.5-0.5B-Instruct",
            "a_b/c.d",
        ] {
            assert!(is_hub_id(id), "{id}");
        }
        for not in [
            "",
            "/abs/path",
            "a/b/c",
            "../x",
            "a/..b",
            "-x/y",
            "a /b",
            "a/",
        ] {
            assert!(!is_hub_id(not), "{not}");
        }
    }

    #[test]
    fn the_cache_is_found_as_huggingface_hub_finds_it() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(
            hub_cache(&env(&[("HF_HUB_CACHE", "/c"), ("HF_HOME", "/h")])),
            PathBuf::from("/c")
        );
        assert_eq!(
            hub_cache(&env(&[("HF_HOME", "/h")])),
            PathBuf::from("/h/hub")
        );
        assert_eq!(
            hub_cache(&env(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/u")])),
            PathBuf::from("/x/huggingface/hub")
        );
        assert_eq!(
            hub_cache(&env(&[("HOME", "/u")])),
            PathBuf::from("/u/.cache/huggingface/hub")
        );
    }

    #[test]
    fn a_cached_config_is_read_at_the_revision_main_names() {
        let dir = std::env::temp_dir().join(format!("oomkit-hub-test-{}", std::process::id()));
        let repo = dir.join("models--org--tiny");
        let snapshot = repo.join("snapshots").join("abc123");
        std::fs::create_dir_all(&snapshot).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        assert_eq!(cached_config(&dir, "org/tiny"), None, "no ref yet");
        std::fs::write(repo.join("refs").join("main"), "abc123\n").unwrap();
        assert_eq!(cached_config(&dir, "org/tiny"), None, "no config yet");
        std::fs::write(snapshot.join(CONFIG_FILE), "{}").unwrap();
        assert_eq!(
            cached_config(&dir, "org/tiny"),
            Some(snapshot.join(CONFIG_FILE))
        );
        assert_eq!(cached_config(&dir, "org/other"), None);
        std::fs::write(repo.join("refs").join("main"), "../../x").unwrap();
        assert_eq!(
            cached_config(&dir, "org/tiny"),
            None,
            "a ref that is not a revision"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
