//! The ggml tensor element types a GGUF file can name, and how many bytes a tensor of
//! each type occupies. Sizes follow `ggml/src/ggml-common.h` (the block structs and
//! their `static_assert`s), which define the file layout.

use std::fmt;

/// A ggml element type. Quantized types store `block_size` elements in `type_size`
/// bytes; plain types have a block of one element.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    Iq2Xxs,
    Iq2Xs,
    Iq3Xxs,
    Iq1S,
    Iq4Nl,
    Iq3S,
    Iq2S,
    Iq4Xs,
    I8,
    I16,
    I32,
    I64,
    F64,
    Iq1M,
    Bf16,
    Tq1_0,
    Tq2_0,
    Mxfp4,
    Nvfp4,
    Q1_0,
}

/// (type, file id, name, elements per block, bytes per block)
const TABLE: &[(GgmlType, u32, &str, u64, u64)] = &[
    (GgmlType::F32, 0, "F32", 1, 4),
    (GgmlType::F16, 1, "F16", 1, 2),
    (GgmlType::Q4_0, 2, "Q4_0", 32, 18),
    (GgmlType::Q4_1, 3, "Q4_1", 32, 20),
    // 4 and 5 were Q4_2 and Q4_3, removed from ggml.
    (GgmlType::Q5_0, 6, "Q5_0", 32, 22),
    (GgmlType::Q5_1, 7, "Q5_1", 32, 24),
    (GgmlType::Q8_0, 8, "Q8_0", 32, 34),
    // Two f16 (d, s) and 32 int8: 36. gguf-py's table still says 40 (f32 d, s), which
    // predates the switch to f16; ggml's static_assert is authoritative.
    (GgmlType::Q8_1, 9, "Q8_1", 32, 36),
    (GgmlType::Q2K, 10, "Q2_K", 256, 84),
    (GgmlType::Q3K, 11, "Q3_K", 256, 110),
    (GgmlType::Q4K, 12, "Q4_K", 256, 144),
    (GgmlType::Q5K, 13, "Q5_K", 256, 176),
    (GgmlType::Q6K, 14, "Q6_K", 256, 210),
    (GgmlType::Q8K, 15, "Q8_K", 256, 292),
    (GgmlType::Iq2Xxs, 16, "IQ2_XXS", 256, 66),
    (GgmlType::Iq2Xs, 17, "IQ2_XS", 256, 74),
    (GgmlType::Iq3Xxs, 18, "IQ3_XXS", 256, 98),
    (GgmlType::Iq1S, 19, "IQ1_S", 256, 50),
    (GgmlType::Iq4Nl, 20, "IQ4_NL", 32, 18),
    (GgmlType::Iq3S, 21, "IQ3_S", 256, 110),
    (GgmlType::Iq2S, 22, "IQ2_S", 256, 82),
    (GgmlType::Iq4Xs, 23, "IQ4_XS", 256, 136),
    (GgmlType::I8, 24, "I8", 1, 1),
    (GgmlType::I16, 25, "I16", 1, 2),
    (GgmlType::I32, 26, "I32", 1, 4),
    (GgmlType::I64, 27, "I64", 1, 8),
    (GgmlType::F64, 28, "F64", 1, 8),
    (GgmlType::Iq1M, 29, "IQ1_M", 256, 56),
    (GgmlType::Bf16, 30, "BF16", 1, 2),
    // 31-33 were the interleaved Q4_0_4_4/4_8/8_8, no longer allowed in files.
    (GgmlType::Tq1_0, 34, "TQ1_0", 256, 54),
    (GgmlType::Tq2_0, 35, "TQ2_0", 256, 66),
    // 36-38 were the interleaved IQ4_NL variants.
    (GgmlType::Mxfp4, 39, "MXFP4", 32, 17),
    // The two newest, from gguf-py's constants (block layouts not needed to read sizes).
    (GgmlType::Nvfp4, 40, "NVFP4", 64, 36),
    (GgmlType::Q1_0, 41, "Q1_0", 128, 18),
];

