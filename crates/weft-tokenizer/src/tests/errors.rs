//! Malformed specs are rejected with errors naming the metadata key at fault.

use super::*;

fn err(spec: TokenizerSpec) -> String {
    match Tokenizer::new(spec) {
        Ok(_) => panic!("spec should have been rejected"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn scores_length_mismatch() {
    let mut spec = spm_spec(SPM_PIECES);
    if let Some(s) = spec.scores.as_mut() {
        s.pop();
    }
    let msg = err(spec);
    assert!(msg.contains("tokenizer.ggml.scores"), "{msg}");
}

#[test]
fn token_type_length_mismatch() {
    let mut spec = spm_spec(SPM_PIECES);
    spec.token_types = Some(vec![1; 3]);
    let msg = err(spec);
    assert!(msg.contains("tokenizer.ggml.token_type"), "{msg}");
}

#[test]
fn bad_merge_line() {
    let mut spec = bpe_spec("qwen2", &["ab"], &["a b"]);
    spec.merges = Some(vec!["a b".into(), "ab".into()]);
    let msg = err(spec);
    assert!(msg.contains("tokenizer.ggml.merges[1]"), "{msg}");
}

#[test]
fn missing_merges() {
    let mut spec = bpe_spec("qwen2", &[], &[]);
    spec.merges = None;
    assert!(err(spec).contains("tokenizer.ggml.merges"));
}

#[test]
fn special_ids_out_of_range() {
    let mut spec = spm_spec(SPM_PIECES);
    spec.bos_id = Some(1_000_000);
    let msg = err(spec);
    assert!(msg.contains("tokenizer.ggml.bos_token_id"), "{msg}");
    assert!(msg.contains("1000000"), "{msg}");

    let mut spec = spm_spec(SPM_PIECES);
    spec.eos_id = Some(100_000);
    assert!(err(spec).contains("tokenizer.ggml.eos_token_id"));

    let mut spec = spm_spec(SPM_PIECES);
    spec.eot_ids = vec![100_000];
    assert!(err(spec).contains("tokenizer.ggml.eot_token_id"));
}

#[test]
fn unknown_model_and_pre() {
    let mut spec = spm_spec(SPM_PIECES);
    spec.model = "bert".into();
    assert!(err(spec).contains("tokenizer.ggml.model"));

    let spec = bpe_spec("no-such-pre", &[], &[]);
    assert!(err(spec).contains("tokenizer.ggml.pre"));
}

#[test]
fn duplicate_and_empty_vocab() {
    let mut spec = spm_spec(SPM_PIECES);
    spec.tokens[5] = spec.tokens[4].clone();
    assert!(err(spec).contains("tokenizer.ggml.tokens"));

    let spec = TokenizerSpec {
        model: "llama".into(),
        ..Default::default()
    };
    assert!(err(spec).contains("tokenizer.ggml.tokens"));
}

#[test]
fn add_bos_without_bos() {
    let mut spec = bpe_spec("qwen2", &[], &[]);
    spec.bos_id = None;
    spec.add_bos = Some(true);
    let msg = err(spec);
    assert!(msg.contains("tokenizer.ggml.add_bos_token"), "{msg}");
}
