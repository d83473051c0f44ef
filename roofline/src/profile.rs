//! Hardware and model profiles: data files (JSON) that name a GPU's rates and a model's shape,
//! turned into the roofline's [`SimHardware`] and [`SimModel`].
//!
//! The built-in profiles live in `roofline/profiles/{hardware,models}/*.json` and are compiled
//! in; users add their own with `--profile-dir DIR` (files in `DIR/hardware/` and
//! `DIR/models/`, or any `*.json` in `DIR` whose fields say which kind it is). A profile found
//! there replaces a built-in one of the same name.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use crate::hardware::SimHardware;
use crate::model_shape::SimModel;

const GIB: f64 = (1u64 << 30) as f64;

/// A GPU, as a profile file describes it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HardwareProfile {
    /// What `--hardware` names it by.
    pub name: String,
    /// What it is.
    #[serde(default)]
    pub description: String,
    /// Where the figures come from.
    #[serde(default)]
    pub source: String,
    /// Dense peak TFLOP/s by compute dtype (`bf16`, `fp16`, `fp8`, ...).
    pub tflops: BTreeMap<String, f64>,
    /// Memory bandwidth, GB/s.
    pub mem_bandwidth_gbps: f64,
    /// Memory, GiB.
    pub mem_gib: f64,
    /// GPU-to-GPU bandwidth per direction inside a node (`NVLink` or `PCIe`), GB/s.
    pub interconnect_gbps: f64,
    /// Node-to-node bandwidth per GPU, GB/s.
    pub network_gbps: f64,
    /// Fraction of peak FLOP/s that real matmuls reach.
    pub compute_efficiency: f64,
    /// Fraction of peak bandwidth that streaming reads reach.
    pub bandwidth_efficiency: f64,
    /// Fixed cost of a step, microseconds.
    pub overhead_us: f64,
    /// Fixed latency of one all-reduce, microseconds.
    pub allreduce_latency_us: f64,
}

/// A model's shape, as a profile file describes it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelProfile {
    /// What `--model-profile` names it by.
    pub name: String,
    /// What it is.
    #[serde(default)]
    pub description: String,
    /// Where the shape comes from.
    #[serde(default)]
    pub source: String,
    /// Transformer blocks.
    pub num_layers: u32,
    /// Residual stream width.
    pub hidden: u32,
    /// MLP width (of one expert, for a mixture of experts).
    pub intermediate: u32,
    /// Query heads.
    pub num_heads: u32,
    /// Key/value heads.
    pub num_kv_heads: u32,
    /// Width of one head.
    pub head_dim: u32,
    /// Vocabulary size.
    pub vocab_size: u32,
    /// Experts per layer (absent or 0: dense).
    #[serde(default)]
    pub num_experts: u32,
    /// Experts each token runs.
    #[serde(default)]
    pub experts_per_token: u32,
    /// Whether the LM head shares the embedding matrix.
    #[serde(default)]
    pub tie_embeddings: bool,
    /// Weights' dtype (`bf16`, `fp16`, `fp8`, `int4`); also the compute dtype, except that
    /// `int4` weights compute in bf16.
    pub weight_dtype: String,
    /// KV cache dtype (`bf16`, `fp16`, `fp8`).
    pub kv_dtype: String,
    /// GPUs one replica is sharded over by default (tensor parallelism).
    #[serde(default = "one")]
    pub tensor_parallel: u32,
}

fn one() -> u32 {
    1
}

/// A profile that cannot be used, saying why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProfileError {
    /// No profile of that name.
    #[error("no {kind} profile {name:?}; known: {known}")]
    Unknown {
        /// `hardware` or `model`.
        kind: &'static str,
        /// The name asked for.
        name: String,
        /// The names there are.
        known: String,
    },
    /// A file that does not parse.
    #[error("profile {path}: {error}")]
    Parse {
        /// The file.
        path: String,
        /// What is wrong.
        error: String,
    },
    /// A field out of range or a dtype the hardware lacks.
    #[error("profile {name}: {error}")]
    Invalid {
        /// The profile.
        name: String,
        /// What is wrong.
        error: String,
    },
}

/// Bytes of one element of `dtype`.
pub fn dtype_bytes(dtype: &str) -> Option<f64> {
    match dtype {
        "f32" | "fp32" => Some(4.0),
        "bf16" | "fp16" | "f16" => Some(2.0),
        "fp8" | "int8" => Some(1.0),
        // 4-bit codes with a bf16 scale per group of 128.
        "int4" => Some(0.5 + 2.0 / 128.0),
        _ => None,
    }
}

/// Every profile known: the built-in ones and those added from directories.
#[derive(Debug, Clone, Default)]
pub struct Profiles {
    /// GPUs by name.
    pub hardware: BTreeMap<String, HardwareProfile>,
    /// Models by name.
    pub models: BTreeMap<String, ModelProfile>,
}

const BUILT_IN_HARDWARE: &[(&str, &str)] = &[
    ("a100.json", include_str!("../profiles/hardware/a100.json")),
    ("h100.json", include_str!("../profiles/hardware/h100.json")),
    ("h200.json", include_str!("../profiles/hardware/h200.json")),
    ("l40s.json", include_str!("../profiles/hardware/l40s.json")),
    ("l4.json", include_str!("../profiles/hardware/l4.json")),
];

