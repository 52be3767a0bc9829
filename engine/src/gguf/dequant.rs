//! ggml tensor types and dequantization of F32, F16, BF16, Q8_0, Q4_0 and Q4_1.

use half::{bf16, f16};

/// A ggml tensor type id as stored in GGUF.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GgmlType(pub u32);

impl GgmlType {
    pub const F32: GgmlType = GgmlType(0);
    pub const F16: GgmlType = GgmlType(1);
    pub const Q4_0: GgmlType = GgmlType(2);
    pub const Q4_1: GgmlType = GgmlType(3);
    pub const Q8_0: GgmlType = GgmlType(8);
    pub const BF16: GgmlType = GgmlType(30);

    /// The ggml name of the type (e.g. `Q4_K`), or `type N` when unknown.
    pub fn name(self) -> String {
        let n = match self.0 {
            0 => "F32",
            1 => "F16",
            2 => "Q4_0",
            3 => "Q4_1",
            6 => "Q5_0",
            7 => "Q5_1",
            8 => "Q8_0",
            9 => "Q8_1",
            10 => "Q2_K",
            11 => "Q3_K",
            12 => "Q4_K",
            13 => "Q5_K",
            14 => "Q6_K",
            15 => "Q8_K",
            16 => "IQ2_XXS",
            17 => "IQ2_XS",
            18 => "IQ3_XXS",
            19 => "IQ1_S",
            20 => "IQ4_NL",
            21 => "IQ3_S",
            22 => "IQ2_S",
            23 => "IQ4_XS",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            29 => "IQ1_M",
            30 => "BF16",
            34 => "TQ1_0",
            35 => "TQ2_0",
            39 => "MXFP4",
            other => return format!("type {other}"),
        };
        n.to_string()
    }

    /// (elements per block, bytes per block), for the types whose layout is known.
    pub fn block(self) -> Option<(u64, u64)> {
        Some(match self.0 {
            0 => (1, 4),
            1 => (1, 2),
            2 => (32, 18),
            3 => (32, 20),
            6 => (32, 22),
            7 => (32, 24),
            8 => (32, 34),
            9 => (32, 36),
            10 => (256, 84),
            11 => (256, 110),
            12 => (256, 144),
            13 => (256, 176),
            14 => (256, 210),
            15 => (256, 292),
            20 => (32, 18),
            23 => (256, 136),
            24 => (1, 1),
            25 => (1, 2),
            26 => (1, 4),
            27 => (1, 8),
            28 => (1, 8),
            30 => (1, 2),
            _ => return None,
        })
    }

    /// Byte length of `n` elements of this type.
    pub fn byte_len(self, n: u64) -> Option<u64> {
        let (be, bb) = self.block()?;
        Some(n.div_ceil(be) * bb)
    }

    /// Whether [`dequantize`] handles this type.
    pub fn is_supported(self) -> bool {
        matches!(self.0, 0 | 1 | 2 | 3 | 8 | 30)
    }
}

