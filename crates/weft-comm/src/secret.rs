//! Cluster secrets: a conservative strength estimate, the 128-bit floor that user-given
//! secrets must clear, and fresh random secrets that clear it with room to spare.

use rand::RngCore;

/// The least estimated entropy a cluster secret may have.
pub const MIN_SECRET_BITS: f64 = 128.0;

/// A conservative entropy estimate: length × log2 of the alphabet the characters' classes
/// imply (lowercase 26, uppercase 26, digits 10, anything else 33). A string of hex digits
/// only counts as drawn from 16 symbols (digits only, from 10), since that is how such
/// secrets are usually made. It assumes each character is chosen at random, so it can only
/// overrate a secret a person made up, never underrate a generated one.
pub fn secret_entropy_bits(s: &str) -> f64 {
    let n = s.chars().count();
    if n == 0 {
        return 0.0;
    }
    let alphabet = if s.chars().all(|c| c.is_ascii_digit()) {
        10
    } else if s.chars().all(|c| c.is_ascii_hexdigit()) {
        16
    } else {
        let has = |f: fn(&char) -> bool| s.chars().any(|c| f(&c));
        let mut a = 0;
        if has(|c| c.is_ascii_lowercase()) {
            a += 26;
        }
        if has(|c| c.is_ascii_uppercase()) {
            a += 26;
        }
        if has(|c| c.is_ascii_digit()) {
            a += 10;
        }
        if has(|c| !c.is_ascii_alphanumeric()) {
            a += 33;
        }
        a
    };
    n as f64 * f64::from(alphabet).log2()
}

/// Refuses a secret whose estimated entropy is under [`MIN_SECRET_BITS`].
pub fn check_secret(s: &str) -> Result<(), String> {
    let bits = secret_entropy_bits(s);
    if bits < MIN_SECRET_BITS {
        return Err(format!(
            "the cluster secret is too weak: an estimated {bits:.0} bits of entropy, under \
             the floor of {MIN_SECRET_BITS:.0} bits; run `weft secret` to make a strong one"
        ));
    }
    Ok(())
}

/// A fresh random cluster secret: 32 bytes from the thread's CSPRNG as 64 hex digits
/// (256 bits).
pub fn random_secret() -> String {
    let mut b = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_and_guessable_secrets_are_refused() {
        for s in [
            "",
            "a",
            "abcd",
            "password123",
            "s3cret",
            "right",
            "correct horse",
        ] {
            let e = check_secret(s).unwrap_err();
            assert!(
                e.contains("128 bits") && e.contains("weft secret"),
                "{s}: {e}"
            );
        }
        // 32 hex digits (the old generated secrets) are exactly 128 bits.
        assert_eq!(secret_entropy_bits(&"0123456789abcdef".repeat(2)), 128.0);
        assert!(check_secret(&"0123456789abcdef".repeat(2)).is_ok());
        assert!(check_secret(&"0123456789abcde".repeat(2)).is_err());
    }

    #[test]
    fn classes_set_the_alphabet() {
        assert_eq!(secret_entropy_bits("0000"), 4.0 * 10f64.log2());
        assert_eq!(secret_entropy_bits("abcd"), 16.0);
        assert_eq!(secret_entropy_bits("xyz"), 3.0 * 26f64.log2());
        assert_eq!(secret_entropy_bits("aZ9!"), 4.0 * 95f64.log2());
        assert_eq!(secret_entropy_bits("é"), 33f64.log2());
    }

    #[test]
    fn random_secrets_pass_and_differ() {
        let (a, b) = (random_secret(), random_secret());
        assert_eq!(a.len(), 64);
        assert_eq!(secret_entropy_bits(&a), 256.0);
        assert!(check_secret(&a).is_ok());
        assert_ne!(a, b);
    }
}
