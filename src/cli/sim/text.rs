//! The tokens a synthetic decode reads embedding rows for: drawn as text draws them.
//!
//! Words in text follow Zipf's law (the word of frequency rank r appears with
//! probability proportional to 1/r), and so do the tokens of a subword vocabulary, near
//! enough: a decode reads the rows of "the", "," and " of" again and again, and most of
//! the vocabulary never. A policy that keeps the blocks holding the hot rows is right on
//! real text; one drawing every row once would call it wrong.
//!
//! Ranks map to rows by a fixed scatter (a multiplication by a prime, modulo the
//! vocabulary), so the frequent tokens' rows are spread over the table's blocks rather
//! than packed into its first: no locality beyond the words' own repetition is assumed.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Zipf's exponent for tokens of running text.
const ZIPF_EXPONENT: f64 = 1.0;
/// Odd, so that it is coprime with any power of two, and large enough to scatter ranks.
const SCATTER: u64 = 2_654_435_761;

/// Draws token rows of a vocabulary as running text uses them.
pub struct TextTokens {
    /// `cumulative[r]`: the probability of a rank at most r.
    cumulative: Vec<f64>,
    vocab: u64,
    rng: SmallRng,
}

impl TextTokens {
    /// Tokens of a vocabulary of `vocab` rows, drawn with their own generator from `seed`
    /// (so the router's picks are the same with or without them).
    pub fn new(vocab: u64, seed: u64) -> Self {
        let vocab = vocab.max(1);
        let mut total = 0.0;
        let mut cumulative: Vec<f64> = (1..=vocab)
            .map(|rank| {
                total += (rank as f64).powf(-ZIPF_EXPONENT);
                total
            })
            .collect();
        for value in &mut cumulative {
            *value /= total;
        }
        Self {
            cumulative,
            vocab,
            rng: SmallRng::seed_from_u64(seed ^ 0x7e47_7e47_7e47_7e47),
        }
    }

    /// The embedding row of the next token.
    pub fn next_row(&mut self) -> u64 {
        let draw: f64 = self.rng.gen();
        let rank = self.cumulative.partition_point(|&p| p < draw) as u64;
        rank.min(self.vocab - 1).wrapping_mul(SCATTER) % self.vocab
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frequent_rows_repeat_and_rare_ones_are_drawn_too() {
        let mut tokens = TextTokens::new(32_000, 11);
        let rows: Vec<u64> = (0..4096).map(|_| tokens.next_row()).collect();
        assert!(rows.iter().all(|&row| row < 32_000));
        let mut counts = std::collections::HashMap::new();
        for &row in &rows {
            *counts.entry(row).or_insert(0u32) += 1;
        }
        let top = *counts.values().max().unwrap();
        // Rank 1 has probability 1/H(32000), about 0.093: some 380 of 4096.
        assert!(
            (300..460).contains(&top),
            "most frequent row drawn {top} times"
        );
        // Half the draws are of ranks beyond ~180, so many rows appear once.
        let once = counts.values().filter(|&&n| n == 1).count();
        assert!(once > 500, "{once} rows drawn once");
    }

    #[test]
    fn the_same_seed_draws_the_same_text() {
        let mut a = TextTokens::new(1000, 5);
        let mut b = TextTokens::new(1000, 5);
        assert!((0..100).all(|_| a.next_row() == b.next_row()));
        let mut c = TextTokens::new(1000, 6);
        let mut a = TextTokens::new(1000, 5);
        assert!((0..100).any(|_| a.next_row() != c.next_row()));
    }
}
