//! Every file of every fuzz corpus (fuzz/corpus/TARGET/, what the fuzzers kept and what
//! they found) through its target on stable Rust: a panic fails the test, naming the file.

use std::path::Path;

#[test]
fn every_corpus_file_goes_through_its_target_without_a_panic() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    let mut total = 0;
    for (name, target) in weft_fuzz::TARGETS {
        let dir = root.join(name);
        let entries = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e} (every target keeps a corpus)", dir.display()));
        let mut n = 0;
        for e in entries {
            let path = e.unwrap().path();
            let data = std::fs::read(&path).unwrap();
            let r = std::panic::catch_unwind(|| target(&data));
            assert!(r.is_ok(), "{name}: {} panics", path.display());
            n += 1;
        }
        assert!(n > 0, "{name}: the corpus is empty");
        total += n;
    }
    eprintln!("{total} corpus files replayed");
}