const BUILT_IN_MODELS: &[(&str, &str)] = &[
    ("llama-3-8b.json", include_str!("../profiles/models/llama-3-8b.json")),
    ("llama-3-8b-fp8.json", include_str!("../profiles/models/llama-3-8b-fp8.json")),
    ("llama-3-70b.json", include_str!("../profiles/models/llama-3-70b.json")),
    ("qwen2.5-7b.json", include_str!("../profiles/models/qwen2.5-7b.json")),
    ("mixtral-8x7b.json", include_str!("../profiles/models/mixtral-8x7b.json")),
    ("qwen3-30b-a3b.json", include_str!("../profiles/models/qwen3-30b-a3b.json")),
    ("smollm2-135m.json", include_str!("../profiles/models/smollm2-135m.json")),
];

fn parse<T: for<'de> Deserialize<'de>>(path: &str, text: &str) -> Result<T, ProfileError> {
    serde_json::from_str(text)
        .map_err(|e| ProfileError::Parse { path: path.to_string(), error: e.to_string() })
}

impl Profiles {
    /// The built-in profiles.
    pub fn built_in() -> Self {
        let mut p = Self::default();
        for (file, text) in BUILT_IN_HARDWARE {
            let h: HardwareProfile = parse(file, text).expect("built-in profiles parse");
            p.hardware.insert(h.name.clone(), h);
        }
        for (file, text) in BUILT_IN_MODELS {
            let m: ModelProfile = parse(file, text).expect("built-in profiles parse");
            p.models.insert(m.name.clone(), m);
        }
        p
    }

    /// Adds the profiles in `dir`: `hardware/*.json`, `models/*.json`, and any `*.json` in
    /// `dir` itself (a model if it has `num_layers`, else hardware).
    pub fn add_dir(&mut self, dir: &Path) -> Result<(), ProfileError> {
        let read_dir = |d: &Path| -> Result<Vec<std::path::PathBuf>, ProfileError> {
            let Ok(entries) = std::fs::read_dir(d) else { return Ok(Vec::new()) };
            let mut files: Vec<_> = entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "json"))
                .collect();
            files.sort();
            Ok(files)
        };
        if !dir.is_dir() {
            return Err(ProfileError::Parse {
                path: dir.display().to_string(),
                error: "not a directory".into(),
            });
        }
        let load = |path: &Path| -> Result<String, ProfileError> {
            std::fs::read_to_string(path).map_err(|e| ProfileError::Parse {
                path: path.display().to_string(),
                error: e.to_string(),
            })
        };
        for path in read_dir(&dir.join("hardware"))? {
            let h: HardwareProfile = parse(&path.display().to_string(), &load(&path)?)?;
            self.hardware.insert(h.name.clone(), h);
        }
        for path in read_dir(&dir.join("models"))? {
            let m: ModelProfile = parse(&path.display().to_string(), &load(&path)?)?;
            self.models.insert(m.name.clone(), m);
        }
        for path in read_dir(dir)? {
            let text = load(&path)?;
            let shown = path.display().to_string();
            if text.contains("\"num_layers\"") {
                let m: ModelProfile = parse(&shown, &text)?;
                self.models.insert(m.name.clone(), m);
            } else {
                let h: HardwareProfile = parse(&shown, &text)?;
                self.hardware.insert(h.name.clone(), h);
            }
        }
        Ok(())
    }

    /// The GPU named `name`.
    pub fn hardware(&self, name: &str) -> Result<&HardwareProfile, ProfileError> {
        self.hardware.get(name).ok_or_else(|| ProfileError::Unknown {
            kind: "hardware",
            name: name.to_string(),
            known: self.hardware.keys().cloned().collect::<Vec<_>>().join(", "),
        })
    }

    /// The model named `name`.
    pub fn model(&self, name: &str) -> Result<&ModelProfile, ProfileError> {
        self.models.get(name).ok_or_else(|| ProfileError::Unknown {
            kind: "model",
            name: name.to_string(),
            known: self.models.keys().cloned().collect::<Vec<_>>().join(", "),
        })
    }
}

impl ModelProfile {
    /// The dtype matmuls run in: the weights', except 4-bit weights, dequantized to bf16.
    pub fn compute_dtype(&self) -> &str {
        if self.weight_dtype == "int4" {
            "bf16"
        } else {
            &self.weight_dtype
        }
    }

