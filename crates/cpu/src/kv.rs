//! Every session's keys and values, in pages of `PAGE` positions from one pool bounded in
//! bytes: a session costs the pages it holds, not its context capacity, and a session forked
//! from another (a conversation's next branch, the `n` choices of one prompt) shares the pages
//! of the prefix instead of copying them. A shared page is copied only when one of its holders
//! writes into it (the last, partly filled page of a fork), so the prefix stays the same bits
//! for every holder. Pages are per layer; attention reads a layer through `KvView`, position by
//! position in the order the contiguous cache was read, so paging changes no output bit.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use half::f16;
use half::slice::HalfFloatSliceExt;
use q4moe_model::backend::KvType;
use q4moe_model::Config;

/// Positions a page holds (vLLM's block size): small enough that a session's last page wastes
/// little, large enough that a page's 16 x kv_dim floats are one allocation among few.
pub const PAGE: usize = 16;

/// The pool every session's pages come from: at most `capacity` pages live at once. A page
/// gives its place back when its last holder drops it. Cloning shares the one pool.
#[derive(Clone)]
pub struct KvPool {
    inner: Arc<PoolCount>,
    /// Keys (and as many values) a page holds: PAGE x kv_dim.
    page_elems: usize,
    /// What a page stores a value as (f16: half the bytes of f32, and half what attention
    /// reads a position).
    kv_type: KvType,
    /// The bound it was made with.
    max_bytes: usize,
}

struct PoolCount {
    capacity: usize,
    used: AtomicUsize,
}

/// The pool cannot give the pages a step needs (`Backend::kv_needed` says how many bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolFull {
    pub needed_pages: usize,
    pub free_pages: usize,
}

impl KvPool {
    /// A pool of at most `max_bytes` of pages (at least one page) of `kv_type` values for
    /// `c`'s layers.
    pub fn new(c: &Config, kv_type: KvType, max_bytes: usize) -> Self {
        let page_elems = PAGE * c.kv_dim();
        KvPool {
            inner: Arc::new(PoolCount {
                capacity: (max_bytes / page_bytes(page_elems, kv_type)).max(1),
                used: AtomicUsize::new(0),
            }),
            page_elems,
            kv_type,
            max_bytes,
        }
    }

    /// Bytes one page takes (keys and values).
    pub fn page_bytes(&self) -> usize {
        page_bytes(self.page_elems, self.kv_type)
    }

    pub fn kv_type(&self) -> KvType {
        self.kv_type
    }

    /// The bound in bytes it was made with.
    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    pub fn capacity_pages(&self) -> usize {
        self.inner.capacity
    }

    pub fn used_pages(&self) -> usize {
        self.inner.used.load(Ordering::Relaxed)
    }

    pub fn free_pages(&self) -> usize {
        self.capacity_pages().saturating_sub(self.used_pages())
    }

    /// A zeroed page, if the pool has room.
    fn take(&self) -> Option<Page> {
        let count = &self.inner;
        count
            .used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| {
                (u < count.capacity).then_some(u + 1)
            })
            .ok()?;
        Some(self.counted_page())
    }

    /// A zeroed page whose place `used` already counts (`take`), or past the bound
    /// (`KvCache::push`'s fallback counts it first).
    fn counted_page(&self) -> Page {
        Page {
            k: Store::zeroed(self.kv_type, self.page_elems),
            v: Store::zeroed(self.kv_type, self.page_elems),
            count: self.inner.clone(),
        }
    }
}

/// Bytes of a page of `page_elems` keys and as many values of `kv_type`.
fn page_bytes(page_elems: usize, kv_type: KvType) -> usize {
    2 * page_elems * kv_type.bytes()
}

/// A page's keys or values as the cache's type stores them.
enum Store {
    F32(Vec<f32>),
    F16(Vec<f16>),
}

impl Store {
    fn zeroed(kv_type: KvType, n: usize) -> Store {
        match kv_type {
            KvType::F32 => Store::F32(vec![0.0; n]),
            KvType::F16 => Store::F16(vec![f16::ZERO; n]),
        }
    }

    fn copy_from(&mut self, other: &Store) {
        match (self, other) {
            (Store::F32(a), Store::F32(b)) => a.copy_from_slice(b),
            (Store::F16(a), Store::F16(b)) => a.copy_from_slice(b),
            _ => unreachable!("the pages of one pool hold one type"),
        }
    }

