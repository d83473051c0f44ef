//! An exact forward of the GGUF model, independent of the executor's kernels: every tensor
//! dequantized by candle (`d·q + m`, exact in f32), plain loops with f64 sums, one sequence,
//! a contiguous cache. Slow (about 0.1 s a token on two cores) and obviously right: the
//! yardstick the production forward's numbers are held to.
//!
//! Conventions are the file format's (llama.cpp's Llama): Q and K rows are stored for rotary
//! embedding of adjacent pairs, `θ_i = pos · base^(-2i/head_dim)`; tied output embeddings when
//! the file has no `output.weight`.

use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::Device;
use ferry_model::LlamaShape;
use rayon::prelude::*;

/// A row-major f32 matrix `[rows, cols]`.
struct Matrix {
    data: Vec<f32>,
    cols: usize,
}

impl Matrix {
    /// `self · x`, each output an f64 sum.
    fn mul(&self, x: &[f64]) -> Vec<f64> {
        assert_eq!(x.len(), self.cols);
        self.data
            .par_chunks(self.cols)
            .map(|row| row.iter().zip(x).map(|(&w, &v)| f64::from(w) * v).sum())
            .collect()
    }

    fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    q: Matrix,
    k: Matrix,
    v: Matrix,
    o: Matrix,
    ffn_norm: Vec<f32>,
    gate: Matrix,
    up: Matrix,
    down: Matrix,
}

/// The model, dequantized.
pub struct Model {
    shape: LlamaShape,
    embed: Matrix,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    /// `None`: tied to `embed`.
    output: Option<Matrix>,
}

/// Keys and values of every position so far, per layer.
#[derive(Default)]
pub struct Cache {
    keys: Vec<Vec<Vec<f64>>>,
    values: Vec<Vec<Vec<f64>>>,
}

impl Model {
    /// Reads the model at `path` (whose shape is `shape`).
    pub fn load(path: &Path, shape: LlamaShape) -> Self {
        let mut file = std::fs::File::open(path).unwrap();
        let content = gguf_file::Content::read(&mut file).unwrap();
        let mut read = |name: &str| -> Option<(Vec<f32>, Vec<usize>)> {
            if !content.tensor_infos.contains_key(name) {
                return None;
            }
            let t = content.tensor(&mut file, name, &Device::Cpu).unwrap();
            let t = t.dequantize(&Device::Cpu).unwrap();
            let dims = t.dims().to_vec();
            Some((t.flatten_all().unwrap().to_vec1::<f32>().unwrap(), dims))
        };
        let mut matrix = |name: &str| -> Option<Matrix> {
            let (data, dims) = read(name)?;
            Some(Matrix { data, cols: *dims.last().unwrap() })
        };
        let embed = matrix("token_embd.weight").unwrap();
        let output = matrix("output.weight");
        let layers = (0..shape.num_layers)
            .map(|i| {
                let mut m = |part: &str| matrix(&format!("blk.{i}.{part}.weight")).unwrap();
                Layer {
                    attn_norm: m("attn_norm").data,
                    q: m("attn_q"),
                    k: m("attn_k"),
                    v: m("attn_v"),
                    o: m("attn_output"),
                    ffn_norm: m("ffn_norm").data,
                    gate: m("ffn_gate"),
                    up: m("ffn_up"),
                    down: m("ffn_down"),
                }
            })
            .collect();
        let norm = matrix("output_norm.weight").unwrap().data;
        Model { shape, embed, layers, norm, output }
    }

    fn rms_norm(&self, x: &[f64], w: &[f32]) -> Vec<f64> {
        let mean = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let scale = 1.0 / (mean + f64::from(self.shape.rms_eps)).sqrt();
        x.iter().zip(w).map(|(v, &g)| v * scale * f64::from(g)).collect()
    }

    fn rope(&self, heads: &mut [f64], pos: usize) {
        let hd = self.shape.head_dim;
        let base = f64::from(self.shape.rope_theta);
        for head in heads.chunks_mut(hd) {
            for i in 0..hd / 2 {
                let angle = pos as f64 * base.powf(-2.0 * i as f64 / hd as f64);
                let (sin, cos) = angle.sin_cos();
                let (a, b) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = a * cos - b * sin;
                head[2 * i + 1] = a * sin + b * cos;
            }
        }
    }

    /// Runs `tokens` after the positions in `cache` and returns the last one's logits.
    pub fn forward(&self, tokens: &[u32], cache: &mut Cache) -> Vec<f64> {
        let s = &self.shape;
        let (hd, nh, nkv) = (s.head_dim, s.num_heads, s.num_kv_heads);
        if cache.keys.is_empty() {
            cache.keys = vec![Vec::new(); s.num_layers];
            cache.values = vec![Vec::new(); s.num_layers];
        }
        let mut last = Vec::new();
        for &t in tokens {
            let pos = cache.keys[0].len();
            let mut x: Vec<f64> =
                self.embed.row(t as usize).iter().map(|&v| f64::from(v)).collect();
            for (l, layer) in self.layers.iter().enumerate() {
                let xn = self.rms_norm(&x, &layer.attn_norm);
                let mut q = layer.q.mul(&xn);
                let mut k = layer.k.mul(&xn);
                let v = layer.v.mul(&xn);
                self.rope(&mut q, pos);
                self.rope(&mut k, pos);
                cache.keys[l].push(k);
                cache.values[l].push(v);
                let mut attn = vec![0f64; nh * hd];
                for h in 0..nh {
                    let g = h / (nh / nkv);
                    let qh = &q[h * hd..(h + 1) * hd];
                    let scores: Vec<f64> = cache.keys[l]
                        .iter()
                        .map(|k| {
                            let kh = &k[g * hd..(g + 1) * hd];
                            qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                        })
                        .collect();
                    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let sum: f64 = exps.iter().sum();
                    for (p, e) in exps.iter().enumerate() {
                        let vh = &cache.values[l][p][g * hd..(g + 1) * hd];
                        for (o, v) in attn[h * hd..(h + 1) * hd].iter_mut().zip(vh) {
                            *o += e / sum * v;
                        }
                    }
                }
                for (xi, o) in x.iter_mut().zip(layer.o.mul(&attn)) {
                    *xi += o;
                }
                let xn = self.rms_norm(&x, &layer.ffn_norm);
                let gate = layer.gate.mul(&xn);
                let up = layer.up.mul(&xn);
                let act: Vec<f64> =
                    gate.iter().zip(&up).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
                for (xi, d) in x.iter_mut().zip(layer.down.mul(&act)) {
                    *xi += d;
                }
            }
            last = x;
        }
        let xn = self.rms_norm(&last, &self.norm);
        self.output.as_ref().unwrap_or(&self.embed).mul(&xn)
    }

    /// `max` greedy tokens after `prompt`, and the log-probabilities (log-softmax) of the
    /// first step's logits.
    pub fn greedy(&self, prompt: &[u32], max: usize) -> (Vec<u32>, Vec<f64>) {
        let mut cache = Cache::default();
        let mut logits = self.forward(prompt, &mut cache);
        let first = log_softmax(&logits);
        let mut out = Vec::new();
        for _ in 0..max {
            let next = logits
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map(|(i, _)| i as u32)
                .unwrap();
            out.push(next);
            logits = self.forward(&[next], &mut cache);
        }
        (out, first)
    }
}

fn log_softmax(logits: &[f64]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
    logits.iter().map(|l| l - lse).collect()
}
