//! The CUDA backend's options: typed values built once at the edge (the command line's
//! `--cuda-opt key=value`, tests) and passed down. Nothing in this crate reads the environment
//! except `default_cache_dir` below, which the device asks once for the kernel cache's place
//! when no `cache_dir` is given.

use std::path::PathBuf;

use q4moe_model::backend::KvType;

use crate::params;

/// Options of the CUDA backend. The defaults are the measured fastest configuration; the
/// fields that remain are user knobs or what the parity tests need to reach the general kernels.
#[derive(Debug, Clone, PartialEq)]
pub struct CudaOptions {
    /// Keep offset tables, argument buffers and the captured step graph per session.
    pub setup_cache: bool,
    /// Decode steps submitted before the oldest token is read back.
    pub in_flight: usize,
    /// Positions a session's KV cache may hold.
    pub kv_capacity: usize,
    /// Positions a new session's KV cache is allocated for; it doubles as the session grows,
    /// up to kv_capacity, so a session costs what it holds (within 2x), not the whole
    /// capacity (384 MiB at 4,096 positions of Qwen3-30B-A3B, f16). kv_capacity: each session
    /// its whole capacity at once. The GPU tests set it small to grow often.
    pub kv_grow_from: usize,
    /// Bytes every session's KV may take together (the engine's kv_cache_bytes,
    /// `--kv-cache-mb`): a session that would grow past it is refused with KvFull, so the
    /// engine drops kept sessions or preempts the newest running one instead of running out of
    /// device memory. Default: no bound.
    pub kv_pool_bytes: usize,
    /// How the KV cache stores keys and values (attention.cu's kv_t, chosen when the kernels
    /// are compiled): f16 halves what attention reads at long context.
    pub kv_type: KvType,
    /// Time every kernel with events (eager path only; slows decoding).
    pub profile_kernels: bool,
    /// Attention blocks a KV head at most: past this many 32-position chunks a block walks
    /// several (one wave of blocks at long context, a short merge). The parity tests set it
    /// small to reach the chunk walk at short contexts.
    pub attn_max_blocks: usize,
    /// Fold the router into o_proj's launch where it applies (moe.cu RouterFold: +8%,
    /// docs/performance.md). The parity tests turn it off to run the router's own launches.
    pub router_fold: bool,
    /// Qwen3-shape attention on tensor cores where the cache is f16 (attention.cu
    /// attn_gqa_128_8_tc, sm_80+; session 16, H200: +3.3% Q4_0 at the bench's context, +16% at
    /// 4,096). The parity tests turn it off to run the scalar kernel.
    pub attn_tensor_cores: bool,
    /// Tiles past its first a warp of the tensor-core attention loads into shared memory before
    /// pdl_wait (AttnGqaParams::stage): a KV head whose positions fit one block's tiles then
    /// takes one block, with no merge. None = 1 (params::ATT_TC_STAGE_DEFAULT: 256 positions;
    /// session 16: +2.7% Q4_0, +3.3% Q4_K_M), at most 2 and what the device's shared memory
    /// holds. The parity tests run 0.
    pub attn_stage: Option<usize>,
    /// Prompt tokens the batched prefill (prefill.rs) takes at once; 0 runs the decode step
    /// once a prompt token. A user knob (`--prefill-chunk`).
    pub prefill_chunk: usize,
    /// Bytes of attention partials the batched prefill's generic attention (shapes and caches
    /// pf_attn_tc does not take) holds at once; it runs a chunk's tokens in sub-batches that
    /// fit. The parity tests set it small to reach the sub-batches.
    pub prefill_part_budget: usize,
    /// The batched kernels' weight rows run on bt_mma (batch_rows.cu: 32 rows and 8 entries a
    /// block) instead of pf_mma (128 rows and 32 entries a block) where a launch has at most this many
    /// tokens: the batched decode step's B and short prompt chunks. Both give the same bits,
    /// so this moves speed only. 0: pf_mma always.
    pub few_tokens: usize,
    /// Blocks along a slot's units of moe_gate_up's staged kernels, each walking the units past
    /// the grid (moe.cu gate_up_staged). None: the mode's share (step::modes gate_up_share) of
    /// the blocks the device keeps resident, shared among the slots; Some(0): a block a unit;
    /// Some(n): at most n. The parity tests walk at 1.
    pub gate_up_cols: Option<u32>,
    /// Decode steps one graph replay runs (each step's token reaches the host as it ends):
    /// the stream's boundary comes once a graph. Default 4 (session 37: +0.1-0.5% over 1, 8
    /// no better); a stop found late discards up to in_flight x 4 + 3 computed steps. The
    /// parity tests run 1 and 3.
    pub graph_steps: usize,
    /// Read the kernel sources from this directory (files named as the embedded ones) instead
    /// of the embedded copies: one binary times kernel variants (dev/kernel-variants.sh, with `--cuda-opt kernel_dir=DIR`).
    pub kernel_dir: Option<PathBuf>,
    /// Where compiled kernels are cached; None = `default_cache_dir()`.
    pub cache_dir: Option<PathBuf>,
    /// Show a progress bar while the weights upload (large models only).
    pub progress: bool,
    /// Advertise the batched decode step (`BackendInfo::batched_step`), so the server runs a
    /// continuous batch on the GPU. It passes its GPU tests (H100, 2026-12-05), but off by
    /// default while its aggregate below 16 sequences is under the single-stream decode's
    /// (139 tok/s at B = 1, 1,132 at 16 against 806, Q4_0, docs/performance.md); `step_batch`
    /// itself runs either way (its tests and `bench --batch` call it directly).
    pub batched_step: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            setup_cache: true,
            in_flight: 2,
            kv_capacity: 4096,
            kv_grow_from: 256,
            kv_pool_bytes: usize::MAX,
            kv_type: KvType::default(),
            profile_kernels: false,
            attn_max_blocks: params::ATT_MAX_BLOCKS,
            router_fold: true,
            attn_tensor_cores: true,
            attn_stage: None,
            prefill_chunk: params::PREFILL_CHUNK_DEFAULT,
            prefill_part_budget: 64 << 20,
            few_tokens: params::FEW_TOKENS_DEFAULT,
            gate_up_cols: None,
            graph_steps: 4,
            kernel_dir: None,
            cache_dir: None,
            progress: true,
            batched_step: false,
        }
    }
}