    /// `x` at elements `at..`, rounded to the type (as `KvType::round` rounds: to nearest,
    /// ties to even; through F16C where the CPU has it).
    fn write(&mut self, at: usize, x: &[f32]) {
        match self {
            Store::F32(a) => a[at..at + x.len()].copy_from_slice(x),
            Store::F16(a) => a[at..at + x.len()].convert_from_f32_slice(x),
        }
    }

    /// Elements `at..at + dst.len()` as f32 (exact: every f16 is an f32) into `dst`.
    fn read(&self, at: usize, dst: &mut [f32]) {
        match self {
            Store::F32(a) => dst.copy_from_slice(&a[at..at + dst.len()]),
            Store::F16(a) => a[at..at + dst.len()].convert_to_f32_slice(dst),
        }
    }

    /// The address of element `at` (for the vector kernels, which read it as the type).
    fn ptr(&self, at: usize) -> *const u8 {
        match self {
            Store::F32(a) => a[at..].as_ptr().cast(),
            Store::F16(a) => a[at..].as_ptr().cast(),
        }
    }
}

/// PAGE positions of one layer: [PAGE, kv_dim] keys and values.
struct Page {
    k: Store,
    v: Store,
    count: Arc<PoolCount>,
}

impl Page {
    /// `other`'s keys and values, in this page (a copy of a shared page one holder writes).
    fn copied_from(mut self, other: &Page) -> Page {
        self.k.copy_from(&other.k);
        self.v.copy_from(&other.v);
        self
    }
}

impl Drop for Page {
    fn drop(&mut self) {
        self.count.used.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One layer of a session: its pages in position order and the positions written.
#[derive(Clone, Default)]
struct Layer {
    pages: Vec<Arc<Page>>,
    len: usize,
}

impl Layer {
    /// Pages this layer must take to hold `n` more positions: the new pages past its last, and
    /// a copy of the partly filled last page where another session shares it.
    fn pages_needed(&self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        let grow = (self.len + n)
            .div_ceil(PAGE)
            .saturating_sub(self.pages.len());
        let shared_tail =
            self.len % PAGE != 0 && Arc::strong_count(&self.pages[self.len / PAGE]) > 1;
        grow + usize::from(shared_tail)
    }
}

/// One session's keys and values, held by the backend, never by the layers.
pub struct KvCache {
    layers: Vec<Layer>,
    kv_dim: usize,
    /// Its pages come from here and hold values of the pool's type (what the GPU's cache
    /// holds), so both backends attend over the same numbers.
    pool: KvPool,
}

impl KvCache {
    pub fn new(c: &Config, pool: &KvPool) -> Self {
        KvCache {
            layers: vec![Layer::default(); c.n_layer],
            kv_dim: c.kv_dim(),
            pool: pool.clone(),
        }
    }

    /// Pages the cache must take from the pool to hold `n` more positions in every layer.
    pub fn pages_needed(&self, n: usize) -> usize {
        self.layers.iter().map(|l| l.pages_needed(n)).sum()
    }

    /// Takes from the pool what `n` more positions need (`pages_needed`), so the pushes that
    /// follow write into pages this cache alone holds. All or nothing: a refusal takes no page
    /// and leaves the cache as it was.
    pub fn reserve(&mut self, n: usize) -> Result<(), PoolFull> {
        if n == 0 {
            return Ok(());
        }
        let needed = self.pages_needed(n);
        let mut taken: Vec<Page> = Vec::with_capacity(needed);
        for _ in 0..needed {
            match self.pool.take() {
                Some(p) => taken.push(p),
                None => {
                    let free = self.pool.free_pages() + taken.len();
                    return Err(PoolFull {
                        needed_pages: needed,
                        free_pages: free,
                    });
                }
            }
        }
        for layer in &mut self.layers {
            let tail = layer.len / PAGE;
            if layer.len % PAGE != 0 && Arc::strong_count(&layer.pages[tail]) > 1 {
                let copy = taken.pop().expect("counted by pages_needed");
                layer.pages[tail] = Arc::new(copy.copied_from(&layer.pages[tail]));
            }
            while layer.pages.len() < (layer.len + n).div_ceil(PAGE) {
                layer
                    .pages
                    .push(Arc::new(taken.pop().expect("counted by pages_needed")));
            }
        }
        Ok(())
    }

    /// Appends one position's keys and values to layer `li`, rounded to the cache's type, into
    /// the pages `reserve` took. Unreserved (a bug, not an input), it takes the page past the
    /// pool's bound rather than fail mid-token.
    pub fn push(&mut self, li: usize, k: &[f32], v: &[f32]) {
        let kv_dim = self.kv_dim;
        let layer = &mut self.layers[li];
        let (page, at) = (layer.len / PAGE, layer.len % PAGE * kv_dim);
        if page == layer.pages.len() || Arc::strong_count(&layer.pages[page]) > 1 {
            debug_assert!(false, "layer {li}: position {} was not reserved", layer.len);
            self.pool.inner.used.fetch_add(1, Ordering::Relaxed);
            let mut fresh = self.pool.counted_page();
            if let Some(old) = layer.pages.get(page) {
                fresh = fresh.copied_from(old);
            }
            layer.pages.truncate(page);
            layer.pages.push(Arc::new(fresh));
        }
        let p = Arc::get_mut(&mut layer.pages[page]).expect("a page written is this cache's alone");
        p.k.write(at, &k[..kv_dim]);
        p.v.write(at, &v[..kv_dim]);
        layer.len += 1;
    }

    /// Positions held (every layer holds the same number once a token has finished).
    pub fn len(&self) -> usize {
        self.layers.last().map_or(0, |l| l.len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Layer `li`'s first `len` positions, for attention.
    pub fn view(&self, li: usize, len: usize) -> KvView<'_> {
        let layer = &self.layers[li];
        assert!(
            len <= layer.len,
            "layer {li} holds {} positions, not {len}",
            layer.len
        );
        KvView {
            pages: &layer.pages,
            len,
            kv_dim: self.kv_dim,
            kv_type: self.pool.kv_type,
        }
    }

    /// Bytes of the pages this cache holds (those it shares counted whole).
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|l| l.pages.len()).sum::<usize>() * self.pool.page_bytes()
    }

    /// Every page this cache holds, by identity (to count pages shared between caches once).
    pub fn page_ids(&self) -> impl Iterator<Item = usize> + '_ {
        self.layers
            .iter()
            .flat_map(|l| l.pages.iter().map(|p| Arc::as_ptr(p) as usize))
    }

