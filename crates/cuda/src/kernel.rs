//! Every kernel of the module by what it computes, and its symbol: the weight-reading launches
//! have a kernel per mode (a quantisation and a shape, `step::modes` chooses), so each holds
//! only the code it runs. Dispatch is one `match` from a mode to its symbol; the device
//! resolves every symbol once at start-up (`Kernel::all`).

use q4moe_gguf::GgmlType;

/// A staged quantisation of the weight kernels: one 32-weight block a lane piece as repacked
/// (repack.rs), activations quantised to 8 bits in shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Quant {
    Q4_0,
    Q4K,
    Q6K,
}

impl Quant {
    /// The staged quantisation of a weight's ggml type id (`Qw::ty`), if it has one.
    pub fn of(ty: i32) -> Option<Quant> {
        match GgmlType::from_id(ty as u32).ok()? {
            GgmlType::Q4_0 => Some(Quant::Q4_0),
            GgmlType::Q4_K => Some(Quant::Q4K),
            GgmlType::Q6_K => Some(Quant::Q6K),
            _ => None,
        }
    }
}

/// Whether a weight's ggml type id (`Qw::ty`) is F32 (the router's rows).
pub fn is_f32(ty: i32) -> bool {
    ty == GgmlType::F32.id() as i32
}

/// matvec.cu's staged kernels of one quantisation (STAGED_MODES): the quantisation and the
/// kernel's width, the suffix of its name (Q4_0 and Q6_K: 1, 2 or 4 pieces a lane at 4, 2, 1
/// rows a warp; Q4_K: 1 at 2 rows, 2 at 1 row).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Staged {
    pub quant: Quant,
    pub width: u8,
}

impl Staged {
    /// Every staged kernel, matvec.cu's STAGED_MODES order.
    pub const ALL: [Staged; 8] = [
        Staged::new(Quant::Q4_0, 1),
        Staged::new(Quant::Q4_0, 2),
        Staged::new(Quant::Q4_0, 4),
        Staged::new(Quant::Q4K, 1),
        Staged::new(Quant::Q4K, 2),
        Staged::new(Quant::Q6K, 1),
        Staged::new(Quant::Q6K, 2),
        Staged::new(Quant::Q6K, 4),
    ];

    pub const fn new(quant: Quant, width: u8) -> Staged {
        Staged { quant, width }
    }

    /// The symbols of this mode's forms: [matvec, walking matvec, walking head with the
    /// greedy choice (greedy.cu), o_proj with the folded router (moe.cu)].
    fn symbols(self) -> [&'static str; 4] {
        use Quant::*;
        match (self.quant, self.width) {
            (Q4_0, 1) => [
                "matvec_q4_0_1",
                "matvec_q4_0_1_loop",
                "matvec_q4_0_1_loop_argmax",
                "o_proj_router_q4_0_1",
            ],
            (Q4_0, 2) => [
                "matvec_q4_0_2",
                "matvec_q4_0_2_loop",
                "matvec_q4_0_2_loop_argmax",
                "o_proj_router_q4_0_2",
            ],
            (Q4_0, _) => [
                "matvec_q4_0_4",
                "matvec_q4_0_4_loop",
                "matvec_q4_0_4_loop_argmax",
                "o_proj_router_q4_0_4",
            ],
            (Q4K, 1) => [
                "matvec_q4_k_1",
                "matvec_q4_k_1_loop",
                "matvec_q4_k_1_loop_argmax",
                "o_proj_router_q4_k_1",
            ],
            (Q4K, _) => [
                "matvec_q4_k_2",
                "matvec_q4_k_2_loop",
                "matvec_q4_k_2_loop_argmax",
                "o_proj_router_q4_k_2",
            ],
            (Q6K, 1) => [
                "matvec_q6_k_1",
                "matvec_q6_k_1_loop",
                "matvec_q6_k_1_loop_argmax",
                "o_proj_router_q6_k_1",
            ],
            (Q6K, 2) => [
                "matvec_q6_k_2",
                "matvec_q6_k_2_loop",
                "matvec_q6_k_2_loop_argmax",
                "o_proj_router_q6_k_2",
            ],
            (Q6K, _) => [
                "matvec_q6_k_4",
                "matvec_q6_k_4_loop",
                "matvec_q6_k_4_loop_argmax",
                "o_proj_router_q6_k_4",
            ],
        }
    }
}

