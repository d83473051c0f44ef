//! `ferry serve --backend cuda` as a user starts it, on a machine without a GPU: the binary's
//! dynamic loader finds the CPU emulation of CUDA (`ferry_executor_svc::engine::cuda_emulation`,
//! first on `LD_LIBRARY_PATH`) in place of the driver, NVRTC and cuBLAS. It sizes its KV cache
//! from the (emulated) device's free memory, answers a chat with the same greedy tokens as the
//! CPU backend (through a LoRA adapter too), and holds structured-output constraints; the
//! emulation's own counters show that the device did the work. With `FERRY_CUDA_TESTS=gpu` the same runs on the real GPU.

use std::ffi::OsString;
use std::time::Duration;

use ferry_executor_svc::engine::cuda_emulation::TestDevice;
use ferry_tests::{http, Service, TempDir};
use serde_json::{json, Value};

/// POSTs a chat request at temperature 0 to `svc`; the answer's text.
fn chat(svc: &Service, extra: &Value) -> String {
    let mut body = json!({
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 12,
        "temperature": 0,
    });
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    let (status, text) =
        http(svc.addr("http"), "POST", "/v1/chat/completions", body.to_string().as_bytes())
            .expect("the chat request");
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).expect("a JSON answer");
    answer["choices"][0]["message"]["content"].as_str().expect("content").to_string()
}

/// The emulation's counters as the emulated driver wrote them at its last synchronisation.
fn counters(path: &std::path::Path) -> Vec<(String, u64)> {
    let text = std::fs::read_to_string(path).expect("the emulation's statistics file");
    text.lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(k, v)| (k.to_string(), v.parse().expect("a count")))
        .collect()
}

#[test]
fn serve_with_the_cuda_backend_answers_like_the_cpu_and_holds_constraints() {
    let device = TestDevice::from_env();
    let stats_dir = TempDir::new("cuda-serve").unwrap();
    let stats = stats_dir.0.join("emulation-stats");
    let mut env: Vec<(&str, OsString)> = Vec::new();
    if let TestDevice::Skip = device {
        return;
    }
    if let TestDevice::Emulated(emulation) = &device {
        let mut path = emulation.library_dir().as_os_str().to_owned();
        if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
            path.push(":");
            path.push(old);
        }
        env.push(("LD_LIBRARY_PATH", path));
        env.push(("FERRY_CUDA_EMU_STATS", stats.clone().into_os_string()));
        // A 4 GiB device: half of it for this executor, the KV cache what the weights (f32)
        // and a step's activations leave.
        env.push(("FERRY_CUDA_EMU_MEMORY_MIB", "4096".into()));
    }
    let env: Vec<(&str, &std::ffi::OsStr)> = env.iter().map(|(k, v)| (*k, v.as_os_str())).collect();
    // A LoRA adapter for SmolLM2's shape (the one the LoRA tests write), on both backends.
    let x = ferry_tests::generated::generated("lora", "lora_adapters.py", &[]).join("x");
    let x = format!("x={}", x.display());
    let listen =
        ["serve", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--enable-lora"];
    let listen = [&listen[..], &["--lora-modules", &x]].concat();
    let cuda_args =
        [&listen[..], &["--backend", "cuda", "--gpu-memory-utilization", "0.5"]].concat();
    let mut cuda =
        Service::start_with_env("ferry", &cuda_args, &env, 4).expect("ferry serve (cuda)");
    let cpu_args = [&listen[..], &["--kv-cache-mib", "64", "--kv-cache-dtype", "f32"]].concat();
    let mut cpu = Service::start("ferry", &cpu_args, 4).expect("ferry serve (cpu)");

    let on_cuda = chat(&cuda, &json!({}));
    assert!(!on_cuda.trim().is_empty(), "an answer");
    assert_eq!(on_cuda, chat(&cpu, &json!({})), "greedy answers equal on both backends");
    // The adapter runs on the GPU as on the CPU, and changes the answer.
    let through_x = chat(&cuda, &json!({"model": "x"}));
    assert_eq!(through_x, chat(&cpu, &json!({"model": "x"})), "adapter x on both backends");
    assert_ne!(through_x, on_cuda, "adapter x changes the answer");
    let city = chat(&cuda, &json!({"guided_choice": ["London", "Paris", "Rome"]}));
    assert!(["London", "Paris", "Rome"].contains(&city.as_str()), "{city:?}");
    let schema = json!({
        "type": "object",
        "properties": {"capital": {"enum": ["Paris", "Rome", "Berlin"]}},
        "required": ["capital"],
        "additionalProperties": false,
    });
    let format = json!({"response_format": {
        "type": "json_schema",
        "json_schema": {"name": "capital", "schema": schema},
    }, "max_tokens": 24});
    let answer = chat(&cuda, &format);
    let parsed: Value = serde_json::from_str(&answer).unwrap_or_else(|e| panic!("{answer:?}: {e}"));
    let capital = parsed["capital"].as_str().unwrap_or_else(|| panic!("{parsed}"));
    assert!(["Paris", "Rome", "Berlin"].contains(&capital), "{parsed}");

    if let TestDevice::Emulated(_) = device {
        let counts = counters(&stats);
        let count = |k: &str| counts.iter().find(|(n, _)| n == k).map_or(0, |(_, v)| *v);
        // Every step runs 30 layers of four products and attention on the device.
        assert!(count("gemms") >= 4 * 30 && count("launches") >= 6 * 30, "{counts:?}");
        assert_eq!(count("modules_loaded"), 1, "{counts:?}");
    }
    cuda.terminate(Duration::from_secs(10)).unwrap();
    cpu.terminate(Duration::from_secs(10)).unwrap();
}

#[test]
fn the_gpu_bench_measures_a_synthetic_model_against_the_roofline() {
    // What scripts/gpu-check runs on a GPU, here on SmolLM2's shape under the emulation.
    let emulation = match TestDevice::from_env() {
        TestDevice::Emulated(e) => e,
        TestDevice::Gpu => {
            return eprintln!("skipped: scripts/gpu-check runs the bench on the GPU")
        }
        TestDevice::Skip => return,
    };
    let bin = ferry_tests::binary("ferry-executor").expect("the executor binary");
    let out = std::process::Command::new(bin)
        .args(["gpu-bench", "--shape", "smollm2", "--formats", "q8_0", "--batches", "1,2"])
        .args(["--steps", "1", "--context", "4", "--prefill-len", "8", "--prefill-reps", "1"])
        .args(["--gpu-memory-utilization", "0.5"])
        .env("LD_LIBRARY_PATH", emulation.library_dir())
        .env("FERRY_CUDA_EMU_MEMORY_MIB", "2048")
        .output()
        .expect("ferry-executor gpu-bench runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        stdout.contains("q8_0 weights as float16") && stdout.contains("on Ferry CUDA emulation")
    );
    assert!(stdout.contains("prefill     8 tokens:"), "{stdout}");
    for batch in ["decode batch    1:", "decode batch    2:"] {
        let line = stdout.lines().find(|l| l.contains(batch)).unwrap_or_else(|| panic!("{stdout}"));
        assert!(line.contains("tokens/s (roofline"), "{line}");
    }
}
