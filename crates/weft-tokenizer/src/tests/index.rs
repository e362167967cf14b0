//! The open-addressing text index: hits, misses and duplicates.

use crate::index::TextIndex;

#[test]
fn finds_every_text_and_rejects_others() {
    let texts: Vec<String> = (0..5000).map(|i| format!("tok{i}▁")).collect();
    let index = match TextIndex::new(&texts) {
        Ok(i) => i,
        Err(d) => panic!("unexpected duplicate {d:?}"),
    };
    for (i, t) in texts.iter().enumerate() {
        assert_eq!(index.get(&texts, t), Some(i as u32));
    }
    assert_eq!(index.get(&texts, "tok5000▁"), None);
    assert_eq!(index.get(&texts, ""), None);
    assert_eq!(
        index.get(&texts, "a much longer text than any token in there"),
        None
    );
}

#[test]
fn reports_duplicates() {
    let texts: Vec<String> = ["a", "b", "c", "b"].iter().map(|s| s.to_string()).collect();
    assert!(matches!(TextIndex::new(&texts), Err((1, 3))));
}
