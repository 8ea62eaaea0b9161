//! Minimal NumPy `.npy` (v1.0) writer for float32 matrices, for checking logits outside q4moe.

use std::io::Write;
use std::path::Path;

pub fn write_f32_matrix(path: &Path, rows: &[Vec<f32>], cols: usize) -> anyhow::Result<()> {
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({}, {cols}), }}", rows.len());
    // Magic (6) + version (2) + length (2) + header + newline, padded to a multiple of 64.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.div_ceil(64) * 64 - unpadded));
    header.push('\n');
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    f.write_all(b"\x93NUMPY\x01\x00")?;
    f.write_all(&(header.len() as u16).to_le_bytes())?;
    f.write_all(header.as_bytes())?;
    for r in rows {
        anyhow::ensure!(r.len() == cols, "logits row of {} values, expected {cols}", r.len());
        for v in r {
            f.write_all(&v.to_le_bytes())?;
        }
    }
    f.flush()?;
    Ok(())
}