    /// A cache holding the first `len` positions, sharing this one's pages (Backend::fork):
    /// it takes no page until one of the two writes into a page they share.
    pub fn fork(&self, len: usize) -> KvCache {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                let len = len.min(l.len);
                Layer {
                    pages: l.pages[..len.div_ceil(PAGE)].to_vec(),
                    len,
                }
            })
            .collect();
        KvCache {
            layers,
            kv_dim: self.kv_dim,
            pool: self.pool.clone(),
        }
    }

    /// Keeps the first `len` positions; the pages past them go back to the pool (unless
    /// another session shares them).
    pub fn truncate(&mut self, len: usize) {
        for l in &mut self.layers {
            l.len = l.len.min(len);
            l.pages.truncate(l.len.div_ceil(PAGE));
        }
    }
}

/// One layer's first positions of a session, page by page.
pub struct KvView<'a> {
    pages: &'a [Arc<Page>],
    len: usize,
    kv_dim: usize,
    kv_type: KvType,
}

impl KvView<'_> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// What the values are stored as.
    pub fn kv_type(&self) -> KvType {
        self.kv_type
    }

    /// Position `t`'s keys `from..from + dst.len()` (of its kv_dim) as f32 into `dst`.
    #[inline]
    pub fn key_into(&self, t: usize, from: usize, dst: &mut [f32]) {
        debug_assert!(t < self.len && from + dst.len() <= self.kv_dim);
        self.pages[t / PAGE]
            .k
            .read(t % PAGE * self.kv_dim + from, dst);
    }

    /// Position `t`'s values `from..from + dst.len()` as f32 into `dst`.
    #[inline]
    pub fn value_into(&self, t: usize, from: usize, dst: &mut [f32]) {
        debug_assert!(t < self.len && from + dst.len() <= self.kv_dim);
        self.pages[t / PAGE]
            .v
            .read(t % PAGE * self.kv_dim + from, dst);
    }

    /// The address of position `t`'s key element `from`, stored as `kv_type` (for the vector
    /// kernels: the kv_dim - from elements from there are readable).
    #[inline]
    pub(crate) fn key_ptr(&self, t: usize, from: usize) -> *const u8 {
        debug_assert!(t < self.len && from < self.kv_dim);
        self.pages[t / PAGE].k.ptr(t % PAGE * self.kv_dim + from)
    }

    /// As `key_ptr`, for the values.
    #[inline]
    pub(crate) fn value_ptr(&self, t: usize, from: usize) -> *const u8 {
        debug_assert!(t < self.len && from < self.kv_dim);
        self.pages[t / PAGE].v.ptr(t % PAGE * self.kv_dim + from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random values in [-2, 2) (a fixed seed).
    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = q4moe_model::sampling::Rng::new(seed);
        (0..n).map(|_| rng.next_f32() * 4.0 - 2.0).collect()
    }

    /// Pushes `n` random positions into every layer of `kv` (reserved first).
    fn fill(kv: &mut KvCache, c: &Config, n: usize, seed: u64) -> Vec<Vec<f32>> {
        kv.reserve(n).unwrap();
        let mut rows = Vec::new();
        for t in 0..n {
            let k = random(c.kv_dim(), seed + 2 * t as u64);
            let v = random(c.kv_dim(), seed + 2 * t as u64 + 1);
            for li in 0..c.n_layer {
                kv.push(li, &k, &v);
            }
            rows.push(k);
            rows.push(v);
        }
        rows
    }

    fn unbounded(c: &Config) -> KvPool {
        KvPool::new(c, KvType::F32, usize::MAX)
    }

    /// Position `t`'s keys and values as f32.
    fn at(view: &KvView<'_>, t: usize, kv_dim: usize) -> (Vec<f32>, Vec<f32>) {
        let (mut k, mut v) = (vec![f32::NAN; kv_dim], vec![f32::NAN; kv_dim]);
        view.key_into(t, 0, &mut k);
        view.value_into(t, 0, &mut v);
        (k, v)
    }

    #[test]
    fn push_rounds_to_the_cache_type() {
        let c = Config::tiny();
        let n = c.kv_dim();
        // f16 has 10 mantissa bits: 1 + 2^-12 rounds down to 1, 1 + 3 * 2^-12 up to 1 + 2^-10.
        let ulp = 2f32.powi(-12);
        let k: Vec<f32> = (0..n).map(|i| 1.0 + [1.0, 3.0][i % 2] * ulp).collect();
        let v: Vec<f32> = (0..n).map(|i| -3.0 - (i % 2) as f32 * 8.0 * ulp).collect(); // f16 steps 2^-9 in [2, 4)
        let half_pool = KvPool::new(&c, KvType::F16, usize::MAX);
        let pool = unbounded(&c);
        assert_eq!(
            half_pool.page_bytes() * 2,
            pool.page_bytes(),
            "f16 pages are half"
        );
        let mut f16 = KvCache::new(&c, &half_pool);
        let mut f32 = KvCache::new(&c, &pool);
        for kv in [&mut f16, &mut f32] {
            kv.reserve(1).unwrap();
            kv.push(0, &k, &v);
        }
        let (exact, rounded) = (at(&f32.view(0, 1), 0, n), at(&f16.view(0, 1), 0, n));
        assert_eq!(exact, (k.clone(), v.clone()));
        for (i, &got) in rounded.0.iter().enumerate() {
            assert_eq!(got, [1.0, 1.0 + 4.0 * ulp][i % 2], "key {i}");
            assert_eq!(got, KvType::F16.round(k[i]), "key {i} as KvType::round");
        }
        assert_eq!(rounded.1, v, "values that are f16 already stay exact");
    }

    /// The slice conversion a push rounds with rounds each value as `KvType::round` does:
    /// random values over f16's range, its subnormals, past its largest (to infinity), signed
    /// zeros; read back exactly.
    #[test]
    fn an_f16_push_rounds_each_value_as_kv_type_round() {
        let c = Config::tiny();
        let n = c.kv_dim();
        let mut rng = q4moe_model::sampling::Rng::new(5);
        let mut x: Vec<f32> = (0..2 * n - 7)
            .map(|i| (rng.next_f32() * 2.0 - 1.0) * [1.0, 1e-6, 7e4, 3.3e-5, 6e4][i % 5])
            .collect();
        x.extend([0.0, -0.0, 65504.0, 65520.0, -1e9, 5.96e-8, 2.98e-8]);
        let pool = KvPool::new(&c, KvType::F16, usize::MAX);
        let mut kv = KvCache::new(&c, &pool);
        kv.reserve(1).unwrap();
        kv.push(0, &x[..n], &x[n..]);
        let (k, v) = at(&kv.view(0, 1), 0, n);
        for (got, want) in k.iter().chain(&v).zip(&x) {
            assert_eq!(got.to_bits(), KvType::F16.round(*want).to_bits(), "{want}");
        }
    }

    #[test]
    fn positions_read_back_across_pages() {
        let c = Config::tiny();
        let pool = unbounded(&c);
        let mut kv = KvCache::new(&c, &pool);
        let n = 2 * PAGE + 5;
        let rows = fill(&mut kv, &c, n, 7);
        assert_eq!(kv.len(), n);
        assert_eq!(
            pool.used_pages(),
            3 * c.n_layer,
            "pages of {PAGE} positions, per layer"
        );
        assert_eq!(kv.bytes(), 3 * c.n_layer * pool.page_bytes());
        for li in 0..c.n_layer {
            let view = kv.view(li, n);
            for t in 0..n {
                let (k, v) = at(&view, t, c.kv_dim());
                assert_eq!(k, rows[2 * t], "layer {li} key {t}");
                assert_eq!(v, rows[2 * t + 1], "layer {li} value {t}");
            }
        }
        kv.truncate(PAGE + 1);
        assert_eq!((kv.len(), pool.used_pages()), (PAGE + 1, 2 * c.n_layer));
        drop(kv);
        assert_eq!(pool.used_pages(), 0, "a dropped cache gives its pages back");
    }

    #[test]
    fn a_fork_shares_its_prefix_until_it_writes() {
        let c = Config::tiny();
        let pool = unbounded(&c);
        let mut a = KvCache::new(&c, &pool);
        let n = 2 * PAGE + 3;
        let rows = fill(&mut a, &c, n, 11);
        let before = pool.used_pages();
        let len = PAGE + 4;
        let mut b = a.fork(len);
        assert_eq!(pool.used_pages(), before, "a fork takes no page");
        assert_eq!(b.len(), len);
        // b writes into the page it shares with a (position PAGE + 4 of page 1): one copy a
        // layer, and a's positions there stay a's.
        assert_eq!(b.pages_needed(1), c.n_layer);
        let theirs = fill(&mut b, &c, 1, 99);
        assert_eq!(pool.used_pages(), before + c.n_layer);
        for li in 0..c.n_layer {
            let (va, vb) = (a.view(li, n), b.view(li, len + 1));
            let d = c.kv_dim();
            for t in 0..len {
                assert_eq!(
                    at(&vb, t, d),
                    at(&va, t, d),
                    "layer {li}: shared position {t}"
                );
            }
            assert_eq!(at(&vb, len, d).0, theirs[0]);
            assert_eq!(
                at(&va, len, d).0,
                rows[2 * len],
                "a's own position {len} untouched"
            );
        }
        // Every page of a's is still a's: dropping b gives back only b's copies.
        drop(b);
        assert_eq!(pool.used_pages(), before);
        // A fork at a page boundary writes into a new page at once: nothing is copied.
        let d = a.fork(PAGE);
        assert_eq!(d.pages_needed(1), c.n_layer);
        assert_eq!(a.pages_needed(1), 0, "a's last page is a's alone");
    }

    #[test]
    fn the_pool_refuses_what_it_cannot_hold_and_takes_nothing() {
        let c = Config::tiny();
        let pool = KvPool::new(&c, KvType::F32, 0);
        assert_eq!(pool.capacity_pages(), 1, "at least one page");
        let bytes = 3 * c.n_layer * 2 * PAGE * c.kv_dim() * 4 + 5;
        let half = KvPool::new(&c, KvType::F16, bytes);
        assert_eq!(
            half.capacity_pages(),
            6 * c.n_layer,
            "f16 pages: twice as many"
        );
        let pool = KvPool::new(&c, KvType::F32, bytes);
        assert_eq!(pool.capacity_pages(), 3 * c.n_layer);
        let mut a = KvCache::new(&c, &pool);
        fill(&mut a, &c, 2 * PAGE, 3);
        let mut b = KvCache::new(&c, &pool);
        let err = b.reserve(PAGE + 1).unwrap_err();
        assert_eq!(
            err,
            PoolFull {
                needed_pages: 2 * c.n_layer,
                free_pages: c.n_layer
            }
        );
        assert_eq!(
            (b.bytes(), pool.used_pages()),
            (0, 2 * c.n_layer),
            "all or nothing"
        );
        b.reserve(PAGE).unwrap();
        assert_eq!(pool.free_pages(), 0);
        drop(a);
        assert_eq!(pool.free_pages(), 2 * c.n_layer);
    }
}
