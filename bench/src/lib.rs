//! Ferry's benchmarks, out of the services: `ferry-bench core` measures the scheduling core's
//! cost per step; `ferry-bench serve` loads any OpenAI-compatible server (or, with
//! `--in-process`, the core and the CPU engine with no service around them, the baseline for
//! the service path's cost); `ferry-bench kv` moves KV blocks between agents against plain TCP;
//! `ferry-bench spec` compares speculative decoding on and off; `ferry-bench control-plane` measures
//! the scheduler process's CPU per streamed token and per request over simulated executors.
//! The model's own forward is `ferry-executor bench`.
//!
//! Its HTTP client ([`http_client`]) is also the one the integration tests use.

pub mod control_plane;
pub mod http_client;
pub mod kv_transfer;
pub mod loadgen;
pub mod scheduler_core;
pub mod speculation;