/// matvec.cu's kernel for one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MatvecMode {
    /// Row by row over any type (and the only one that writes the normalised input).
    Generic,
    /// Q4_K and Q6_K matrices in one launch (Q4_K_M's QKV on half the layers).
    KMixed,
    /// One staged type; `walk`: at most a set number of blocks walk the rows grid-wide
    /// (matvec.cu MV_LOOP_KERNEL: the output head).
    Staged { kernel: Staged, walk: bool },
}

/// moe.cu's moe_gate_up kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GateUpMode {
    /// Row by row over the normalised input the router wrote.
    Generic,
    /// Q4_0, k <= 1024: two rows a warp (moe_gate_up_q4_0_1).
    Q4_0Rows2,
    /// Q4_0, k <= 2048: one row a warp (moe_gate_up_q4_0_2).
    Q4_0Rows1,
    /// Q4_K, k <= 2048 (moe_gate_up_q4_k).
    Q4K,
}

impl GateUpMode {
    pub const ALL: [GateUpMode; 4] = [
        GateUpMode::Generic,
        GateUpMode::Q4_0Rows2,
        GateUpMode::Q4_0Rows1,
        GateUpMode::Q4K,
    ];
}

/// Pieces a lane of moe_down's staged kernels (every (slot, block) piece of a row spread over
/// the lanes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DownMode {
    Generic,
    Staged { quant: Quant, pieces: u8 },
}

impl DownMode {
    /// The staged kernels' widths (moe.cu DOWN_KERNEL).
    pub const PIECES: [u8; 3] = [2, 6, 8];
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    Matvec(MatvecMode),
    /// o_proj with the router folded in, by o_proj's staged mode (moe.cu OPROJ_ROUTER_KERNEL).
    OprojRouter(Staged),
    /// The walking output head with the greedy choice in its tail (greedy.cu head_argmax).
    HeadArgmax(Staged),
    MoeGateUp(GateUpMode),
    MoeDown(DownMode),
    Embed,
    QkNormRope,
    AttnSplit,
    AttnCombine,
    AttnGqa,
    AttnGqa128x8,
    /// The same shape on tensor cores over the f16 cache (sm_80+).
    AttnGqa128x8Tc,
    /// That kernel for each row of the batched step (bt_attn_gqa_tc).
    BtAttnGqaTc,
    MoeTopk,
    RouterTopk,
    RouterCluster,
    RouterFoldBuild,
    ArgmaxPartial,
    ArgmaxFinal,
    /// The logits a constraint does not allow to -inf (a constrained decode on the device).
    MaskLogits,
    SamplePartial,
    SampleWalk,
    SampleEdge,
    SampleTopk,
    SamplePenalize,
    SampleCount,
    /// An empty dependent launch (probe.cu; benches/launch_chain.rs).
    PdlProbe,
    /// The batched prefill's kernels (prefill.cu).
    PfEmbed,
    PfQuant,
    PfRows,
    PfMma,
    /// pf_mma's launches on few tokens (batch_rows.cu).
    BtMma,
    PfF32Rows,
    /// pf_f32rows' launches on few tokens (batch_rows.cu).
    BtF32Rows,
    PfRoute,
    PfLists,
    /// pf_route and pf_lists in one launch, for few tokens.
    BtRoute,
    PfTiles,
    /// The experts' weighted sum into the residual, then its quantisation for the next launch.
    PfCombineQuant,
    PfQkNormRope,
    PfAttnSplit,
    PfAttnCombine,
    PfAttnTc,
    PfAttnTcG16,
    /// The batched decode step's attention over each token's own session (prefill_attn.cu).
    BtQkNormRope,
    BtAttnSplit,
    /// The batched decode step's greedy choice, a row a block (greedy.cu).
    BtArgmax,
}

