//! The scheduling core's behaviour, tested through its public API in one test binary: the
//! rules one by one (`*_rules`: scheduling, lifecycle, parallel-sampling forks, speculation),
//! seeded random workloads checked against every invariant after every step (`workloads`), and
//! proptest-generated workloads that shrink a failure to a small case (`shrinking`). `common`
//! is their shared harness: a simulated executor and request builders.

mod common;
mod fork_rules;
mod lifecycle_rules;
mod looped_rules;
mod lora_rules;
mod scheduling_rules;
mod shrinking;
mod speculation_rules;
mod workloads;