fn h(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// Dequantizes `n` elements of type `ty` from `bytes`. Errors (as a message) for an
/// unsupported type or a byte length that does not match.
pub fn dequantize(ty: GgmlType, bytes: &[u8], n: usize) -> Result<Vec<f32>, String> {
    let want = ty
        .byte_len(n as u64)
        .ok_or_else(|| format!("unknown type {}", ty.name()))? as usize;
    if bytes.len() != want {
        return Err(format!(
            "{} bytes for {n} elements of {}, expected {want}",
            bytes.len(),
            ty.name()
        ));
    }
    if let Some((be, _)) = ty.block() {
        if n % be as usize != 0 {
            return Err(format!(
                "{n} elements is not a multiple of the {} block size {be}",
                ty.name()
            ));
        }
    }
    let mut out = Vec::with_capacity(n);
    match ty {
        GgmlType::F32 => out.extend(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
        GgmlType::F16 => out.extend(bytes.chunks_exact(2).map(h)),
        GgmlType::BF16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
        GgmlType::Q8_0 => {
            for blk in bytes.chunks_exact(34) {
                let d = h(&blk[0..2]);
                out.extend(blk[2..34].iter().map(|&q| (q as i8) as f32 * d));
            }
        }
        GgmlType::Q4_0 => {
            for blk in bytes.chunks_exact(18) {
                let d = h(&blk[0..2]);
                let qs = &blk[2..18];
                out.extend(qs.iter().map(|&q| ((q & 0x0f) as i32 - 8) as f32 * d));
                out.extend(qs.iter().map(|&q| ((q >> 4) as i32 - 8) as f32 * d));
            }
        }
        GgmlType::Q4_1 => {
            for blk in bytes.chunks_exact(20) {
                let d = h(&blk[0..2]);
                let m = h(&blk[2..4]);
                let qs = &blk[4..20];
                out.extend(qs.iter().map(|&q| (q & 0x0f) as f32 * d + m));
                out.extend(qs.iter().map(|&q| (q >> 4) as f32 * d + m));
            }
        }
        other => return Err(format!("type {} cannot be dequantized", other.name())),
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16b(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    #[test]
    fn f32_f16_bf16() {
        let b: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(dequantize(GgmlType::F32, &b, 2).unwrap(), vec![1.5, -2.0]);
        let b: Vec<u8> = [0.25f32, -3.0].iter().flat_map(|&x| f16b(x)).collect();
        assert_eq!(dequantize(GgmlType::F16, &b, 2).unwrap(), vec![0.25, -3.0]);
        let b: Vec<u8> = [0.5f32, 7.0]
            .iter()
            .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
            .collect();
        assert_eq!(dequantize(GgmlType::BF16, &b, 2).unwrap(), vec![0.5, 7.0]);
    }

    #[test]
    fn q8_0_block() {
        // d = 0.5, qs = -16..16 → values -8.0, -7.5, ..., 7.5
        let mut b = f16b(0.5).to_vec();
        b.extend((-16i8..16).map(|q| q as u8));
        let v = dequantize(GgmlType::Q8_0, &b, 32).unwrap();
        assert_eq!(v[0], -8.0);
        assert_eq!(v[1], -7.5);
        assert_eq!(v[16], 0.0);
        assert_eq!(v[31], 7.5);
    }

    #[test]
    fn q4_0_block() {
        // d = 2, byte j holds low nibble j (element j) and high nibble 15-j (element j+16).
        let mut b = f16b(2.0).to_vec();
        b.extend((0u8..16).map(|j| j | ((15 - j) << 4)));
        let v = dequantize(GgmlType::Q4_0, &b, 32).unwrap();
        for j in 0..16 {
            assert_eq!(v[j], (j as f32 - 8.0) * 2.0, "low nibble {j}");
            assert_eq!(v[j + 16], ((15 - j) as f32 - 8.0) * 2.0, "high nibble {j}");
        }
    }

    #[test]
    fn q4_1_block() {
        // d = 0.25, m = -1: x = q * 0.25 - 1
        let mut b = f16b(0.25).to_vec();
        b.extend(f16b(-1.0));
        b.extend((0u8..16).map(|j| j | (3 << 4)));
        let v = dequantize(GgmlType::Q4_1, &b, 32).unwrap();
        assert_eq!(v[0], -1.0);
        assert_eq!(v[15], 15.0 * 0.25 - 1.0);
        assert_eq!(v[16], 3.0 * 0.25 - 1.0);
        assert_eq!(v[31], 3.0 * 0.25 - 1.0);
    }

    #[test]
    fn two_blocks_and_errors() {
        let mut b = Vec::new();
        for d in [1.0f32, 3.0] {
            b.extend(f16b(d));
            b.extend(std::iter::repeat_n(1u8, 32));
        }
        let v = dequantize(GgmlType::Q8_0, &b, 64).unwrap();
        assert_eq!(v[0], 1.0);
        assert_eq!(v[63], 3.0);
        assert!(dequantize(GgmlType::Q8_0, &b[..40], 64).is_err());
        let e = dequantize(GgmlType(12), &[0u8; 144], 256).unwrap_err();
        assert!(e.contains("Q4_K"), "{e}");
    }
}