/// The kernels with no mode.
const SINGLE: [Kernel; 42] = [
    Kernel::Embed,
    Kernel::QkNormRope,
    Kernel::AttnSplit,
    Kernel::AttnCombine,
    Kernel::AttnGqa,
    Kernel::AttnGqa128x8,
    Kernel::AttnGqa128x8Tc,
    Kernel::BtAttnGqaTc,
    Kernel::MoeTopk,
    Kernel::RouterTopk,
    Kernel::RouterCluster,
    Kernel::RouterFoldBuild,
    Kernel::ArgmaxPartial,
    Kernel::ArgmaxFinal,
    Kernel::MaskLogits,
    Kernel::SamplePartial,
    Kernel::SampleWalk,
    Kernel::SampleEdge,
    Kernel::SampleTopk,
    Kernel::SamplePenalize,
    Kernel::SampleCount,
    Kernel::PdlProbe,
    Kernel::PfEmbed,
    Kernel::PfQuant,
    Kernel::PfRows,
    Kernel::PfMma,
    Kernel::BtMma,
    Kernel::BtF32Rows,
    Kernel::PfF32Rows,
    Kernel::PfRoute,
    Kernel::PfLists,
    Kernel::BtRoute,
    Kernel::PfTiles,
    Kernel::PfCombineQuant,
    Kernel::PfQkNormRope,
    Kernel::PfAttnSplit,
    Kernel::PfAttnCombine,
    Kernel::PfAttnTc,
    Kernel::PfAttnTcG16,
    Kernel::BtQkNormRope,
    Kernel::BtAttnSplit,
    Kernel::BtArgmax,
];

impl Kernel {
    /// Every kernel of the module, in the order the device resolves them.
    pub fn all() -> Vec<Kernel> {
        let mut all = SINGLE.to_vec();
        all.extend([MatvecMode::Generic, MatvecMode::KMixed].map(Kernel::Matvec));
        for kernel in Staged::ALL {
            for walk in [false, true] {
                all.push(Kernel::Matvec(MatvecMode::Staged { kernel, walk }));
            }
            all.extend([Kernel::OprojRouter(kernel), Kernel::HeadArgmax(kernel)]);
        }
        all.extend(GateUpMode::ALL.map(Kernel::MoeGateUp));
        all.push(Kernel::MoeDown(DownMode::Generic));
        for quant in [Quant::Q4_0, Quant::Q4K, Quant::Q6K] {
            for pieces in DownMode::PIECES {
                all.push(Kernel::MoeDown(DownMode::Staged { quant, pieces }));
            }
        }
        all
    }

    /// Kernels whose blocks may take more than the default 48 KB of dynamic shared memory.
    pub fn large_smem(self) -> bool {
        matches!(
            self,
            Kernel::Matvec(_)
                | Kernel::HeadArgmax(_)
                | Kernel::OprojRouter(_)
                | Kernel::MoeGateUp(_)
                | Kernel::MoeDown(_)
                | Kernel::AttnGqa
                | Kernel::AttnGqa128x8
                | Kernel::AttnGqa128x8Tc
                | Kernel::BtAttnGqaTc
                | Kernel::SampleWalk
                | Kernel::PfMma
                | Kernel::PfAttnTc
                | Kernel::PfAttnTcG16
        )
    }

