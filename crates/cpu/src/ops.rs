//! Small vector operations of the forward pass, in f32 as the reference computes them.

pub fn rmsnorm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let scale = inv_rms(x, eps);
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * scale * w;
    }
}

/// 1 / sqrt(mean(x^2) + eps), RMSNorm's scale.
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    1.0 / (ms + eps).sqrt()
}

/// In-place RMSNorm of each `head_dim` slice (Qwen3's q_norm / k_norm): `rmsnorm`'s operations.
pub fn rmsnorm_heads(x: &mut [f32], weight: &[f32], eps: f32) {
    for head in x.chunks_exact_mut(weight.len()) {
        let scale = inv_rms(head, eps);
        head.iter_mut()
            .zip(weight)
            .for_each(|(v, &w)| *v = *v * scale * w);
    }
}

/// RoPE's angles as Hugging Face computes them in f32: the inverse frequencies once (per model),
/// then each position's (sin, cos) once for its queries and keys of every layer.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    pub fn new(head_dim: usize, theta: f32) -> Rope {
        let inv_freq = (0..head_dim / 2)
            .map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32))
            .collect();
        Rope { inv_freq }
    }

    /// `pos`'s (sin, cos) of each of a head's pairs, appended to `out`.
    pub fn angles(&self, pos: usize, out: &mut Vec<(f32, f32)>) {
        out.extend(self.inv_freq.iter().map(|&f| (pos as f32 * f).sin_cos()));
    }
}

/// Rotate-half (NeoX) RoPE on each head of `x` by one position's `angles` (`Rope::angles`:
/// a head is twice as long).
pub fn rope_neox(x: &mut [f32], angles: &[(f32, f32)]) {
    let half = angles.len();
    for head in x.chunks_exact_mut(2 * half) {
        for (i, &(sin, cos)) in angles.iter().enumerate() {
            let (a, b) = (head[i], head[i + half]);
            head[i] = a * cos - b * sin;
            head[i + half] = b * cos + a * sin;
        }
    }
}

pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    x.iter_mut().for_each(|v| *v /= sum);
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Indices of the `k` largest values, largest first (lowest index first on ties).
pub fn top_k(x: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_at_position_zero_is_identity_and_preserves_norm() {
        let x: Vec<f32> = (0..16).map(|i| (i as f32 * 0.37).sin() + 0.1).collect();
        let mut y = x.clone();
        let at = |pos, theta| {
            let mut a = Vec::new();
            Rope::new(8, theta).angles(pos, &mut a);
            a
        };
        rope_neox(&mut y, &at(0, 1e6));
        assert_eq!(x, y);
        rope_neox(&mut y, &at(17, 1e4));
        let n = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
        assert!((n(&x) - n(&y)).abs() < 1e-4);
        assert_ne!(x, y);
    }

    #[test]
    fn top_k_orders_and_breaks_ties_by_index() {
        assert_eq!(top_k(&[0.1, 0.5, 0.5, 0.9, -1.0], 3), vec![3, 1, 2]);
    }
}

/// a . b in a fixed order: eight running sums (lane i takes elements i, i + 8, ..), combined
/// pairwise, then the tail. Eight independent sums let the compiler use vector registers where
/// one running sum is a chain of dependent adds; the order is the same on every path, so
/// attention stays bit-identical alone and in a batch.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}
