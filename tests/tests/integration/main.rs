//! Ferry's cross-service integration and fault tests, one module per area, in one test binary:
//! each integration test file used to be a binary of its own, and every one linked the whole
//! workspace (the bench, the executor with candle, the scheduler) — linking them was minutes
//! of a CI run. cargo-nextest still runs every test in a process of its own, so a test's
//! process-wide state (its own TLS set, environment) stays its own; the two files that set
//! such state for the whole process (`tls.rs`, `tracing.rs`) stay binaries of their own, for
//! runners that put a binary's tests in one process.
//!
//! Filter by module: `scripts/test -E 'test(/^cluster::/)'`.

mod api_keys;
mod chaos;
mod cluster;
mod cuda_serve;
mod disaggregation;
mod dp_groups;
mod executor_session;
mod fuzz;
mod grpc_surface;
mod helm_chart;
mod kv_agent;
mod kv_tier;
mod limits;
mod looped;
mod lora;
mod model_fetch;
mod model_formats;
mod multi_model;
mod observability;
mod parallel_sampling;
mod readme_cluster;
mod serve_generation;
mod shards;
mod sim_cluster;
mod speculative;
mod structure;
mod structured_outputs;
mod warm_failover;
