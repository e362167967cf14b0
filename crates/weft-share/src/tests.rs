//! The crate's pieces working together on a real (small) GGUF file: a manifest built and
//! checked, the pieces a recorded read needs, the cache storing, refusing, reopening and
//! serving them, and fetches from holders that lie or fail.

use std::collections::BTreeSet;
use std::sync::Arc;

use weft_gguf::{GgmlType, GgufFile, GgufWriter, PartialData};

use crate::cache::ShardCache;
use crate::fetch::{fetch, Holding, Source};
use crate::manifest::{Manifest, MIN_CHUNK};
use crate::pieces::{Needs, Piece, Recorder};

/// A model of three tensors: a 1-D norm, a Q8_0 matrix of 4 blocks a row and a 3-D one
/// (two "experts"), about 300 KiB so several chunks.
fn model(dir: &std::path::Path) -> (std::path::PathBuf, GgufFile) {
    let mut w = GgufWriter::new();
    w.set_str("general.architecture", "llama");
    w.add_tensor("norm", &[128], GgmlType::F32, vec![1u8; 512]);
    let q = |rows: usize, seed: u8| -> Vec<u8> {
        (0..rows * 4 * 34)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    };
    w.add_tensor("mat", &[128, 1024], GgmlType::Q8_0, q(1024, 1));
    w.add_tensor("exps", &[128, 512, 2], GgmlType::Q8_0, q(1024, 2));
    let p = dir.join("m.gguf");
    w.write_file(&p).unwrap();
    let f = GgufFile::open(&p).unwrap();
    (p, f)
}

#[test]
fn the_manifest_binds_every_byte_and_rejects_tampering() {
    let dir = tempfile::tempdir().unwrap();
    let (p, f) = model(dir.path());
    let m = Manifest::build(&f);
    assert_eq!(m.chunk_size, MIN_CHUNK);
    assert_eq!(m.total_len(), std::fs::metadata(&p).unwrap().len());
    // Strips for the matrices, none for the vector.
    let names: Vec<&str> = m.strips.iter().map(|s| s.tensor.as_str()).collect();
    assert_eq!(names, ["mat", "exps"]);
    assert_eq!(m.strips[1].slabs, 2);
    let json = serde_json::to_vec(&m).unwrap();
    assert_eq!(Manifest::parse_checked(&json, &m.root).unwrap(), m);
    // One hash changed: the root no longer matches.
    let mut bad = m.clone();
    bad.parts[0].chunks.0[1][0] ^= 1;
    let json = serde_json::to_vec(&bad).unwrap();
    assert!(Manifest::parse_checked(&json, &m.root).is_err());
    // A self-consistent manifest of another root: refused against the plan's root.
    bad.root = crate::manifest::hex(&bad.compute_root());
    let json = serde_json::to_vec(&bad).unwrap();
    assert!(Manifest::parse_checked(&json, &m.root).is_err());
    assert!(Manifest::parse_checked(&json, &bad.root).is_ok());
    // A part name that would escape the cache directory.
    let mut evil = m.clone();
    evil.parts[0].name = "../x".into();
    evil.root = crate::manifest::hex(&evil.compute_root());
    let json = serde_json::to_vec(&evil).unwrap();
    assert!(Manifest::parse_checked(&json, &evil.root)
        .unwrap_err()
        .contains("not a file name"));
}

