//! The pseudo-random token stream every bench and check feeds (xorshift, fixed seed), so
//! that runs and layouts see the same tokens, as llama-bench feeds random ones.

/// An endless, repeatable stream of token ids below `n_vocab`.
pub fn pseudo_random_tokens(n_vocab: u64) -> impl FnMut() -> u32 {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let n_vocab = n_vocab.max(1);
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n_vocab) as u32
    }
}
