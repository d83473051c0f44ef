//! How many KV blocks a simulated GPU holds: its memory, capped at the utilisation vLLM caps
//! it at, less its shard of the weights and an activation workspace for a full step.
//!
//! Invariant: never panics and never overflows; a configuration with no room (weights that do
//! not fit, a zero block size, a NaN utilisation) holds 0 blocks.

use crate::hardware::SimHardware;
use crate::model_shape::SimModel;

/// KV cache blocks of `block_size` tokens that fit in each GPU's memory, capped at
/// `gpu_memory_utilization` (clamped to [0, 1]) as vLLM caps it, after the GPU's shard of the
/// weights and `activation_bytes` of workspace per GPU (see [`activation_bytes`]). Every GPU of
/// a TP group holds its shard of every block, so this is also the group's block count.
pub fn kv_capacity_blocks(
    hw: &SimHardware,
    model: &SimModel,
    block_size: u32,
    gpu_memory_utilization: f64,
    activation_bytes: u64,
) -> u64 {
    let tp = hw.tp();
    let utilization =
        if gpu_memory_utilization.is_nan() { 0.0 } else { gpu_memory_utilization.clamp(0.0, 1.0) };
    let free = hw.mem_bytes as f64 * utilization
        - model.weight_bytes as f64 / tp
        - activation_bytes as f64;
    let block_bytes = f64::from(block_size) * model.kv_bytes_per_token() as f64 / tp;
    if free <= 0.0 || block_bytes <= 0.0 {
        return 0;
    }
    (free / block_bytes).floor() as u64
}

/// Peak activation workspace per GPU of a step of `max_batched_tokens` tokens and `max_seqs`
/// sampled rows, as vLLM's memory profiling run finds it, roughly: the widest intermediates
/// of one layer alive at once in bf16 (the residual stream and its normalised copy, Q/K/V,
/// the attention output, the MLP's gate and up halves: activations are not kept across
/// layers), sharded over the TP group, plus f32 logits for every sampled row.
pub fn activation_bytes(
    model: &SimModel,
    tensor_parallel: u32,
    max_batched_tokens: u32,
    max_seqs: u32,
) -> u64 {
    let tp = f64::from(tensor_parallel.max(1));
    let hidden = f64::from(model.hidden);
    let q = f64::from(model.num_heads) * f64::from(model.head_dim);
    let kv = f64::from(model.num_kv_heads) * f64::from(model.head_dim);
    let experts = if model.is_moe() { f64::from(model.experts_per_token) } else { 1.0 };
    let mlp = 2.0 * f64::from(model.intermediate) * experts;
    let per_token = (2.0 * hidden + (q + 2.0 * kv + q) / tp + mlp / tp) * 2.0;
    let logits = f64::from(max_seqs) * f64::from(model.vocab_size) * 4.0 / tp;
    (f64::from(max_batched_tokens) * per_token + logits) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::Profiles;

    #[test]
    fn kv_capacity_is_sane() {
        let (hw, model) = (SimHardware::h100_80g(), SimModel::llama2_7b());
        // 7B bf16: 13.5 GB of weights, 512 KiB of KV per token, 8 MiB per 16-token block.
        assert_eq!(model.kv_bytes_per_token(), 512 * 1024);
        assert!((13.0e9..14.0e9).contains(&(model.weight_bytes as f64)), "{}", model.weight_bytes);
        let blocks = kv_capacity_blocks(&hw, &model, 16, 0.9, 0);
        assert!((7000..8500).contains(&blocks), "{blocks}");
        assert!(kv_capacity_blocks(&hw, &model, 16, 0.5, 0) < blocks);
        assert!(kv_capacity_blocks(&hw, &model, 32, 0.9, 0) <= blocks / 2);
        // A shard of the weights frees room: two GPUs hold more than twice the blocks.
        assert!(kv_capacity_blocks(&hw.with_tensor_parallel(2), &model, 16, 0.9, 0) > 2 * blocks);
        // 70B-sized weights do not fit one L4; nonsense inputs give zero.
        let huge = SimModel { weight_bytes: 140_000_000_000, ..model };
        assert_eq!(kv_capacity_blocks(&SimHardware::l4(), &huge, 16, 0.9, 0), 0);
        assert_eq!(kv_capacity_blocks(&hw, &model, 0, 0.9, 0), 0);
        assert_eq!(kv_capacity_blocks(&hw, &model, 16, f64::NAN, 0), 0);
        assert_eq!(
            kv_capacity_blocks(&hw, &model, 16, 7.0, 0),
            kv_capacity_blocks(&hw, &model, 16, 1.0, 0)
        );
    }

    #[test]
    fn kv_capacity_leaves_room_for_activations() {
        let p = Profiles::built_in();
        let model = p.model("llama-3-8b").unwrap().to_sim().unwrap();
        let hw = p.hardware("h100").unwrap().to_sim("bf16", 1).unwrap();
        let act = activation_bytes(&model, 1, 8192, 256);
        // 8192 tokens x (2 x 4096 + 4096 + 2 x 1024 + 4096 + 2 x 14336) x 2 bytes
        // + 256 x 128256 x 4 bytes of logits.
        assert_eq!(act, 8192 * (8192 + 4096 + 2048 + 4096 + 28_672) * 2 + 256 * 128_256 * 4);
        let with = kv_capacity_blocks(&hw, &model, 16, 0.9, act);
        let without = kv_capacity_blocks(&hw, &model, 16, 0.9, 0);
        assert_eq!(without - with, (act as f64 / (16.0 * 131_072.0)).ceil() as u64);
    }
}
