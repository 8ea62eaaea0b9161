use q4moe_model::Config;

/// One session's keys and values, held by the backend, never by the layers.
pub struct KvCache {
    /// Per layer: [len, kv_dim] keys after k_norm and RoPE.
    pub k: Vec<Vec<f32>>,
    /// Per layer: [len, kv_dim] values.
    pub v: Vec<Vec<f32>>,
    kv_dim: usize,
}

impl KvCache {
    pub fn new(c: &Config) -> Self {
        KvCache {
            k: vec![Vec::new(); c.n_layer],
            v: vec![Vec::new(); c.n_layer],
            kv_dim: c.kv_dim(),
        }
    }

    /// Positions held (every layer holds the same number once a token has finished).
    pub fn len(&self) -> usize {
        self.k.last().map_or(0, |k| k.len() / self.kv_dim)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn truncate(&mut self, len: usize) {
        for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
            buf.truncate(len * self.kv_dim);
        }
    }
}
