//! Files a test writes with a Python script from the default model (hundreds of MB), written
//! once per machine and script version, and shared by every test process (nextest runs each
//! test in its own): a process that finds them ready reuses them; one that does not writes them
//! to a folder of its own and renames it into place, so no process reads a half-written file.
//!
//! The executor's tests include this file too (`#[path]`): the scripts are theirs
//! (`executor-svc/tests/executor/`), and the real-process tests use what they write.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

/// The folder `script` (in `executor-svc/tests/executor/`) writes when run as
/// `script SRC OUT args…` (`SRC` the default model), written now unless a process already did.
///
/// # Panics
///
/// If the script fails.
pub fn generated(tag: &str, script: &str, args: &[&str]) -> PathBuf {
    let scripts = Path::new(env!("CARGO_MANIFEST_DIR")).join("../executor-svc/tests/executor");
    let script = scripts.join(script);
    let src = ferry_model::fetch::default_model_path().expect("the default model");
    let mut h = std::hash::DefaultHasher::new();
    std::fs::read(&script).expect("the script").hash(&mut h);
    (args, &src).hash(&mut h);
    let dir = std::env::temp_dir().join(format!("ferry-{tag}-{:016x}", h.finish()));
    let done = |d: &Path| d.join("done").exists();
    if done(&dir) {
        return dir;
    }
    let tmp = dir.with_extension(std::process::id().to_string());
    let status = std::process::Command::new("python3")
        .arg(&script)
        .args([src.as_os_str(), tmp.as_os_str()])
        .args(args)
        .status()
        .expect("python3 runs");
    assert!(status.success(), "{} failed", script.display());
    std::fs::write(tmp.join("done"), b"").expect("the marker");
    if std::fs::rename(&tmp, &dir).is_err() {
        // Another process got there first.
        assert!(done(&dir), "{} could not be moved into place", tmp.display());
        std::fs::remove_dir_all(&tmp).ok();
    }
    dir
}