#[test]
fn recorded_reads_become_the_pieces_that_cover_them() {
    let dir = tempfile::tempdir().unwrap();
    let (_, f) = model(dir.path());
    let m = Manifest::build(&f);
    let rec = Recorder::default();
    let mat = f.tensor("mat").unwrap().clone();
    let r = f.row_range(&mat, 0..10).unwrap();
    rec.check(r.clone()).unwrap();
    let cols = rec.columns(0, &mat, 0..1024, 32..96).unwrap();
    assert_eq!(cols.len(), 1024 * 2 * 34);
    let needs = rec.take();
    let pieces = m.pieces_for(&needs).unwrap();
    // The header's chunk, the chunk of rows 0..10, and strips 1 and 2 of `mat`.
    let chunk = |at: usize| Piece::Chunk {
        part: 0,
        index: (at as u64 / m.chunk_size) as u32,
    };
    assert!(pieces.contains(&chunk(0)) && pieces.contains(&chunk(r.start)));
    let strips: Vec<Piece> = pieces
        .iter()
        .filter(|p| matches!(p, Piece::Strip { .. }))
        .copied()
        .collect();
    assert_eq!(
        strips,
        [
            Piece::Strip { set: 0, index: 1 },
            Piece::Strip { set: 0, index: 2 }
        ]
    );
    assert_eq!(
        needs.bytes(|_| 34),
        (r.len() + 1024 * 2 * 34) as u64,
        "the union of ranges and the column bytes"
    );
    // A tensor the manifest has no strips for is named.
    let bad = Needs {
        ranges: vec![],
        columns: vec![("norm".into(), 0..1, 0..32, 32)],
    };
    assert!(m.pieces_for(&bad).unwrap_err().contains("norm"));
}

#[test]
fn the_cache_stores_verified_pieces_and_serves_the_model_from_them() {
    let dir = tempfile::tempdir().unwrap();
    let (_, f) = model(dir.path());
    let m = Manifest::build(&f);
    let shards = dir.path().join("shards");
    let cache = ShardCache::open(&shards, m.clone()).unwrap();
    let all: Vec<Piece> = (0..m.parts[0].chunks.0.len() as u32)
        .map(|index| Piece::Chunk { part: 0, index })
        .chain((0..8).map(|index| Piece::Strip { set: 1, index }))
        .collect();
    let bytes_of = |p: Piece| match p {
        Piece::Chunk { part, index } => {
            let r = m.chunk_range(part as usize, index as u64).unwrap();
            f.slice(r.start as usize..r.end as usize).to_vec()
        }
        Piece::Strip { set, index } => crate::cache::strip_from_file(&m, &f, set, index).unwrap(),
    };
    // A wrong copy is refused and nothing is stored.
    let mut wrong = bytes_of(all[0]);
    wrong[3] ^= 1;
    assert!(matches!(
        cache.put(all[0], &wrong),
        Err(crate::cache::PutError::Bad(_))
    ));
    assert!(!cache.has(all[0]));
    for &p in &all {
        cache.put(p, &bytes_of(p)).unwrap();
    }
    assert_eq!(cache.get(all[1]), Some(bytes_of(all[1])));
    // The model opened from the cache reads as the file does, columns from the strips.
    let view = cache.view().unwrap();
    let g = crate::open_cached(&cache, view).unwrap();
    let (t, u) = (f.tensor("exps").unwrap(), g.tensor("exps").unwrap());
    assert_eq!(
        g.copy_columns(u, 512..1024, 32..96).unwrap(),
        f.copy_columns(t, 512..1024, 32..96).unwrap()
    );
    let mat = g.tensor("mat").unwrap();
    assert_eq!(
        g.slice(g.row_range(mat, 3..9).unwrap()),
        f.slice(f.row_range(f.tensor("mat").unwrap(), 3..9).unwrap())
    );
    drop(g);
    drop(cache);

    // Reopened: every piece still there; one chunk damaged on disk is dropped.
    let part = ShardCache::dir_for(&shards, &m.root).join("m.gguf");
    let mut img = std::fs::read(&part).unwrap();
    let at = m.chunk_size as usize + 5;
    img[at] ^= 0xff;
    std::fs::write(&part, &img).unwrap();
    let again = ShardCache::open_existing(&ShardCache::dir_for(&shards, &m.root)).unwrap();
    assert!(!again.has(Piece::Chunk { part: 0, index: 1 }));
    assert_eq!(again.held().len(), all.len() - 1);
    // The damaged chunk is missing to a view: an error, not its bytes.
    let view = again.view().unwrap();
    let r = m.chunk_range(0, 1).unwrap();
    assert!(view.check(r.start as usize..r.end as usize).is_err());
}

