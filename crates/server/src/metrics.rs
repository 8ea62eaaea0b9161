//! Prometheus text metrics, kept by hand: a few counters, gauges and histograms do not justify
//! a metrics stack.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;

/// Upper bounds in seconds, wide enough for a CPU tiny model and a GPU 30B alike.
const TTFT_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
const TPOT_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0];

struct Histogram {
    bounds: &'static [f64],
    /// Per bucket (not cumulative); the last is +Inf.
    counts: Vec<u64>,
    sum: f64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
        }
    }

    fn observe(&mut self, v: f64) {
        let i = self
            .bounds
            .iter()
            .position(|&b| v <= b)
            .unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += v;
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (i, c) in self.counts.iter().enumerate() {
            cum += c;
            let le = self
                .bounds
                .get(i)
                .map_or("+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {cum}");
        }
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {cum}", self.sum);
    }
}

pub struct Metrics {
    /// (endpoint, status) -> count.
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    cancelled: AtomicU64,
    queue_depth: AtomicI64,
    /// Sequences in the running batch after the last admission.
    batch_size: AtomicI64,
    /// KV bytes held by the running sequences and by the cached sessions.
    kv_bytes: [AtomicI64; 2],
    /// The KV pool's pages in use and its capacity in pages (-1: the backend keeps no pool).
    kv_pages: [AtomicI64; 2],
    /// Running sequences whose KV a full pool took back, to prefill their contexts again.
    preemptions: AtomicU64,
    /// Finish reason ("stop", "length", "cancelled", "error") -> sequences.
    finished: Mutex<BTreeMap<&'static str, u64>>,
    ttft: Mutex<Histogram>,
    tpot: Mutex<Histogram>,
    queue_wait: Mutex<Histogram>,
    inter_token: Mutex<Histogram>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::default(),
            prompt_tokens: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            queue_depth: AtomicI64::new(0),
            batch_size: AtomicI64::new(0),
            kv_bytes: Default::default(),
            kv_pages: [AtomicI64::new(-1), AtomicI64::new(-1)],
            preemptions: AtomicU64::new(0),
            finished: Mutex::default(),
            ttft: Mutex::new(Histogram::new(TTFT_BUCKETS)),
            tpot: Mutex::new(Histogram::new(TPOT_BUCKETS)),
            queue_wait: Mutex::new(Histogram::new(TTFT_BUCKETS)),
            inter_token: Mutex::new(Histogram::new(TPOT_BUCKETS)),
        }
    }
}

