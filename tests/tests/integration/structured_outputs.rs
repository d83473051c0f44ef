//! Structured outputs and tool calls as a client sees them: the real OpenAI client library (the Python
//! `openai` package, installed by the test command) against `ferry serve` — a `json_schema`
//! answer parses and validates for 20 seeds at temperature 1, streamed equals unstreamed,
//! `json_object`, vLLM's `guided_*` and `structured_outputs` fields hold, and bad constraints
//! are 400s that say why (`tests/python/structured_outputs.py`); `tool_choice` required and
//! named give calls that follow their tool's schema, streamed calls reassemble into the same
//! call, calls the model writes are read, history with calls and answers is rendered
//! (`tests/python/tool_calls.py`).

use std::process::Command;

use ferry_tests::Service;

/// Runs `script` (in `tests/python/`) against a fresh `ferry serve` and returns what it
/// printed; fails unless it succeeded and its last line is `last`.
fn client_checks(script: &str, last: &str) -> String {
    // vLLM's --host and --port in place of --http-listen.
    let args = [
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--kv-cache-mib",
        "64",
    ];
    let svc = Service::start("ferry", &args, 4).expect("starting ferry serve");
    let base = format!("http://{}/v1", svc.addr("http"));
    let script = format!("{}/python/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("python3").arg(script).arg(&base).output().expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the client's checks failed:\n{stdout}\n{stderr}");
    print!("{stdout}");
    assert!(stdout.trim_end().ends_with(last), "{stdout}");
    stdout
}

#[test]
fn structured_outputs_hold_through_the_openai_client() {
    let out = client_checks("structured_outputs.py", "structured outputs: ok");
    assert!(out.contains("json_schema: 20 of 20 valid"), "{out}");
}

#[test]
fn tool_calls_hold_through_the_openai_client() {
    let out = client_checks("tool_calls.py", "tool calls: ok");
    assert!(out.contains("required: 10 of 10 calls valid"), "{out}");
}
