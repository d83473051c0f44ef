//! The LoRA adapters an executor holds: read on a request's first use (its `NewRequest` names
//! the adapter and where it is), kept up to `--max-loras`, and evicted least recently used
//! first, never one a live request uses. A request whose adapter cannot be read, does not fit
//! the model, or finds every resident adapter in use is refused alone, with why.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use ferry_model::lora::{self, LoraAdapter, DEFAULT_MAX_LORA_RANK};
use ferry_model::LlamaShape;
use ferry_proto::v1;

/// `--max-loras` and `--max-lora-rank` (vLLM's names).
#[derive(Clone, Copy, Debug, Args)]
pub struct LoraArgs {
    /// Most LoRA adapters held at once; past it the least recently used adapter no live request
    /// uses is dropped.
    #[arg(long, env = "FERRY_MAX_LORAS", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub max_loras: u32,
    /// Largest adapter rank accepted.
    #[arg(long, env = "FERRY_MAX_LORA_RANK", default_value_t = DEFAULT_MAX_LORA_RANK as u32)]
    pub max_lora_rank: u32,
}

/// One resident adapter.
#[derive(Debug)]
struct Resident {
    name: String,
    path: String,
    adapter: Arc<LoraAdapter>,
    last_used: u64,
}

/// The adapters held, and how to read more.
#[derive(Debug)]
pub struct Adapters {
    args: LoraArgs,
    shape: LlamaShape,
    /// Where a relative path is looked up: the model file's folder.
    base_dir: Option<PathBuf>,
    resident: Vec<Resident>,
    clock: u64,
    /// Adapters read so far, and dropped to make room.
    pub loads: u64,
    /// Adapters dropped to make room.
    pub evictions: u64,
}

/// Whether resident adapter `a` is held by no live request but those in `releasing`.
fn is_free(a: &Arc<LoraAdapter>, releasing: &[*const LoraAdapter]) -> bool {
    let going = releasing.iter().filter(|&&p| std::ptr::eq(p, Arc::as_ptr(a))).count();
    Arc::strong_count(a) == 1 + going
}

impl Adapters {
    /// No adapters yet, for a model of `shape` whose file is in `base_dir`.
    #[must_use]
    pub fn new(args: LoraArgs, shape: LlamaShape, base_dir: Option<PathBuf>) -> Self {
        Self { args, shape, base_dir, resident: Vec::new(), clock: 0, loads: 0, evictions: 0 }
    }

    /// Names of the resident adapters, most recently used first.
    #[must_use]
    pub fn resident(&self) -> Vec<String> {
        let mut r: Vec<_> = self.resident.iter().map(|r| (r.last_used, r.name.clone())).collect();
        r.sort_by_key(|e| std::cmp::Reverse(e.0));
        r.into_iter().map(|(_, n)| n).collect()
    }

    /// The adapter `want` names, read from its path unless held (under that name and path).
    ///
    /// # Errors
    ///
    /// Why it cannot be used: unreadable, unfit for the model, or no room (every resident
    /// adapter in use by a live request). An adapter is free once only requests in
    /// `releasing` (one entry per such request: those the step finishes) hold it.
    pub fn acquire(
        &mut self,
        want: &v1::LoraAdapterRef,
        releasing: &[*const LoraAdapter],
    ) -> Result<Arc<LoraAdapter>, String> {
        self.clock += 1;
        if let Some(r) = self.resident.iter_mut().find(|r| r.name == want.name) {
            if r.path == want.path {
                r.last_used = self.clock;
                return Ok(r.adapter.clone());
            }
            // The same name at a new path (reloaded under its name): the old one goes once free.
            if !is_free(&r.adapter, releasing) {
                return Err(format!(
                    "LoRA adapter {} is in use at {} and was asked for at {}",
                    want.name, r.path, want.path
                ));
            }
            self.resident.retain(|r| r.name != want.name);
        }
        if want.name.is_empty() || want.path.is_empty() {
            return Err("a LoRA adapter needs a name and a path".into());
        }
        let path = lora::resolve(self.base_dir.as_deref(), &want.path);
        let max_rank = self.args.max_lora_rank as usize;
        let adapter =
            Arc::new(lora::load(&path, &self.shape, max_rank).map_err(|e| e.to_string())?);
        self.make_room(releasing)?;
        self.loads += 1;
        self.resident.push(Resident {
            name: want.name.clone(),
            path: want.path.clone(),
            adapter: adapter.clone(),
            last_used: self.clock,
        });
        tracing::info!(adapter = %want.name, path = %path.display(), rank = adapter.rank(), "LoRA adapter loaded");
        Ok(adapter)
    }

    /// Drops least recently used free adapters until one more fits (free: held by no live
    /// request but those in `releasing`).
    fn make_room(&mut self, releasing: &[*const LoraAdapter]) -> Result<(), String> {
        while self.resident.len() >= self.args.max_loras as usize {
            let free = self
                .resident
                .iter()
                .enumerate()
                .filter(|(_, r)| is_free(&r.adapter, releasing))
                .min_by_key(|(_, r)| r.last_used)
                .map(|(i, _)| i);
            let Some(i) = free else {
                return Err(format!(
                    "--max-loras {}: every resident LoRA adapter is in use by a live request",
                    self.args.max_loras
                ));
            };
            let gone = self.resident.remove(i);
            self.evictions += 1;
            tracing::info!(adapter = %gone.name, "LoRA adapter dropped (least recently used)");
        }
        Ok(())
    }
}
