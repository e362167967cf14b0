//! Grammars driven to the end with random logits over a small byte-fallback vocabulary:
//! whatever the "model" prefers, the output must parse and fit the schema.

use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use weft_model::TokenConstraint;
use weft_tokenizer::{Tokenizer, TokenizerSpec};

use crate::Grammars;

/// A SentencePiece vocabulary: unk, bos, eos, an end-of-turn control token, the 256 byte
/// tokens, and a few multi-byte pieces of JSON.
fn tokenizer() -> Tokenizer {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, 3, 3];
    tokens.push("<end_of_turn>".into());
    types.push(3);
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    for p in [
        "{\"",
        "\":",
        "name",
        "▁true",
        "12",
        "▁\"",
        "\"}",
        "abc",
        "<tool_call>",
    ] {
        tokens.push(p.into());
        types.push(1);
    }
    let n = tokens.len();
    Tokenizer::new(TokenizerSpec {
        model: "llama".into(),
        tokens,
        scores: Some(vec![0.0; n]),
        token_types: Some(types),
        bos_id: Some(1),
        eos_id: Some(2),
        unk_id: Some(0),
        eot_ids: vec![3],
        ..Default::default()
    })
    .unwrap()
}

/// Samples the argmax of random logits under `rule` until it ends; returns the text.
fn run(tok: &Tokenizer, mut rule: crate::Rule, seed: u64) -> String {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    for _ in 0..400 {
        if rule.finished() {
            break;
        }
        let mut logits: Vec<f32> = (0..tok.vocab_size()).map(|_| rng.gen::<f32>()).collect();
        // Make the ends likely once allowed, so most runs finish well inside the cap.
        for &e in tok.eog_ids() {
            logits[e as usize] += 0.5;
        }
        rule.mask(&mut logits).unwrap();
        let (best, _) = logits
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &l)| if l > b.1 { (i, l) } else { b },
            );
        if tok.is_eog(best as u32) {
            assert!(
                rule.accepting(),
                "an end was allowed before the match was complete"
            );
            break;
        }
        rule.accept(best as u32).unwrap();
        out.extend(tok.token_bytes(best as u32));
    }
    String::from_utf8(out).unwrap()
}

#[test]
fn random_logits_still_give_schema_valid_json() {
    let tok = tokenizer();
    let g = Grammars::new(&tok).unwrap();
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "ok": {"type": "boolean"}
        },
        "required": ["name", "n", "ok"],
        "additionalProperties": false
    });
    for seed in 0..8 {
        let text = run(&tok, g.json_schema(&schema).unwrap(), seed);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(
            v["name"].as_str().is_some_and(|s| s.chars().count() <= 8),
            "{v}"
        );
        assert!(v["n"].as_u64().is_some_and(|n| n <= 99), "{v}");
        assert!(v["ok"].is_boolean(), "{v}");
        assert_eq!(v.as_object().unwrap().len(), 3, "{v}");
    }
    for seed in 0..4 {
        let text = run(&tok, g.json_object().unwrap(), 100 + seed);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(v.is_object(), "{v}");
    }
}

#[test]
fn a_lark_grammar_with_embedded_json_holds_its_literal_text() {
    let tok = tokenizer();
    let g = Grammars::new(&tok).unwrap();
    let lark = r#"start: "<tool_call>\n" call "\n</tool_call>"
call: %json {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"], "additionalProperties": false}}, "required": ["name", "arguments"], "additionalProperties": false}
"#;
    let text = run(&tok, g.lark(lark).unwrap(), 7);
    let body = text
        .strip_prefix("<tool_call>\n")
        .and_then(|t| t.strip_suffix("\n</tool_call>"))
        .unwrap_or_else(|| panic!("{text:?}"));
    let v: Value = serde_json::from_str(body).unwrap();
    assert_eq!(v["name"], "get_weather");
    assert!(v["arguments"]["city"].is_string(), "{v}");
}

#[test]
fn schemas_the_engine_cannot_hold_are_refused_with_a_reason() {
    let tok = tokenizer();
    let g = Grammars::new(&tok).unwrap();
    let e = g.json_schema(&json!({"type": "no-such-type"})).unwrap_err();
    assert!(!e.is_empty());
    let e = g.lark("start: undefined_rule").unwrap_err();
    assert!(e.contains("undefined_rule"), "{e}");
}
