//! Tests of a whole `Model` that reach below its public face: the layout its layers
//! loaded in, against what their forward passes must then give.

use std::sync::Arc;

use weft_gguf::{GgmlType, GgufFile, PartialData, TensorInfo};
use weft_kernels::{quant, ThreadPool};

use crate::batch::SeqSpan;
use crate::collective::Identity;
use crate::config::{Arch, ModelConfig};
use crate::model::{Logits, Model};
use crate::shard::ShardSpec;
use crate::synthetic::{synthetic_model, SyntheticMoe, SyntheticSpec};
use crate::weights::Linear;

/// Where this CPU interleaves Q8_0 rows, routed experts are interleaved as dense
/// layers are, and a token then gives the same bits alone (decode's path through the
/// chosen experts) as beside another sequence's token (prefill's gathered path).
#[test]
fn a_token_alone_equals_its_row_in_a_batch_through_interleaved_experts() {
    let mut spec = SyntheticSpec::small(Arch::Qwen3Moe, GgmlType::Q8_0);
    // Six of eight experts a token: two tokens share at least four, so the batched step
    // runs experts over two gathered rows, not only one each.
    spec.moe = Some(SyntheticMoe::routed(8, 6, 128));
    let bytes = synthetic_model(&spec).to_bytes();
    let file = Arc::new(GgufFile::from_bytes("moe.gguf", bytes).unwrap());
    let cfg = ModelConfig::from_gguf(&file).unwrap();
    let shard = ShardSpec::full(&cfg);
    let mut model = Model::load(file, shard, 8).unwrap();
    let packs = quant::packs(GgmlType::Q8_0, cfg.n_embd);
    let experts: Vec<&Linear> = model
        .layer_linears()
        .filter(|w| w.name.contains("_exps"))
        .collect();
    assert_eq!(experts.len(), cfg.n_layer * 8 * 3);
    for w in &experts {
        assert_eq!(w.is_interleaved(), packs, "{}", w.name);
    }
    if !packs {
        eprintln!("this CPU has no VNNI form: experts keep ggml's layout, bits not compared");
        return;
    }
    // Three threads cut the experts' rows where a 4-row alignment would leave a range
    // inside a group of eight.
    let pool = ThreadPool::new(3);
    let span = |cache, n_tokens| SeqSpan {
        cache,
        n_tokens,
        logits: true,
    };
    let step = |model: &mut Model, caches: &mut Vec<_>, tokens: &[u32], spans: &[SeqSpan]| {
        let mut out = Vec::new();
        model
            .forward_batch(tokens, spans, caches, &mut Identity, &pool, &mut out)
            .unwrap();
        out
    };
    let n_v = spec.n_vocab();
    // Alone: sequence 0's prompt, then one token by itself.
    let mut caches = vec![model.new_cache(64)];
    step(&mut model, &mut caches, &[5, 9, 13, 40], &[span(0, 4)]);
    let alone = step(&mut model, &mut caches, &[20], &[span(0, 1)]);
    // Batched: the same, beside another sequence's token in one step.
    let mut caches = vec![model.new_cache(64), model.new_cache(64)];
    step(&mut model, &mut caches, &[5, 9, 13, 40], &[span(0, 4)]);
    step(&mut model, &mut caches, &[7, 8, 100], &[span(1, 3)]);
    let both = step(
        &mut model,
        &mut caches,
        &[20, 21],
        &[span(0, 1), span(1, 1)],
    );
    assert_eq!(alone.len(), n_v);
    assert!(alone.iter().all(|v| v.is_finite()));
    let same = alone
        .iter()
        .zip(&both[..n_v])
        .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same, "the batched row differs from the token alone");
    assert!(
        alone.iter().zip(&both[n_v..]).any(|(a, b)| a != b),
        "the other sequence's row is not its own"
    );
}

/// The logits buffer is reused without zeroing: a buffer that held more rows, or other
/// values, gives exactly what a fresh one gives, through `forward` and `forward_batch`.
#[test]
fn a_reused_logits_buffer_equals_a_fresh_one() {
    let spec = SyntheticSpec::small(Arch::Llama, GgmlType::Q8_0);
    let bytes = synthetic_model(&spec).to_bytes();
    let file = Arc::new(GgufFile::from_bytes("dense.gguf", bytes).unwrap());
    let cfg = ModelConfig::from_gguf(&file).unwrap();
    let mut model = Model::load(file, ShardSpec::full(&cfg), 8).unwrap();
    let pool = ThreadPool::new(1);
    let n_v = spec.n_vocab();
    let run = |model: &mut Model, out: &mut Vec<f32>, want: Logits| {
        let mut kv = model.new_cache(64);
        model
            .forward(&[5, 9, 13, 40, 7], &mut kv, &mut Identity, &pool, want, out)
            .unwrap();
    };
    let mut fresh = Vec::new();
    run(&mut model, &mut fresh, Logits::Last);
    // Stale values and a longer length first.
    let mut reused = vec![f32::NAN; 7 * n_v];
    run(&mut model, &mut reused, Logits::All);
    assert_eq!(reused.len(), 5 * n_v);
    assert_eq!(reused[4 * n_v..], fresh[..]);
    run(&mut model, &mut reused, Logits::Last);
    assert_eq!(reused, fresh);
    let span = |cache, n_tokens| SeqSpan {
        cache,
        n_tokens,
        logits: true,
    };
    let mut caches = vec![model.new_cache(64), model.new_cache(64)];
    let mut batch = vec![f32::NAN; 3 * n_v];
    model
        .forward_batch(
            &[5, 9],
            &[span(0, 1), span(1, 1)],
            &mut caches,
            &mut Identity,
            &pool,
            &mut batch,
        )
        .unwrap();
    assert_eq!(batch.len(), 2 * n_v);
    assert!(batch.iter().all(|v| v.is_finite()));
    let mut caches = vec![model.new_cache(64)];
    let mut one = Vec::new();
    model
        .forward_batch(
            &[9],
            &[span(0, 1)],
            &mut caches,
            &mut Identity,
            &pool,
            &mut one,
        )
        .unwrap();
    assert_eq!(batch[n_v..], one[..]);
}

/// A dry run's loader only records what a shard reads.
struct RecordsOnly;

impl PartialData for RecordsOnly {
    fn check(&self, _r: std::ops::Range<usize>) -> Result<(), String> {
        Ok(())
    }

    fn columns(
        &self,
        _index: usize,
        t: &TensorInfo,
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
    ) -> Result<Vec<u8>, String> {
        Ok(vec![
            0;
            rows.len() * cols.len() / t.ty.block_size()
                * t.ty.type_size()
        ])
    }

    fn records_only(&self) -> bool {
        true
    }
}

/// A dry run (a node learning which pieces its shard reads before fetching them) packs
/// nothing: its bytes are placeholders, and packing a whole shard of them would cost its
/// memory and time before the fetch.
#[test]
fn a_dry_run_interleaves_nothing() {
    let spec = SyntheticSpec::small(Arch::Qwen3Moe, GgmlType::Q8_0);
    let bytes = synthetic_model(&spec).to_bytes();
    let mut file = GgufFile::from_bytes("moe.gguf", bytes).unwrap();
    let cfg = ModelConfig::from_gguf(&file).unwrap();
    file.set_partial(Arc::new(RecordsOnly));
    let model = Model::load(Arc::new(file), ShardSpec::full(&cfg), 8).unwrap();
    let n = model.layer_linears().count();
    assert!(n >= cfg.n_layer * (4 + 8 * 3), "{n} linear layers");
    assert!(model.layer_linears().all(|w| !w.is_interleaved()));
}