/// A poisoned lock only means another thread panicked mid-update; the numbers are still usable.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Metrics {
    pub fn request(&self, endpoint: &str, status: u16) {
        *lock(&self.requests)
            .entry((endpoint.to_string(), status))
            .or_default() += 1;
    }

    pub fn queue_delta(&self, d: i64) {
        self.queue_depth.fetch_add(d, Ordering::Relaxed);
    }

    pub fn queue_depth(&self) -> i64 {
        self.queue_depth.load(Ordering::Relaxed)
    }

    /// The KV bytes the running sequences and the cached sessions hold.
    pub fn kv_bytes(&self, running: usize, cached: usize) {
        self.kv_bytes[0].store(running as i64, Ordering::Relaxed);
        self.kv_bytes[1].store(cached as i64, Ordering::Relaxed);
    }

    /// The KV pool's pages in use and its capacity, where the backend keeps one.
    pub fn kv_pool(&self, pool: Option<q4moe_model::backend::KvPoolStats>) {
        let pages = |bytes: usize, p: &q4moe_model::backend::KvPoolStats| {
            i64::try_from(bytes / p.page_bytes.max(1)).unwrap_or(i64::MAX)
        };
        let (used, capacity) = pool.map_or((-1, -1), |p| {
            (pages(p.used_bytes, &p), pages(p.capacity_bytes, &p))
        });
        self.kv_pages[0].store(used, Ordering::Relaxed);
        self.kv_pages[1].store(capacity, Ordering::Relaxed);
    }

    /// The batch's preemptions so far (`Batcher::preemptions`).
    pub fn preemptions(&self, n: u64) {
        self.preemptions.store(n, Ordering::Relaxed);
    }

    pub fn batch_size(&self, running: usize) {
        self.batch_size.store(running as i64, Ordering::Relaxed);
    }

    /// From acceptance into the queue to admission by the engine.
    pub fn queue_wait(&self, secs: f64) {
        lock(&self.queue_wait).observe(secs);
    }

    /// The gap between two pieces of one sequence's streamed text.
    pub fn inter_token(&self, secs: f64) {
        lock(&self.inter_token).observe(secs);
    }

    /// A sequence ended, with its finish reason.
    pub fn finished(&self, reason: &'static str) {
        *lock(&self.finished).entry(reason).or_default() += 1;
    }

    pub fn cancelled(&self) {
        self.cancelled.fetch_add(1, Ordering::Relaxed);
    }

    /// One finished generation: token counts, time to first token, mean time per later token.
    pub fn generation(
        &self,
        prompt: usize,
        cached: usize,
        completion: usize,
        ttft: Option<f64>,
        tpot: Option<f64>,
    ) {
        self.prompt_tokens
            .fetch_add(prompt as u64, Ordering::Relaxed);
        self.cached_tokens
            .fetch_add(cached as u64, Ordering::Relaxed);
        self.completion_tokens
            .fetch_add(completion as u64, Ordering::Relaxed);
        if let Some(t) = ttft {
            lock(&self.ttft).observe(t);
        }
        if let Some(t) = tpot {
            lock(&self.tpot).observe(t);
        }
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        out.push_str("# HELP q4moe_requests_total HTTP requests by endpoint and status.\n# TYPE q4moe_requests_total counter\n");
        for ((ep, st), n) in lock(&self.requests).iter() {
            let _ = writeln!(
                out,
                "q4moe_requests_total{{endpoint=\"{ep}\",status=\"{st}\"}} {n}"
            );
        }
        let counters = [
            (
                "q4moe_prompt_tokens_total",
                "Prompt tokens processed (cached ones included).",
                &self.prompt_tokens,
            ),
            (
                "q4moe_cached_prompt_tokens_total",
                "Prompt tokens whose KV was reused.",
                &self.cached_tokens,
            ),
            (
                "q4moe_completion_tokens_total",
                "Tokens generated.",
                &self.completion_tokens,
            ),
            (
                "q4moe_cancelled_total",
                "Generations stopped because the client went away.",
                &self.cancelled,
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP q4moe_queue_depth Requests waiting for the engine.\n# TYPE q4moe_queue_depth gauge\nq4moe_queue_depth {}",
            self.queue_depth()
        );
        let _ = writeln!(
            out,
            "# HELP q4moe_batch_size Sequences in the running batch.\n# TYPE q4moe_batch_size gauge\nq4moe_batch_size {}",
            self.batch_size.load(Ordering::Relaxed)
        );
        out.push_str("# HELP q4moe_kv_bytes KV cache bytes held, by the running sequences and by finished conversations kept for prefix reuse (--kv-cache-mb bounds those on CUDA; on the CPU it bounds the pool, q4moe_kv_pages).\n# TYPE q4moe_kv_bytes gauge\n");
        for (state, v) in ["running", "cached"].iter().zip(&self.kv_bytes) {
            let _ = writeln!(
                out,
                "q4moe_kv_bytes{{state=\"{state}\"}} {}",
                v.load(Ordering::Relaxed)
            );
        }
        let [used, capacity] = self.kv_pages.each_ref().map(|v| v.load(Ordering::Relaxed));
        if capacity >= 0 {
            let _ = writeln!(
                out,
                "# HELP q4moe_kv_pages KV pool pages (one layer's keys and values for a run of positions), in use and in all (--kv-cache-mb).\n# TYPE q4moe_kv_pages gauge\nq4moe_kv_pages{{state=\"used\"}} {used}\nq4moe_kv_pages{{state=\"capacity\"}} {capacity}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP q4moe_kv_preemptions_total Running sequences whose KV a full pool took back; each prefilled its context again and went on (its output unchanged).\n# TYPE q4moe_kv_preemptions_total counter\nq4moe_kv_preemptions_total {}",
            self.preemptions.load(Ordering::Relaxed)
        );
        out.push_str("# HELP q4moe_sequences_finished_total Sequences ended, by finish reason.\n# TYPE q4moe_sequences_finished_total counter\n");
        for (reason, n) in lock(&self.finished).iter() {
            let _ = writeln!(
                out,
                "q4moe_sequences_finished_total{{reason=\"{reason}\"}} {n}"
            );
        }
        lock(&self.queue_wait).render(
            "q4moe_queue_wait_seconds",
            "From acceptance to admission by the engine.",
            &mut out,
        );
        lock(&self.inter_token).render(
            "q4moe_inter_token_latency_seconds",
            "Gaps between streamed pieces of one sequence's text.",
            &mut out,
        );
        lock(&self.ttft).render(
            "q4moe_time_to_first_token_seconds",
            "From acceptance to the first generated token.",
            &mut out,
        );
        lock(&self.tpot).render(
            "q4moe_time_per_output_token_seconds",
            "Mean decode time per token after the first, per request.",
            &mut out,
        );
        out
    }
}
