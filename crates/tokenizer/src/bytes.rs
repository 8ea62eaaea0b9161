//! GPT-2's byte-to-unicode table: byte-level BPE vocabularies spell every byte as a printable char.

use std::sync::OnceLock;

fn tables() -> &'static ([char; 256], std::collections::HashMap<char, u8>) {
    static T: OnceLock<([char; 256], std::collections::HashMap<char, u8>)> = OnceLock::new();
    T.get_or_init(|| {
        // Printable Latin-1 bytes keep their own code point; the rest are moved to 256.. in order.
        let printable = |b: u32| {
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b)
        };
        let mut fwd = ['\0'; 256];
        let mut next = 256u32;
        for b in 0..256u32 {
            let cp = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            fwd[b as usize] = char::from_u32(cp).expect("valid code point");
        }
        let back = fwd.iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
        (fwd, back)
    })
}

/// The char that spells byte `b` in a byte-level vocabulary (0x20 -> 'Ġ', 0x0A -> 'Ċ').
pub fn byte_to_unicode(b: u8) -> char {
    tables().0[b as usize]
}

/// Inverse of [`byte_to_unicode`]; `None` for chars outside the 256-char alphabet.
pub fn unicode_to_byte(c: char) -> Option<u8> {
    tables().1.get(&c).copied()
}

/// Spell raw bytes in the byte-level alphabet.
pub(crate) fn encode_bytes(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| byte_to_unicode(b)).collect()
}

/// Raw bytes of a vocabulary string, as the ByteLevel decoder does it: mapped when every char is in
/// the alphabet, otherwise the string's own UTF-8 (added tokens spelled outside the alphabet).
pub(crate) fn decode_piece(piece: &str) -> Vec<u8> {
    piece
        .chars()
        .map(unicode_to_byte)
        .collect::<Option<Vec<u8>>>()
        .unwrap_or_else(|| piece.as_bytes().to_vec())
}

pub(crate) fn in_alphabet(piece: &str) -> bool {
    piece.chars().all(|c| unicode_to_byte(c).is_some())
}
