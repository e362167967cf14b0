//! Attention's tile sets (`grid::TileSet`) timed side by side on this CPU, the fastest
//! kept: both give the same bits, so only speed decides, and a tile that wins on one x86
//! core can lose on another.

use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::grid::{self, TileSet};

/// One tile set's measured speed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TilesTimed {
    pub set: TileSet,
    /// Multiply-adds x 2 per second over scores and value sums.
    pub flops_per_s: f64,
}

/// The tile sets timed and the one kept.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TilesChoice {
    pub timed: Vec<TilesTimed>,
    pub chosen: TileSet,
}

/// Values per cached row in the timing: a common head width.
const WIDTH: usize = 128;
/// Cached rows read: one KV head's 1,024 positions, keys and values 512 KiB each (in the
/// caches, as the rows just prefetched are).
const ROWS: usize = 1024;
/// Rows per block, as attention cuts them.
const BLOCK: usize = 32;
/// Queries per group: a decode step's GQA group, and a prefill's run of tokens by heads.
const GROUPS: [usize; 2] = [4, 32];
/// Passes over the rows a timing takes: a few milliseconds, well above the timer's grain
/// and an interrupt's cost.
const REPEAT: usize = 8;

/// Times every tile set this CPU runs over `rounds` alternating rounds (best of each)
/// on attention's work: per block of rows, a group's score grid then its value sums.
/// The first candidate (the default) is kept unless another beats it by more than
/// `noise` (relative), so a tie is not decided by chance. None where no SIMD tiles run.
pub fn time_tiles(rounds: usize, noise: f64) -> Option<TilesChoice> {
    let sets = grid::candidates();
    if sets.is_empty() {
        return None;
    }
    let value = |i: usize| ((i * 7919 % 113) as f32 / 113.0 - 0.5) * 0.25;
    let keys: Vec<f32> = (0..ROWS * WIDTH).map(value).collect();
    let values: Vec<f32> = (0..ROWS * WIDTH).map(|i| value(i + 5)).collect();
    let krows: Vec<&[f32]> = keys.chunks_exact(WIDTH).collect();
    let vrows: Vec<&[f32]> = values.chunks_exact(WIDTH).collect();
    let gmax = GROUPS[GROUPS.len() - 1];
    let queries: Vec<f32> = (0..gmax * WIDTH).map(|i| value(i + 11)).collect();
    let qs: Vec<&[f32]> = queries.chunks_exact(WIDTH).collect();
    let mut scores = vec![0f32; gmax * BLOCK];
    let mut outs = vec![0f32; gmax * WIDTH];
    let mut pass = |set: TileSet| {
        let t = Instant::now();
        for g in GROUPS.iter().flat_map(|&g| [g; REPEAT]) {
            outs.fill(0.0);
            let mut ys: Vec<&mut [f32]> = outs.chunks_exact_mut(WIDTH).take(g).collect();
            for (k, v) in krows.chunks(BLOCK).zip(vrows.chunks(BLOCK)) {
                grid::dot_grid_on(set, &qs[..g], k, &mut scores, BLOCK);
                // Small weights, as a softmax gives: the sums stay finite.
                for s in &mut scores[..g * BLOCK] {
                    *s *= 1e-3;
                }
                grid::axpy_grid_on(set, &scores, BLOCK, v, &mut ys);
            }
        }
        std::hint::black_box(&outs);
        t.elapsed().as_secs_f64()
    };
    let per_pass: usize = GROUPS.iter().map(|&g| 4 * g * ROWS * WIDTH).sum();
    let flops = (REPEAT * per_pass) as f64;
    // One untimed pass each: caches and clocks settle before any candidate is timed.
    for &s in sets {
        pass(s);
    }
    let mut best = vec![f64::INFINITY; sets.len()];
    for _ in 0..rounds.max(1) {
        for (b, &s) in best.iter_mut().zip(sets) {
            *b = b.min(pass(s));
        }
    }
    let timed: Vec<TilesTimed> = sets
        .iter()
        .zip(&best)
        .map(|(&set, &secs)| TilesTimed {
            set,
            flops_per_s: flops / secs,
        })
        .collect();
    let chosen = crate::keep::fastest_unless_noise(&timed, |t| t.flops_per_s, noise)?.set;
    Some(TilesChoice { timed, chosen })
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOISE: f64 = 0.03;

    #[test]
    fn every_tile_set_here_is_timed_and_the_choice_is_one_of_them() {
        let Some(c) = time_tiles(1, NOISE) else {
            assert!(grid::candidates().is_empty());
            return;
        };
        let sets: Vec<TileSet> = c.timed.iter().map(|t| t.set).collect();
        assert_eq!(sets, grid::candidates());
        assert!(sets.contains(&c.chosen));
        assert!(c.timed.iter().all(|t| t.flops_per_s > 0.0));
        let best = c.timed.iter().map(|t| t.flops_per_s).fold(0.0, f64::max);
        let rate = |s: TileSet| c.timed.iter().find(|t| t.set == s).unwrap().flops_per_s;
        assert!(
            rate(c.chosen) == best
                || (c.chosen == sets[0] && best <= rate(sets[0]) * (1.0 + NOISE)),
            "{c:?}"
        );
    }
}
