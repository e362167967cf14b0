//! The forward pass checked against an independent, deliberately naive f64 implementation
//! (dequantized weights, full attention with explicit masks, no KV cache), for every
//! architecture on synthetic F32 models, so RoPE style, GQA, norms, biases and the sliding
//! window are right, not just self-consistent.

use std::sync::Arc;

use weft_gguf::{GgmlType, GgufFile};
use weft_kernels::quant;
use weft_kernels::ThreadPool;
use weft_model::synthetic::{synthetic_model, SyntheticSpec};
use weft_model::{Arch, Identity, Logits, Model, ModelConfig, ShardSpec};

struct Ref<'a> {
    f: &'a GgufFile,
    cfg: ModelConfig,
}

impl Ref<'_> {
    fn t(&self, name: &str) -> Vec<f64> {
        let t = self.f.tensor(name).unwrap();
        let mut v = vec![0f32; t.n_elements() as usize];
        quant::dequantize_row(t.ty, self.f.tensor_bytes(t), &mut v);
        v.into_iter().map(|x| x as f64).collect()
    }
    fn has(&self, name: &str) -> bool {
        self.f.has_tensor(name)
    }
    /// y = W x with W stored as n_out rows of n_in.
    fn mv(&self, name: &str, x: &[f64]) -> Vec<f64> {
        let w = self.t(name);
        let n_in = x.len();
        let mut y: Vec<f64> = w
            .chunks(n_in)
            .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
            .collect();
        let b = name.replace(".weight", ".bias");
        if self.has(&b) {
            for (yi, bi) in y.iter_mut().zip(self.t(&b)) {
                *yi += bi;
            }
        }
        y
    }
    fn norm(&self, x: &[f64], w: &[f64]) -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let r = 1.0 / (ms + self.cfg.eps as f64).sqrt();
        x.iter().zip(w).map(|(v, g)| v * r * g).collect()
    }
    fn rope(&self, h: &mut [f64], pos: usize, base: f64) {
        let n = self.cfg.n_rot;
        for i in 0..n / 2 {
            let theta = pos as f64 * base.powf(-2.0 * i as f64 / n as f64);
            let (a, b) = match self.cfg.arch {
                Arch::Llama | Arch::Mistral => (2 * i, 2 * i + 1),
                _ => (i, i + n / 2),
            };
            let (x0, x1) = (h[a], h[b]);
            h[a] = x0 * theta.cos() - x1 * theta.sin();
            h[b] = x0 * theta.sin() + x1 * theta.cos();
        }
    }

    /// Logits of the last token of `ids`.
    fn forward(&self, ids: &[u32]) -> Vec<f64> {
        let c = &self.cfg;
        let (e, hd, nh, nkv) = (c.n_embd, c.head_dim, c.n_head, c.n_head_kv);
        let gemma = c.arch == Arch::Gemma3;
        let emb = self.t("token_embd.weight");
        let mut xs: Vec<Vec<f64>> = ids
            .iter()
            .map(|&id| {
                emb[id as usize * e..(id as usize + 1) * e]
                    .iter()
                    .map(|v| v * if gemma { (e as f64).sqrt() } else { 1.0 })
                    .collect()
            })
            .collect();
        for il in 0..c.n_layer {
            let n = |s: &str| format!("blk.{il}.{s}");
            let window = c.window[il];
            let base = if window.is_some() {
                c.rope_base_swa
            } else {
                c.rope_base
            } as f64;
            let mut qs = Vec::new();
            let mut ks = Vec::new();
            let mut vs = Vec::new();
            for (pos, x) in xs.iter().enumerate() {
                let h = self.norm(x, &self.t(&n("attn_norm.weight")));
                let mut q = self.mv(&n("attn_q.weight"), &h);
                let mut k = self.mv(&n("attn_k.weight"), &h);
                let v = self.mv(&n("attn_v.weight"), &h);
                for hh in 0..nh {
                    let s = &mut q[hh * hd..(hh + 1) * hd];
                    if self.has(&n("attn_q_norm.weight")) {
                        let o = self.norm(s, &self.t(&n("attn_q_norm.weight")));
                        s.copy_from_slice(&o);
                    }
                    self.rope(s, pos, base);
                }
                for hh in 0..nkv {
                    let s = &mut k[hh * hd..(hh + 1) * hd];
                    if self.has(&n("attn_k_norm.weight")) {
                        let o = self.norm(s, &self.t(&n("attn_k_norm.weight")));
                        s.copy_from_slice(&o);
                    }
                    self.rope(s, pos, base);
                }
                qs.push(q);
                ks.push(k);
                vs.push(v);
            }
            for (pos, x) in xs.iter_mut().enumerate() {
                let mut att = vec![0f64; nh * hd];
                for hh in 0..nh {
                    let kh = hh / (nh / nkv);
                    let q = &qs[pos][hh * hd..(hh + 1) * hd];
                    let allowed: Vec<usize> = (0..=pos)
                        .filter(|&j| window.is_none_or(|w| pos - j < w))
                        .collect();
                    let scores: Vec<f64> = allowed
                        .iter()
                        .map(|&j| {
                            q.iter()
                                .zip(&ks[j][kh * hd..(kh + 1) * hd])
                                .map(|(a, b)| a * b)
                                .sum::<f64>()
                                * c.attn_scale as f64
                        })
                        .collect();
                    let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = scores.iter().map(|s| (s - mx).exp()).sum();
                    for (s, &j) in scores.iter().zip(&allowed) {
                        let p = (s - mx).exp() / z;
                        for d in 0..hd {
                            att[hh * hd + d] += p * vs[j][kh * hd + d];
                        }
                    }
                }
                let mut o = self.mv(&n("attn_output.weight"), &att);
                if gemma {
                    o = self.norm(&o, &self.t(&n("post_attention_norm.weight")));
                }
                x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
                let h = self.norm(x, &self.t(&n("ffn_norm.weight")));
                let g = self.mv(&n("ffn_gate.weight"), &h);
                let u = self.mv(&n("ffn_up.weight"), &h);
                let act: Vec<f64> = g
                    .iter()
                    .zip(&u)
                    .map(|(&g, &u)| {
                        let a = if gemma {
                            // Gemma's GELU as weft (and llama.cpp) define it: the tanh
                            // form on the input rounded to f16, the result rounded to f16,
                            // saturated beyond ±10.
                            let gelu = |x: f64| {
                                0.5 * x
                                    * (1.0
                                        + ((2.0 / std::f64::consts::PI).sqrt()
                                            * (x + 0.044715 * x * x * x))
                                            .tanh())
                            };
                            if g <= -10.0 {
                                0.0
                            } else if g >= 10.0 {
                                g
                            } else {
                                let x = half::f16::from_f64(g).to_f64();
                                half::f16::from_f64(gelu(x)).to_f64()
                            }
                        } else {
                            g / (1.0 + (-g).exp())
                        };
                        a * u
                    })
                    .collect();
                let mut d = self.mv(&n("ffn_down.weight"), &act);
                if gemma {
                    d = self.norm(&d, &self.t(&n("post_ffw_norm.weight")));
                }
                x.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
            }
        }
        let last = self.norm(xs.last().unwrap(), &self.t("output_norm.weight"));
        let head = if self.has("output.weight") {
            "output.weight"
        } else {
            "token_embd.weight"
        };
        self.mv(head, &last)
    }
}