/// A holder over the whole file that corrupts the first copy of `lie` and fails after
/// `fail_after` pieces.
struct Fake {
    name: &'static str,
    file: Arc<GgufFile>,
    m: Manifest,
    lie: Option<Piece>,
    fail_after: Option<usize>,
    holding: Holding,
    sent: usize,
}

impl Source for Fake {
    fn name(&self) -> String {
        self.name.into()
    }
    fn manifest(&mut self, _: &str) -> Result<Vec<u8>, String> {
        Ok(serde_json::to_vec(&self.m).unwrap())
    }
    fn holding(&mut self) -> Result<Holding, String> {
        Ok(self.holding.clone())
    }
    fn fetch(
        &mut self,
        pieces: &[Piece],
        got: &(dyn Fn(Piece, &[u8]) -> bool + Sync),
    ) -> Result<(), String> {
        for &p in pieces {
            if self.fail_after.is_some_and(|n| self.sent >= n) {
                return Err("link lost".into());
            }
            self.sent += 1;
            let mut b = match p {
                Piece::Chunk { part, index } => {
                    let r = self.m.chunk_range(part as usize, index as u64).unwrap();
                    self.file.slice(r.start as usize..r.end as usize).to_vec()
                }
                Piece::Strip { set, index } => {
                    crate::cache::strip_from_file(&self.m, &self.file, set, index).unwrap()
                }
            };
            if self.lie == Some(p) {
                self.lie = None;
                b[0] ^= 1;
            }
            if !got(p, &b) {
                return Ok(());
            }
        }
        Ok(())
    }
}

#[test]
fn fetches_spread_over_holders_and_survive_liars_and_lost_links() {
    let dir = tempfile::tempdir().unwrap();
    let (_, f) = model(dir.path());
    let f = Arc::new(f);
    let m = Manifest::build(&f);
    let cache = ShardCache::open(&dir.path().join("shards"), m.clone()).unwrap();
    let wanted: BTreeSet<Piece> = (0..m.parts[0].chunks.0.len() as u32)
        .map(|index| Piece::Chunk { part: 0, index })
        .chain((0..4).map(|index| Piece::Strip { set: 0, index }))
        .collect();
    let fake = |name, lie, fail_after| {
        Box::new(Fake {
            name,
            file: f.clone(),
            m: m.clone(),
            lie,
            fail_after,
            holding: Holding::All,
            sent: 0,
        }) as Box<dyn Source>
    };
    let first = *wanted.iter().next().unwrap();
    // "b" lies about the first piece it sends; "c" loses its link after two pieces.
    let mut sources = vec![
        fake("a", None, None),
        fake("b", Some(first), None),
        fake("c", None, Some(2)),
    ];
    // Give "b" the first piece: it has the least load once "a" has taken its first.
    let report = fetch(&cache, &wanted, &mut sources, &|_, _| {}).unwrap();
    assert!(wanted.iter().all(|p| cache.has(*p)));
    let by = |n: &str| report.sources.iter().find(|s| s.name == n).unwrap().clone();
    assert!(by("a").pieces > 0 && by("b").pieces > 0, "{report:?}");
    assert_eq!(by("c").pieces, 2);
    assert!(by("c").failed.is_some());
    assert_eq!(report.fetched_bytes, report.wanted_bytes);
    // Everything held: nothing is fetched.
    let again = fetch(&cache, &wanted, &mut sources, &|_, _| {}).unwrap();
    assert_eq!((again.already, again.fetched_bytes), (wanted.len(), 0));
    // No holder of a piece: the error names how many are orphaned.
    let empty = ShardCache::open(&dir.path().join("other"), m.clone()).unwrap();
    let mut none = vec![Box::new(Fake {
        name: "n",
        file: f.clone(),
        m: m.clone(),
        lie: None,
        fail_after: None,
        holding: Holding::Some(Default::default()),
        sent: 0,
    }) as Box<dyn Source>];
    let err = fetch(&empty, &wanted, &mut none, &|_, _| {}).unwrap_err();
    assert!(err.contains("no working holder"), "{err}");
}

