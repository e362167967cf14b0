//! Models split as llama.cpp's gguf-split cuts them: opening the first part runs the model
//! with the same output as the uncut file, on one node and across a pipeline whose stages'
//! bytes lie in different parts; `weft inspect` lists the parts; a missing part is named.

mod common;

use weft_gguf::GgmlType;
use weft_model::synthetic::{synthetic_model, SyntheticSpec};
use weft_model::Arch;

use common::{ids, ok_json, weft};

fn tokens(model: &str, layout: &[&str]) -> Vec<u64> {
    let mut args = vec![
        "run",
        "--model",
        model,
        "--prompt",
        "the cat sat",
        "-n",
        "12",
        "--temperature",
        "0",
        "--json",
        "-t",
        "1",
    ];
    args.extend_from_slice(layout);
    ids(&ok_json(&weft(&args)), "token_ids")
}

#[test]
fn a_split_model_runs_as_the_uncut_one() {
    let dir = tempfile::tempdir().unwrap();
    let whole = dir.path().join("whole.gguf");
    let spec = SyntheticSpec::small(Arch::Qwen3, GgmlType::Q4_K);
    synthetic_model(&spec).write_file(&whole).unwrap();
    let parts = synthetic_model(&spec).split(7);
    let n = parts.len();
    assert!(n >= 3, "{n} parts");
    for (i, p) in parts.iter().enumerate() {
        p.write_file(&dir.path().join(format!("cut-{:05}-of-{n:05}.gguf", i + 1)))
            .unwrap();
    }
    let first = dir.path().join(format!("cut-00001-of-{n:05}.gguf"));
    let (whole, first) = (whole.to_str().unwrap(), first.to_str().unwrap());
    let want = tokens(whole, &[]);
    assert_eq!(tokens(first, &[]), want, "one node");
    // Each pipeline stage's layers come from other parts than the first.
    assert_eq!(tokens(first, &["--nodes", "2", "--pp", "2"]), want, "PP=2");

    let out = weft(&["inspect", first, "--tensors"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&format!("split in {n} parts")), "{text}");
    assert!(text.contains(&format!("part {n})")), "{text}");

    std::fs::remove_file(dir.path().join(format!("cut-00002-of-{n:05}.gguf"))).unwrap();
    let out = weft(&["run", "--model", first, "--prompt", "hi", "-n", "2"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("cut-00002-of-{n:05}.gguf"))
            && err.contains(&format!("part 2 of {n}")),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}
