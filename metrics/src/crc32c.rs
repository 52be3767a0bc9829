//! CRC-32C (Castagnoli), the checksum TFRecord framing uses, and TensorFlow's mask
//! over it.

/// The reflected Castagnoli polynomial.
const POLY: u32 = 0x82F6_3B78;

/// One entry per byte value, built at compile time.
const TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = i as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ POLY
            } else {
                crc >> 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

/// CRC-32C of `data` (`crc32c(b"123456789") == 0xE306_9283`, the check value).
pub fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc = TABLE[((crc ^ b as u32) & 0xFF) as usize] ^ (crc >> 8);
    }
    !crc
}

/// TFRecord's masked CRC-32C of `data`: rotated and offset so that a checksum stored
/// inside checksummed data does not checksum to a fixed value.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c(data);
    crc.rotate_right(15).wrapping_add(0xA282_EAD8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vectors() {
        // The check value of the CRC catalogue and the iSCSI test vectors (RFC 3720 B.4).
        assert_eq!(crc32c(b""), 0);
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xFFu8; 32]), 0x62A8_AB43);
        let ascending: Vec<u8> = (0..32).collect();
        assert_eq!(crc32c(&ascending), 0x46DD_794E);
        let descending: Vec<u8> = (0..32).rev().collect();
        assert_eq!(crc32c(&descending), 0x113F_DB5C);
    }

    #[test]
    fn the_mask_rotates_and_offsets() {
        assert_eq!(masked_crc32c(b""), 0xA282_EAD8);
        // 0xE3069283 rotated right by 15 is 0x2507C60D; plus the offset.
        assert_eq!(masked_crc32c(b"123456789"), 0xC78A_B0E5);
    }
}