impl CudaOptions {
    /// Every key `set` takes, with its values and default (for `--cuda-opt help`).
    pub const KEYS: &'static [(&'static str, &'static str)] = &[
        (
            "setup_cache",
            "on|off: keep each session's launches and graph (default on)",
        ),
        (
            "in_flight",
            "<n> 1..31: decode steps queued ahead of the host (default 2)",
        ),
        (
            "kv_capacity",
            "<n> >= 1: positions a session's KV cache holds (default 4096)",
        ),
        (
            "kv_grow_from",
            "<n> >= 1: positions a new session's KV starts with, doubling as it grows (default 256)",
        ),
        (
            "kv_type",
            "f32|f16: the KV cache's element type (default f16)",
        ),
        (
            "profile_kernels",
            "on|off: time every kernel, eager path (default off)",
        ),
        (
            "attn_max_blocks",
            "<n> >= 1: attention blocks a KV head at most (default 32)",
        ),
        (
            "router_fold",
            "on|off: the router inside o_proj's launch (default on)",
        ),
        (
            "attn_tensor_cores",
            "on|off: tensor-core attention on an f16 cache (default on)",
        ),
        (
            "attn_stage",
            "default|0|1|2: attention tiles staged before the wait (default 1)",
        ),
        (
            "prefill_chunk",
            "<n>: prompt tokens a batched prefill chunk, 0 = off (default 1024)",
        ),
        (
            "prefill_part_budget",
            "<bytes>: prefill attention partials at once (default 64 MiB)",
        ),
        (
            "few_tokens",
            "<n>: tokens a batched launch at most for bt_mma, 0 = pf_mma always (default 16)",
        ),
        (
            "gate_up_cols",
            "default|<n>: moe_gate_up blocks a slot, 0 = one a unit (default: by occupancy)",
        ),
        (
            "graph_steps",
            "<n> >= 1: decode steps a graph replay (default 4)",
        ),
        (
            "kernel_dir",
            "<dir>|none: read kernel sources from <dir> (default: embedded)",
        ),
        (
            "cache_dir",
            "<dir>|default: the compiled-kernel cache (default $XDG_CACHE_HOME/q4moe/kernels)",
        ),
        (
            "progress",
            "on|off: weight upload progress bar (default on)",
        ),
        (
            "batched_step",
            "on|off: serve concurrent requests through the batched step (default off: not yet verified on a GPU)",
        ),
    ];

    /// Sets option `key` from its text form (`KEYS` lists them); the error names the key and
    /// the values it takes.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), String> {
        let Some(&(_, doc)) = Self::KEYS.iter().find(|(k, _)| *k == key) else {
            let keys: Vec<&str> = Self::KEYS.iter().map(|(k, _)| *k).collect();
            return Err(format!(
                "unknown CUDA option '{key}' (one of: {})",
                keys.join(", ")
            ));
        };
        let bad = || format!("CUDA option {key}: bad value '{value}' (takes {doc})");
        let int = || value.parse::<usize>().map_err(|_| bad());
        let at_least_1 = || int().and_then(|n| if n >= 1 { Ok(n) } else { Err(bad()) });
        let flag = || match value {
            "on" | "true" | "1" => Ok(true),
            "off" | "false" | "0" => Ok(false),
            _ => Err(bad()),
        };
        let dir = |none: &str| match value {
            v if v == none => Ok(None),
            "" => Err(bad()),
            v => Ok(Some(PathBuf::from(v))),
        };
        match key {
            "setup_cache" => self.setup_cache = flag()?,
            "in_flight" => self.in_flight = at_least_1()?,
            "kv_capacity" => self.kv_capacity = at_least_1()?,
            "kv_grow_from" => self.kv_grow_from = at_least_1()?,
            "kv_type" => {
                self.kv_type = match value {
                    "f32" => KvType::F32,
                    "f16" => KvType::F16,
                    _ => return Err(bad()),
                }
            }
            "profile_kernels" => self.profile_kernels = flag()?,
            "attn_max_blocks" => self.attn_max_blocks = at_least_1()?,
            "router_fold" => self.router_fold = flag()?,
            "attn_tensor_cores" => self.attn_tensor_cores = flag()?,
            "attn_stage" => {
                self.attn_stage = match value {
                    "default" => None,
                    _ => Some(int().and_then(|n| match n <= params::ATT_TC_STAGE_MAX {
                        true => Ok(n),
                        false => Err(bad()),
                    })?),
                }
            }
            "prefill_chunk" => self.prefill_chunk = int()?,
            "prefill_part_budget" => self.prefill_part_budget = at_least_1()?,
            "few_tokens" => self.few_tokens = int()?,
            "gate_up_cols" => {
                self.gate_up_cols = match value {
                    "default" => None,
                    _ => Some(value.parse().map_err(|_| bad())?),
                }
            }
            "graph_steps" => self.graph_steps = at_least_1()?,
            "kernel_dir" => self.kernel_dir = dir("none")?,
            "cache_dir" => self.cache_dir = dir("default")?,
            "progress" => self.progress = flag()?,
            "batched_step" => self.batched_step = flag()?,
            _ => unreachable!("every key in KEYS has an arm"),
        }
        Ok(())
    }

    /// The kernel cache's directory: `cache_dir`, else `default_cache_dir()`.
    pub(crate) fn kernel_cache_dir(&self) -> PathBuf {
        self.cache_dir.clone().unwrap_or_else(default_cache_dir)
    }
}

