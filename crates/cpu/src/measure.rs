//! The machine's copy bandwidth, what `q4moe bench` sets a step's bytes against (the CUDA
//! backend measures its device's the same way: one buffer copied into another).

use std::time::Instant;

use crate::par;

/// GB/s of bytes read plus bytes written (CUDA's figure counts both too) copying `bytes`
/// between two buffers with the pool's threads: the median of `reps` copies after one warm-up.
pub fn copy_bandwidth(bytes: usize, reps: usize) -> f64 {
    let bytes = bytes.max(1 << 12);
    // Random-looking bytes (never zeros: a zero page may be shared, not read).
    let src: Vec<u8> = (0..bytes)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761) as u8 | 1)
        .collect();
    let mut dst = vec![0u8; bytes];
    let copy = |dst: &mut [u8]| {
        par::guided_mut(dst, 1 << 16, |start, piece| {
            piece.copy_from_slice(&src[start..start + piece.len()])
        })
    };
    copy(&mut dst);
    let mut gbs: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let t0 = Instant::now();
            copy(&mut dst);
            2.0 * bytes as f64 / t0.elapsed().as_secs_f64().max(1e-9) / 1e9
        })
        .collect();
    std::hint::black_box(&dst);
    gbs.sort_by(f64::total_cmp);
    gbs[gbs.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::copy_bandwidth;

    #[test]
    fn the_copy_bandwidth_is_a_positive_finite_rate() {
        let gbs = copy_bandwidth(1 << 20, 3);
        assert!(gbs.is_finite() && gbs > 0.0, "{gbs}");
    }
}