#[test]
fn a_streamed_manifest_equals_one_built_from_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let (p, f) = model(dir.path());
    let whole = std::fs::read(&p).unwrap();
    // Odd-sized pieces, so chunk and tensor edges fall inside them.
    let m = crate::stream::build_streaming(&f, |_, sink| {
        for c in whole.chunks(7777) {
            sink(c);
        }
        Ok(())
    })
    .unwrap();
    assert_eq!(m, Manifest::build(&f));
    // A stream cut short is named.
    let err = crate::stream::build_streaming(&f, |_, sink| {
        sink(&whole[..1000]);
        Ok(())
    })
    .unwrap_err();
    assert!(err.contains("streamed 1000"), "{err}");
}

#[test]
fn eviction_takes_the_least_recently_used_model_and_never_the_one_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let shards = dir.path().join("shards");
    let mut roots = Vec::new();
    for k in 0..3u8 {
        let sub = dir.path().join(format!("m{k}"));
        std::fs::create_dir_all(&sub).unwrap();
        let (_, f) = model(&sub);
        // Three different models: the first byte of their norm differs.
        let mut m = Manifest::build(&f);
        m.parts[0].chunks.0[0][0] = k;
        m.root = crate::manifest::hex(&m.compute_root());
        let c = ShardCache::open(&shards, m.clone()).unwrap();
        let r = m.chunk_range(0, 1).unwrap();
        // Store a chunk so each takes room on disk (its hash is the real one).
        c.put(
            Piece::Chunk { part: 0, index: 1 },
            f.slice(r.start as usize..r.end as usize),
        )
        .unwrap();
        roots.push(m.root.clone());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let listed = crate::cache::list(&shards);
    assert_eq!(
        listed.iter().map(|e| e.root.clone()).collect::<Vec<_>>(),
        roots,
        "least recently used first"
    );
    let each = listed[0].disk_bytes;
    assert!(each >= MIN_CHUNK);
    // Room for about two: the oldest goes, unless it is the one in use.
    let gone = crate::cache::evict(&shards, 2 * each + each / 2, &roots[0]);
    assert_eq!(
        gone.iter().map(|e| &e.root).collect::<Vec<_>>(),
        [&roots[1]]
    );
    let left: Vec<String> = crate::cache::list(&shards)
        .into_iter()
        .map(|e| e.root)
        .collect();
    assert_eq!(left, [roots[0].clone(), roots[2].clone()]);
}

#[test]
fn strips_cut_off_by_a_kill_are_trimmed_and_written_again() {
    let dir = tempfile::tempdir().unwrap();
    let (_, f) = model(dir.path());
    let m = Manifest::build(&f);
    let shards = dir.path().join("shards");
    let strip = |index| Piece::Strip { set: 1, index };
    let bytes = |index| crate::cache::strip_from_file(&m, &f, 1, index).unwrap();
    {
        let c = ShardCache::open(&shards, m.clone()).unwrap();
        c.put(strip(0), &bytes(0)).unwrap();
        c.put(strip(1), &bytes(1)).unwrap();
    }
    // A kill mid-write: half a strip past the logged ones, no log line for it.
    let sdir = ShardCache::dir_for(&shards, &m.root);
    let mut raw = std::fs::read(sdir.join("strips.bin")).unwrap();
    let logged = raw.len();
    raw.extend_from_slice(&bytes(2)[..100]);
    std::fs::write(sdir.join("strips.bin"), &raw).unwrap();
    let c = ShardCache::open(&shards, m.clone()).unwrap();
    assert!(c.has(strip(0)) && c.has(strip(1)) && !c.has(strip(2)));
    assert_eq!(
        std::fs::metadata(sdir.join("strips.bin")).unwrap().len() as usize,
        logged
    );
    c.put(strip(2), &bytes(2)).unwrap();
    for i in 0..3 {
        assert_eq!(c.get(strip(i)), Some(bytes(i)));
    }
    // A second process cannot open the same cache while this one has it.
    let err = ShardCache::open(&shards, m.clone()).err().unwrap();
    assert!(err.contains("in use"), "{err}");
}