#[test]
fn every_architecture_matches_the_naive_reference() {
    let dir = tempfile::tempdir().unwrap();
    // 13 tokens: past the synthetic Gemma's 8-token window.
    let prompt: Vec<u32> = (0..13).map(|i| 4 + (i * 71) % 500).collect();
    for arch in [
        Arch::Gemma3,
        Arch::Llama,
        Arch::Mistral,
        Arch::Qwen2,
        Arch::Qwen3,
    ] {
        let p = dir.path().join(format!("{}.gguf", arch.name()));
        synthetic_model(&SyntheticSpec::small(arch, GgmlType::F32))
            .write_file(&p)
            .unwrap();
        let f = Arc::new(GgufFile::open(&p).unwrap());
        let cfg = ModelConfig::from_gguf(&f).unwrap();
        let want = Ref {
            f: &f,
            cfg: cfg.clone(),
        }
        .forward(&prompt);
        let mut m = Model::load(f.clone(), ShardSpec::full(&cfg), 4).unwrap();
        let mut kv = m.new_cache(64);
        let mut out = Vec::new();
        m.forward(
            &prompt,
            &mut kv,
            &mut Identity,
            &ThreadPool::new(2),
            Logits::Last,
            &mut out,
        )
        .unwrap();
        let scale = want.iter().fold(0f64, |a, v| a.max(v.abs()));
        let diff = want
            .iter()
            .zip(&out)
            .fold(0f64, |a, (w, g)| a.max((w - *g as f64).abs()));
        assert!(
            diff <= 1e-4 * scale,
            "{}: max |diff| {diff} vs max |logit| {scale}",
            arch.name()
        );
    }
}