    pub fn symbol(self) -> &'static str {
        match self {
            Kernel::Matvec(MatvecMode::Generic) => "matvec_generic",
            Kernel::Matvec(MatvecMode::KMixed) => "matvec_k_mixed",
            Kernel::Matvec(MatvecMode::Staged { kernel, walk }) => kernel.symbols()[walk as usize],
            Kernel::HeadArgmax(s) => s.symbols()[2],
            Kernel::OprojRouter(s) => s.symbols()[3],
            Kernel::MoeGateUp(m) => match m {
                GateUpMode::Generic => "moe_gate_up",
                GateUpMode::Q4_0Rows2 => "moe_gate_up_q4_0_1",
                GateUpMode::Q4_0Rows1 => "moe_gate_up_q4_0_2",
                GateUpMode::Q4K => "moe_gate_up_q4_k",
            },
            Kernel::MoeDown(m) => down_symbol(m),
            Kernel::RouterFoldBuild => "router_fold_build",
            Kernel::Embed => "embed",
            Kernel::QkNormRope => "qk_norm_rope",
            Kernel::AttnSplit => "attn_split",
            Kernel::AttnCombine => "attn_combine",
            Kernel::AttnGqa => "attn_gqa",
            Kernel::AttnGqa128x8 => "attn_gqa_128_8",
            Kernel::AttnGqa128x8Tc => "attn_gqa_128_8_tc",
            Kernel::BtAttnGqaTc => "bt_attn_gqa_tc",
            Kernel::MoeTopk => "moe_topk",
            Kernel::RouterTopk => "router_topk",
            Kernel::RouterCluster => "router_cluster",
            Kernel::ArgmaxPartial => "argmax_partial",
            Kernel::ArgmaxFinal => "argmax_final",
            Kernel::MaskLogits => "mask_logits",
            Kernel::SamplePartial => "sample_partial",
            Kernel::SampleWalk => "sample_walk",
            Kernel::SampleEdge => "sample_edge",
            Kernel::SampleTopk => "sample_topk",
            Kernel::SamplePenalize => "sample_penalize",
            Kernel::SampleCount => "sample_count",
            Kernel::PdlProbe => "pdl_probe",
            Kernel::PfEmbed => "pf_embed",
            Kernel::PfQuant => "pf_quant",
            Kernel::PfRows => "pf_rows",
            Kernel::PfMma => "pf_mma",
            Kernel::BtMma => "bt_mma",
            Kernel::BtF32Rows => "bt_f32rows",
            Kernel::PfF32Rows => "pf_f32rows",
            Kernel::PfRoute => "pf_route",
            Kernel::PfLists => "pf_lists",
            Kernel::BtRoute => "bt_route",
            Kernel::PfTiles => "pf_tiles",
            Kernel::PfCombineQuant => "pf_combine_quant",
            Kernel::PfQkNormRope => "pf_qk_norm_rope",
            Kernel::PfAttnSplit => "pf_attn_split",
            Kernel::PfAttnCombine => "pf_attn_combine",
            Kernel::PfAttnTc => "pf_attn_tc",
            Kernel::PfAttnTcG16 => "pf_attn_tc_g16",
            Kernel::BtQkNormRope => "bt_qk_norm_rope",
            Kernel::BtAttnSplit => "bt_attn_split",
            Kernel::BtArgmax => "bt_argmax",
        }
    }
}

fn down_symbol(m: DownMode) -> &'static str {
    use Quant::*;
    match m {
        DownMode::Generic => "moe_down",
        DownMode::Staged { quant, pieces } => match (quant, pieces) {
            (Q4_0, 2) => "moe_down_q4_0_2",
            (Q4_0, 6) => "moe_down_q4_0_6",
            (Q4_0, _) => "moe_down_q4_0_8",
            (Q4K, 2) => "moe_down_q4_k_2",
            (Q4K, 6) => "moe_down_q4_k_6",
            (Q4K, _) => "moe_down_q4_k_8",
            (Q6K, 2) => "moe_down_q6_k_2",
            (Q6K, 6) => "moe_down_q6_k_6",
            (Q6K, _) => "moe_down_q6_k_8",
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table holds each kernel once and each symbol once: 42 without a mode, 18 matvecs,
    /// 4 gate/up, 10 down, 8 o_proj_router, 8 head_argmax.
    #[test]
    fn every_kernel_has_one_distinct_symbol() {
        let all = Kernel::all();
        assert_eq!(all.len(), 90);
        let mut symbols: Vec<&str> = all.iter().map(|k| k.symbol()).collect();
        symbols.sort();
        symbols.dedup();
        assert_eq!(symbols.len(), all.len(), "a symbol named twice");
    }
}
