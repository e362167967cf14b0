//! The rule that keeps one of several timed candidates: the fastest, unless it beats the
//! first (the fixed guess) by no more than the timing noise, since on a shared machine a
//! tie would otherwise be decided by chance.

/// The candidate of `timed` to keep, by `rate` (higher is faster); None if `timed` is
/// empty.
pub(crate) fn fastest_unless_noise<T>(
    timed: &[T],
    rate: impl Fn(&T) -> f64,
    noise: f64,
) -> Option<&T> {
    let first = timed.first()?;
    let best = timed.iter().max_by(|a, b| rate(a).total_cmp(&rate(b)))?;
    Some(if rate(best) > rate(first) * (1.0 + noise) {
        best
    } else {
        first
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_win_within_the_noise_keeps_the_guess() {
        let keep = |rates: &[f64]| fastest_unless_noise(rates, |r| *r, 0.03).copied();
        assert_eq!(keep(&[]), None);
        assert_eq!(keep(&[10.0, 10.2, 9.0]), Some(10.0));
        assert_eq!(keep(&[10.0, 10.4, 11.0]), Some(11.0));
        assert_eq!(keep(&[10.0, 5.0]), Some(10.0));
    }
}