    /// The roofline's view of this model.
    pub fn to_sim(&self) -> Result<SimModel, ProfileError> {
        let invalid = |error: String| ProfileError::Invalid { name: self.name.clone(), error };
        let weight = dtype_bytes(&self.weight_dtype)
            .ok_or_else(|| invalid(format!("unknown weight_dtype {:?}", self.weight_dtype)))?;
        let kv = dtype_bytes(&self.kv_dtype)
            .filter(|b| b.fract() == 0.0)
            .ok_or_else(|| invalid(format!("unknown kv_dtype {:?}", self.kv_dtype)))?;
        let mut model = SimModel {
            num_layers: self.num_layers,
            hidden: self.hidden,
            intermediate: self.intermediate,
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            vocab_size: self.vocab_size,
            weight_bytes: 0,
            kv_bytes_per_elem: kv as u32,
            num_experts: self.num_experts,
            experts_per_token: self.experts_per_token,
        };
        model.validate().map_err(|e| invalid(e.to_string()))?;
        model.set_weight_bytes(weight, self.tie_embeddings);
        Ok(model)
    }
}

impl HardwareProfile {
    /// The roofline's view of this GPU computing in `dtype`, `tensor_parallel` of them per
    /// replica.
    pub fn to_sim(&self, dtype: &str, tensor_parallel: u32) -> Result<SimHardware, ProfileError> {
        let invalid = |error: String| ProfileError::Invalid { name: self.name.clone(), error };
        let tflops = *self.tflops.get(dtype).ok_or_else(|| {
            let have = self.tflops.keys().cloned().collect::<Vec<_>>().join(", ");
            invalid(format!("no {dtype} compute rate (it lists {have})"))
        })?;
        let hw = SimHardware {
            tflops,
            mem_bandwidth_gbps: self.mem_bandwidth_gbps,
            mem_bytes: (self.mem_gib * GIB) as u64,
            tensor_parallel,
            compute_efficiency: self.compute_efficiency,
            bandwidth_efficiency: self.bandwidth_efficiency,
            overhead_us: self.overhead_us,
            interconnect_gbps: self.interconnect_gbps,
            allreduce_latency_us: self.allreduce_latency_us,
            network_gbps: self.network_gbps,
        };
        hw.validate().map_err(|e| invalid(e.to_string()))?;
        Ok(hw)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_in_profiles_load_and_convert() {
        let p = Profiles::built_in();
        for name in ["h100", "h200", "a100", "l40s", "l4"] {
            let h = p.hardware(name).unwrap();
            h.to_sim("bf16", 1).unwrap();
        }
        for m in p.models.values() {
            let sim = m.to_sim().unwrap();
            let hw = p.hardware("h100").unwrap().to_sim(m.compute_dtype(), m.tensor_parallel);
            hw.unwrap();
            assert!(sim.weight_bytes > 0, "{}", m.name);
        }
        // Parameter counts as published, within 2 % (bf16: two bytes each).
        for (name, params) in [
            ("llama-3-8b", 8.03e9),
            ("llama-3-8b-fp8", 4.015e9),
            ("llama-3-70b", 70.6e9),
            ("qwen2.5-7b", 7.62e9),
            ("mixtral-8x7b", 46.7e9),
            ("qwen3-30b-a3b", 30.5e9),
            ("smollm2-135m", 0.135e9),
        ] {
            let bytes = p.model(name).unwrap().to_sim().unwrap().weight_bytes as f64;
            let ratio = bytes / 2.0 / params;
            assert!((0.98..1.02).contains(&ratio), "{name}: {ratio}");
        }
        let err = p.hardware("tpu").unwrap_err().to_string();
        assert!(err.contains("h100") && err.contains("tpu"), "{err}");
        let err = p.hardware("a100").unwrap().to_sim("fp8", 1).unwrap_err().to_string();
        assert!(err.contains("no fp8 compute rate"), "{err}");
    }

    #[test]
    fn a_directory_adds_and_replaces_profiles() {
        let dir = std::env::temp_dir().join(format!("ferry-sim-profiles-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("models")).unwrap();
        let tiny = r#"{"name": "tiny", "num_layers": 2, "hidden": 64, "intermediate": 128,
            "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "vocab_size": 100,
            "weight_dtype": "fp8", "kv_dtype": "fp8"}"#;
        std::fs::write(dir.join("models/tiny.json"), tiny).unwrap();
        let mut h100 = Profiles::built_in().hardware("h100").unwrap().clone();
        h100.mem_gib = 94.0;
        let text = format!(
            r#"{{"name": "h100", "tflops": {{"bf16": 1.0}}, "mem_bandwidth_gbps": 1,
            "mem_gib": {}, "interconnect_gbps": 1, "network_gbps": 1, "compute_efficiency": 1,
            "bandwidth_efficiency": 1, "overhead_us": 0, "allreduce_latency_us": 0}}"#,
            h100.mem_gib
        );
        std::fs::write(dir.join("h100-nvl.json"), text).unwrap();
        let mut p = Profiles::built_in();
        p.add_dir(&dir).unwrap();
        assert_eq!(p.model("tiny").unwrap().tensor_parallel, 1);
        assert_eq!(p.model("tiny").unwrap().to_sim().unwrap().kv_bytes_per_elem, 1);
        assert!((p.hardware("h100").unwrap().mem_gib - 94.0).abs() < 1e-9, "replaced");
        std::fs::write(dir.join("models/bad.json"), r#"{"name": "bad", "layers": 2}"#).unwrap();
        let err = Profiles::built_in().add_dir(&dir).unwrap_err().to_string();
        assert!(err.contains("bad.json"), "{err}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
