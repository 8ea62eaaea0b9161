use q4moe_model::backend::KvType;
use q4moe_model::Config;

/// One session's keys and values, held by the backend, never by the layers.
pub struct KvCache {
    /// Per layer: [len, kv_dim] keys after k_norm and RoPE.
    pub k: Vec<Vec<f32>>,
    /// Per layer: [len, kv_dim] values.
    pub v: Vec<Vec<f32>>,
    kv_dim: usize,
    /// Values are stored as f32 rounded to this type (what the GPU's cache holds), so both
    /// backends attend over the same numbers.
    kv_type: KvType,
}

impl KvCache {
    pub fn new(c: &Config, kv_type: KvType) -> Self {
        KvCache {
            k: vec![Vec::new(); c.n_layer],
            v: vec![Vec::new(); c.n_layer],
            kv_dim: c.kv_dim(),
            kv_type,
        }
    }

    /// Appends one position's keys and values to layer `li`, rounded to the cache's type.
    pub fn push(&mut self, li: usize, k: &[f32], v: &[f32]) {
        let t = self.kv_type;
        self.k[li].extend(k.iter().map(|&x| t.round(x)));
        self.v[li].extend(v.iter().map(|&x| t.round(x)));
    }

    /// Positions held (every layer holds the same number once a token has finished).
    pub fn len(&self) -> usize {
        self.k.last().map_or(0, |k| k.len() / self.kv_dim)
    }

    /// Bytes the cache's buffers take.
    pub fn bytes(&self) -> usize {
        let floats: usize = self.k.iter().chain(&self.v).map(Vec::capacity).sum();
        floats * std::mem::size_of::<f32>()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A copy of the first `len` positions (Backend::fork).
    pub fn prefix(&self, len: usize) -> KvCache {
        let n = len * self.kv_dim;
        let copy = |bufs: &[Vec<f32>]| bufs.iter().map(|b| b[..n.min(b.len())].to_vec()).collect();
        KvCache {
            k: copy(&self.k),
            v: copy(&self.v),
            ..*self
        }
    }

    pub fn truncate(&mut self, len: usize) {
        for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
            buf.truncate(len * self.kv_dim);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_rounds_to_the_cache_type() {
        let c = Config::tiny();
        let n = c.kv_dim();
        // f16 has 10 mantissa bits: 1 + 2^-12 rounds down to 1, 1 + 3 * 2^-12 up to 1 + 2^-10.
        let ulp = 2f32.powi(-12);
        let k: Vec<f32> = (0..n).map(|i| 1.0 + [1.0, 3.0][i % 2] * ulp).collect();
        let v: Vec<f32> = (0..n).map(|i| -3.0 - (i % 2) as f32 * 8.0 * ulp).collect(); // f16 steps 2^-9 in [2, 4)
        let mut f16 = KvCache::new(&c, KvType::F16);
        let mut f32 = KvCache::new(&c, KvType::F32);
        f16.push(0, &k, &v);
        f32.push(0, &k, &v);
        assert_eq!((&f32.k[0], &f32.v[0]), (&k, &v));
        for (i, &got) in f16.k[0].iter().enumerate() {
            assert_eq!(got, [1.0, 1.0 + 4.0 * ulp][i % 2], "key {i}");
        }
        assert_eq!(f16.v[0], v, "values that are f16 already stay exact");
    }
}
