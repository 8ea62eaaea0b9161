//! Minimal NumPy `.npy` (v1.0) writer for float32 matrices, for checking logits outside q4moe.

use std::io::Write;
use std::path::Path;

pub fn write_f32_matrix(path: &Path, rows: &[Vec<f32>], cols: usize) -> anyhow::Result<()> {
    let mut header = format!(
        "{{'descr': '<f4', 'fortran_order': False, 'shape': ({}, {cols}), }}",
        rows.len()
    );
    // Magic (6) + version (2) + length (2) + header + newline, padded to a multiple of 64.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.div_ceil(64) * 64 - unpadded));
    header.push('\n');
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    f.write_all(b"\x93NUMPY\x01\x00")?;
    f.write_all(&(header.len() as u16).to_le_bytes())?;
    f.write_all(header.as_bytes())?;
    for r in rows {
        anyhow::ensure!(
            r.len() == cols,
            "logits row of {} values, expected {cols}",
            r.len()
        );
        for v in r {
            f.write_all(&v.to_le_bytes())?;
        }
    }
    f.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_a_numpy_v1_header_and_little_endian_rows() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("l.npy");
        write_f32_matrix(&p, &[vec![1.5, -2.0, 3.25], vec![0.0, 7.0, -0.5]], 3).unwrap();
        let b = std::fs::read(&p).unwrap();
        assert_eq!(&b[..8], b"\x93NUMPY\x01\x00");
        let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
        assert_eq!(
            (10 + hlen) % 64,
            0,
            "header must pad the data to a 64-byte boundary"
        );
        let header = std::str::from_utf8(&b[10..10 + hlen]).unwrap();
        assert!(
            header.contains("'descr': '<f4'") && header.contains("'shape': (2, 3)"),
            "{header}"
        );
        let data: Vec<f32> = b[10 + hlen..]
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(data, vec![1.5, -2.0, 3.25, 0.0, 7.0, -0.5]);
        assert!(
            write_f32_matrix(&p, &[vec![1.0]], 3).is_err(),
            "a short row is an error"
        );
    }
}