/// The compiled-kernel cache's default place: $XDG_CACHE_HOME/q4moe/kernels, else
/// $HOME/.cache/q4moe/kernels, else the temporary directory. The crate's one read of the
/// environment: where a user's cache lives is the platform's convention, not a tunable.
pub fn default_cache_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("q4moe").join("kernels")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_takes_every_key_in_its_text_form() {
        let mut o = CudaOptions::default();
        let good = [
            ("setup_cache", "off"),
            ("in_flight", "3"),
            ("kv_capacity", "512"),
            ("kv_grow_from", "16"),
            ("kv_type", "f32"),
            ("profile_kernels", "on"),
            ("attn_max_blocks", "2"),
            ("router_fold", "false"),
            ("attn_tensor_cores", "0"),
            ("attn_stage", "0"),
            ("prefill_chunk", "0"),
            ("prefill_part_budget", "5000"),
            ("few_tokens", "0"),
            ("gate_up_cols", "1"),
            ("graph_steps", "1"),
            ("kernel_dir", "/tmp/k"),
            ("cache_dir", "/tmp/c"),
            ("progress", "off"),
            ("batched_step", "on"),
        ];
        assert_eq!(good.len(), CudaOptions::KEYS.len(), "a case for every key");
        for (k, v) in good {
            o.set(k, v).unwrap_or_else(|e| panic!("{k}={v}: {e}"));
        }
        let want = CudaOptions {
            setup_cache: false,
            in_flight: 3,
            kv_capacity: 512,
            kv_grow_from: 16,
            // Not a key: the engine sets it from kv_cache_bytes.
            kv_pool_bytes: usize::MAX,
            kv_type: KvType::F32,
            profile_kernels: true,
            attn_max_blocks: 2,
            router_fold: false,
            attn_tensor_cores: false,
            attn_stage: Some(0),
            prefill_chunk: 0,
            prefill_part_budget: 5000,
            few_tokens: 0,
            gate_up_cols: Some(1),
            graph_steps: 1,
            kernel_dir: Some("/tmp/k".into()),
            cache_dir: Some("/tmp/c".into()),
            progress: false,
            batched_step: true,
        };
        assert_eq!(o, want);
        for (k, v) in [("attn_stage", "default"), ("gate_up_cols", "default")] {
            o.set(k, v).unwrap();
        }
        o.set("kernel_dir", "none").unwrap();
        o.set("cache_dir", "default").unwrap();
        assert_eq!((o.attn_stage, o.gate_up_cols), (None, None));
        assert_eq!((o.kernel_dir, o.cache_dir), (None, None));
    }

    #[test]
    fn set_names_an_unknown_key_and_the_keys_it_takes() {
        let err = CudaOptions::default().set("fused_step", "on").unwrap_err();
        assert!(
            err.contains("'fused_step'") && err.contains("graph_steps"),
            "{err}"
        );
    }

    #[test]
    fn set_refuses_bad_values_naming_key_and_values() {
        for (k, v) in [
            ("in_flight", "0"),
            ("in_flight", "two"),
            ("kv_type", "q8"),
            ("setup_cache", "yes please"),
            ("attn_stage", "3"),
            ("gate_up_cols", "-1"),
            ("kernel_dir", ""),
        ] {
            let mut o = CudaOptions::default();
            let err = o.set(k, v).unwrap_err();
            assert!(err.contains(k) && err.contains(&format!("'{v}'")), "{err}");
            assert_eq!(o, CudaOptions::default(), "{k}={v} changed nothing");
        }
    }

    #[test]
    fn the_default_reads_no_environment() {
        let o = CudaOptions::default();
        assert_eq!(o.in_flight, 2);
        assert!(o.router_fold && o.attn_tensor_cores && o.setup_cache && o.progress);
        assert_eq!((o.graph_steps, o.kernel_dir, o.cache_dir), (4, None, None));
    }
}
