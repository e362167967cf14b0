//! A batched step (several sequences, each with its own cache, prefill chunks mixed with
//! decodes) gives each sequence the logits it gets when run alone.

use std::path::Path;
use std::sync::Arc;

use weft_gguf::{GgmlType, GgufFile};
use weft_kernels::ThreadPool;
use weft_model::synthetic::{synthetic_model, SyntheticSpec};
use weft_model::{Arch, Identity, Logits, Model, ModelConfig, SeqSpan, ShardSpec};

const UBATCH: usize = 16;

fn write_synthetic(dir: &Path, arch: Arch, ty: GgmlType) -> Arc<GgufFile> {
    let spec = SyntheticSpec::small(arch, ty);
    let p = dir.join(format!("{}-{}.gguf", arch.name(), ty));
    synthetic_model(&spec).write_file(&p).unwrap();
    Arc::new(GgufFile::open(&p).unwrap())
}

/// Logits after the prompt, then after each decoded token, running the sequence alone.
fn alone(m: &mut Model, pool: &ThreadPool, prompt: &[u32], decoded: &[u32]) -> Vec<Vec<f32>> {
    let mut kv = m.new_cache(64);
    let mut out = Vec::new();
    m.forward(prompt, &mut kv, &mut Identity, pool, Logits::Last, &mut out)
        .unwrap();
    let mut steps = vec![out.clone()];
    for &t in decoded {
        m.forward(&[t], &mut kv, &mut Identity, pool, Logits::Last, &mut out)
            .unwrap();
        steps.push(out.clone());
    }
    steps
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = a.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
        / scale
}

#[test]
fn batched_steps_equal_sequences_run_alone() {
    let dir = tempfile::tempdir().unwrap();
    let pa: Vec<u32> = (0..20).map(|i| 4 + (i * 37) % 500).collect();
    let pb: Vec<u32> = (0..9).map(|i| 7 + (i * 53) % 500).collect();
    let pc: Vec<u32> = vec![11, 260, 301];
    let (da, db, dc) = ([300u32, 17], [5u32, 99], [42u32]);
    // Float weights: summation order only. Quantized weights quantize each matmul's
    // input to 8 bits, and a different tile (1, 2 or 4 tokens) changes the last bits of a
    // row, which can flip roundings downstream: the unsharded model's own noise floor for
    // such changes is 1-3 % of max |logit| (see sharding.rs). A batching bug (wrong
    // position, wrong cache) moves logits by the order of 100 %.
    for (ty, tol) in [
        (GgmlType::F32, 1e-4),
        (GgmlType::Q8_0, 3e-2),
        (GgmlType::Q4_K, 3e-2),
    ] {
        for arch in [Arch::Gemma3, Arch::Llama, Arch::Qwen3] {
            let f = write_synthetic(dir.path(), arch, ty);
            let cfg = ModelConfig::from_gguf(&f).unwrap();
            let mut m = Model::load(f, ShardSpec::full(&cfg), UBATCH).unwrap();
            let pool = ThreadPool::new(2);
            let want_a = alone(&mut m, &pool, &pa, &da);
            let want_b = alone(&mut m, &pool, &pb, &db);
            let want_c = alone(&mut m, &pool, &pc, &dc);

            let mut caches: Vec<_> = (0..3).map(|_| m.new_cache(64)).collect();
            let span = |cache, n_tokens, logits| SeqSpan {
                cache,
                n_tokens,
                logits,
            };
            let mut out = Vec::new();
            let mut step = |tokens: Vec<u32>, spans: &[SeqSpan], out: &mut Vec<f32>| {
                m.forward_batch(&tokens, spans, &mut caches, &mut Identity, &pool, out)
                    .unwrap();
            };
            let n_v = cfg.n_vocab;
            let what = format!("{} {ty}", arch.name());
            let check = |name: &str, got: &[f32], want: &[f32]| {
                let d = max_rel(want, got);
                assert!(
                    d <= tol,
                    "{what} {name}: batched differs by {d} of max |logit|"
                );
            };
            // Two prompts prefilled together in chunks (cache order differs from span order).
            step(
                [&pa[..10], &pb[..5]].concat(),
                &[span(2, 10, false), span(0, 5, false)],
                &mut out,
            );
            assert!(out.is_empty());
            step(
                [&pa[10..], &pb[5..]].concat(),
                &[span(2, 10, true), span(0, 4, true)],
                &mut out,
            );
            check("A prompt", &out[..n_v], &want_a[0]);
            check("B prompt", &out[n_v..], &want_b[0]);
            // Two decodes beside a third sequence's whole prompt.
            step(
                [&[da[0], db[0]][..], &pc].concat(),
                &[span(2, 1, true), span(0, 1, true), span(1, 3, true)],
                &mut out,
            );
            check("A decode 1", &out[..n_v], &want_a[1]);
            check("B decode 1", &out[n_v..2 * n_v], &want_b[1]);
            check("C prompt", &out[2 * n_v..], &want_c[0]);
            // All three decode; B's logits are not wanted this time.
            step(
                vec![da[1], db[1], dc[0]],
                &[span(2, 1, true), span(0, 1, false), span(1, 1, true)],
                &mut out,
            );
            assert_eq!(out.len(), 2 * n_v);
            check("A decode 2", &out[..n_v], &want_a[2]);
            check("C decode 1", &out[n_v..], &want_c[1]);
            assert_eq!(caches[0].pos, 11);
        }
    }
}

#[test]
fn bad_batches_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let f = write_synthetic(dir.path(), Arch::Llama, GgmlType::F32);
    let cfg = ModelConfig::from_gguf(&f).unwrap();
    let mut m = Model::load(f, ShardSpec::full(&cfg), UBATCH).unwrap();
    let pool = ThreadPool::new(1);
    let mut caches: Vec<_> = (0..2).map(|_| m.new_cache(8)).collect();
    let mut out = Vec::new();
    let sp = |cache, n_tokens| SeqSpan {
        cache,
        n_tokens,
        logits: true,
    };
    let mut run = |tokens: &[u32], spans: &[SeqSpan]| {
        m.forward_batch(tokens, spans, &mut caches, &mut Identity, &pool, &mut out)
            .unwrap_err()
            .to_string()
    };
    assert!(run(&[1, 2], &[sp(0, 1), sp(0, 1)]).contains("twice"));
    assert!(run(&[1], &[sp(5, 1)]).contains("cache 5"));
    assert!(run(&[1, 2], &[sp(0, 1)]).contains("2 tokens"));
    assert!(run(&[1; 9], &[sp(1, 9)]).contains("9"));
    assert!(run(&[1; 17], &[sp(0, 8), sp(1, 9)]).contains("micro-batch"));
}