impl GgmlType {
    /// All types, in file id order.
    pub fn all() -> impl Iterator<Item = GgmlType> {
        TABLE.iter().map(|row| row.0)
    }

    fn row(self) -> &'static (GgmlType, u32, &'static str, u64, u64) {
        // Every variant has exactly one row (checked by a unit test), so the search
        // always succeeds; the fallback only keeps this total without a panic path.
        TABLE.iter().find(|row| row.0 == self).unwrap_or(&TABLE[0])
    }

    /// The type with this id in a GGUF tensor info, if ggml knows it.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        TABLE.iter().find(|row| row.1 == id).map(|row| row.0)
    }

    /// The type with this name (`Q4_K`, `F32`; case-insensitive).
    pub fn from_name(name: &str) -> Option<GgmlType> {
        TABLE
            .iter()
            .find(|row| row.2.eq_ignore_ascii_case(name))
            .map(|row| row.0)
    }

    /// The id GGUF stores for this type.
    pub fn id(self) -> u32 {
        self.row().1
    }

    /// ggml's name for this type, upper case as gguf-py prints it (`Q4_K`).
    pub fn name(self) -> &'static str {
        self.row().2
    }

    /// Elements per block.
    pub fn block_size(self) -> u64 {
        self.row().3
    }

    /// Bytes per block.
    pub fn type_size(self) -> u64 {
        self.row().4
    }

    /// Whether elements are stored in multi-element blocks.
    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// Bytes of one row of `ne0` elements, or `None` if `ne0` is not a whole number of
    /// blocks (ggml refuses such tensors) or the size overflows.
    pub fn row_bytes(self, ne0: u64) -> Option<u64> {
        if ne0 % self.block_size() != 0 {
            return None;
        }
        (ne0 / self.block_size()).checked_mul(self.type_size())
    }

    /// Bytes of a tensor with ggml dimensions `dims` (`ne[0]` first, the contiguous
    /// one), as `ggml_nbytes` computes it for a contiguous tensor. `None` if `ne[0]`
    /// is not a whole number of blocks or the size overflows.
    pub fn tensor_bytes(self, dims: &[u64]) -> Option<u64> {
        let (ne0, rest) = match dims.split_first() {
            Some(split) => split,
            // A scalar: one element.
            None => (&1, &[][..]),
        };
        let row = self.row_bytes(*ne0)?;
        rest.iter().try_fold(row, |acc, &d| acc.checked_mul(d))
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_has_one_row_and_unique_ids_and_names() {
        for (i, row) in TABLE.iter().enumerate() {
            for other in &TABLE[i + 1..] {
                assert_ne!(row.0, other.0);
                assert_ne!(row.1, other.1);
                assert_ne!(row.2, other.2);
            }
            assert_eq!(GgmlType::from_id(row.1), Some(row.0));
            assert_eq!(GgmlType::from_name(row.2), Some(row.0));
            assert_eq!(row.0.name(), row.2);
        }
        assert_eq!(GgmlType::all().count(), TABLE.len());
    }

    #[test]
    fn sizes_match_ggml_blocks() {
        assert_eq!(GgmlType::Q4_1.tensor_bytes(&[576, 576]), Some(207_360));
        assert_eq!(GgmlType::Q8_0.tensor_bytes(&[576, 49152]), Some(30_081_024));
        assert_eq!(GgmlType::F32.tensor_bytes(&[576]), Some(2304));
        assert_eq!(GgmlType::Q4K.tensor_bytes(&[256, 2]), Some(288));
        assert_eq!(GgmlType::F32.tensor_bytes(&[]), Some(4));
        assert_eq!(GgmlType::Q4_0.tensor_bytes(&[33]), None);
        assert_eq!(GgmlType::F32.tensor_bytes(&[u64::MAX, 2]), None);
        assert_eq!(GgmlType::from_id(4), None);
        assert_eq!(GgmlType::from_id(1000), None);
    }
}
