//! Which kernel takes a launch's weight rows against activation rows, and its grid and params:
//! pf_rows and pf_f32rows (any device), pf_mma (the split types on int8 tensor cores), bt_mma
//! and bt_f32rows (few tokens, pf_mma's and pf_f32rows' bits), and pf_quant, which writes the
//! activation rows they read (kernels/prefill.cu, kernels/batch_rows.cu). The batched prefill
//! and the batched decode step build their launches from these.

use crate::kernel::{is_f32, Kernel, Quant};
use crate::launch::Launch;
use crate::params::*;

/// Words of one quantised group of 32 activations (quant.cuh QXW) and floats of a padded one
/// (XS).
const QXW: usize = 20;
const XS: usize = 36;
/// Rows of a pf_rows block (PF_ROWS) and of a pf_mma one (PFM_ROWS).
const PF_ROWS: usize = 32;
const PFM_ROWS: usize = 128;
/// Rows a bt_mma block takes (batch_rows.cu BTM_ROWS), its threads (32 * BTM_W) and its
/// dynamic shared memory (BTM_STAGES stages of its PfmShape: 32 rows x (144 + 104) bytes and 8
/// entries x (576 + 128)); and bt_f32rows' rows and entries (BTF_R, BTF_E).
const BTM_ROWS: usize = 32;
const BTM_THREADS: u32 = 64;
const BTM_SMEM: u32 = 3 * (32 * (144 + 104) + 8 * (576 + 128));
const BTF_R: u32 = 8;
const BTF_E: u32 = 8;
/// Tokens a dense F32 launch (the router) takes on bt_f32rows at most.
pub(crate) const F32_FEW: usize = 64;
/// Entries a pf_mma block takes (PFM_ENTRIES), and a dense pf_rows one (fewer: the router's
/// 128 rows are 4 of its blocks an entry tile).
pub(crate) const PFM_ENTRIES: usize = 32;
const PF_Z_ENTRIES: usize = 8;
/// Rows and entries a pf_f32rows block takes (PFF_TILE).
const PFF_TILE: usize = 32;
/// pf_mma's dynamic shared memory: two stages (prefill.cu PFM_STAGE_BYTES).
const PFM_SMEM: u32 = 2 * (128 * (144 + 104) + 32 * (576 + 16 * 8));
const THREADS: u32 = 256;

pub(crate) fn padded_len(n: usize) -> usize {
    n / 32 * XS + XS
}

pub(crate) fn quant_words(n: usize) -> usize {
    n / 32 * QXW
}

/// Which kernels take a launch's rows: `Plain` pf_rows and pf_f32rows; `Mma` pf_mma for the
/// split types (Q4_0, Q4_K, Q6_K with k % 256 == 0; sm_80+); `Few` (sm_80+, launches of few
/// tokens) bt_mma for the split types and bt_f32rows for F32, the same bits as pf_mma and
/// pf_f32rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rows {
    Plain,
    Mma,
    Few,
}

impl Rows {
    /// The kernels for a device with tensor cores or not (`mma`: sm_80+) and a launch of few
    /// tokens or not: the few-token kernels only beside pf_mma, whose bits they give (pf_rows
    /// adds in another order).
    pub(crate) fn pick(mma: bool, few: bool) -> Rows {
        match (mma, few) {
            (true, true) => Rows::Few,
            (true, false) => Rows::Mma,
            (false, _) => Rows::Plain,
        }
    }
}

/// Weight rows against `entries` activation rows (dense: `p.list` 0) or expert slots: F32 on
/// pf_f32rows (dense), the split types as `on` says (`Rows`), the others on pf_rows. Dense
/// launches tile the entries over blockIdx.z, grouped pf_mma launches take the work list's
/// tiles (blockIdx.y), grouped pf_rows and bt_mma launches a group a blockIdx.y.
pub(crate) fn rows_launch(on: Rows, mut p: PfRowsParams, entries: usize, groups: Groups) -> Launch {
    if p.list == 0 && is_f32(p.w.ty) && on == Rows::Few {
        return f32_few_launch(p, entries, None);
    }
    if p.list == 0 && is_f32(p.w.ty) {
        let tiles = |n: usize| n.div_ceil(PFF_TILE) as u32;
        let grid = (tiles(p.rows as usize), 1, tiles(entries));
        return Launch::new(Kernel::PfF32Rows, "pf_f32rows", grid, THREADS, 0, &p, 0);
    }
    let on = if splits(&p.w) { on } else { Rows::Plain };
    let blocks = |rows: usize| (p.rows as u32).div_ceil(rows as u32);
    if on == Rows::Few {
        return few_launch(p, &[(p.w, p.rows as usize, p.out)], groups, None);
    }
    let groups = groups.count();
    let mma = on == Rows::Mma;
    let (kernel, name, rows, z, smem) = match mma {
        true => (Kernel::PfMma, "pf_mma", PFM_ROWS, PFM_ENTRIES, PFM_SMEM),
        false => (Kernel::PfRows, "pf_rows", PF_ROWS, PF_Z_ENTRIES, 0),
    };
    let grid = match (p.list, mma) {
        (0, _) => {
            p.z_entries = z as i32;
            (blocks(rows), 1, entries.div_ceil(z) as u32)
        }
        (_, true) => (
            blocks(rows),
            (entries.div_ceil(PFM_ENTRIES) + groups) as u32,
            1,
        ),
        (_, false) => {
            p.tiles = 0;
            (blocks(rows), groups as u32, 1)
        }
    };
    Launch::new(kernel, name, grid, THREADS, smem, &p, 0)
}

/// Values of one chain of an F32 row's sum (prefill.cu F32_CHAIN): pf_f32rows and bt_f32rows
/// both add each chain in k order, then the chains in order.
pub(crate) const F32_CHAIN: usize = 256;

/// The buffers of bt_f32rows' split form for `rows` rows of `k` values against at most
/// `entries` tokens: floats of the chains' sums, and ints of the tiles' counters (zero
/// before the first launch; each launch leaves them zero).
pub(crate) fn f32_split_sizes(rows: usize, k: usize, entries: usize) -> (usize, usize) {
    let tiles = rows.div_ceil(BTF_R as usize) * entries.div_ceil(BTF_E as usize);
    (k.div_ceil(F32_CHAIN) * entries * rows, tiles)
}

/// bt_f32rows over `entries` tokens (dense F32 rows, few tokens): with `split` (the chains'
/// sums and the tiles' counters, f32_split_sizes for these rows and at least these entries),
/// a chain a block and the last block of a tile adding them; without, a thread walks every
/// chain. The same bits either way.
pub(crate) fn f32_few_launch(p: PfRowsParams, entries: usize, split: Option<(u64, u64)>) -> Launch {
    let chains = (p.w.k as usize).div_ceil(F32_CHAIN) as u32;
    let (part, count) = split.unwrap_or((0, 0));
    let grid = (
        (p.rows as u32).div_ceil(BTF_R),
        entries.div_ceil(BTF_E as usize) as u32,
        if split.is_some() { chains } else { 1 },
    );
    let bp = BtF32Params { p, part, count };
    Launch::new(
        Kernel::BtF32Rows,
        "bt_f32rows",
        grid,
        BTF_R * BTF_E,
        0,
        &bp,
        0,
    )
}

/// Whether a weight's rows take the split types' kernels (pf_mma, bt_mma).
pub(crate) fn splits(w: &Qw) -> bool {
    Quant::of(w.ty).is_some() && w.k % 256 == 0
}

/// The groups of a launch: `Each` of n groups (1 for a dense launch, the experts), or
/// `Slots`: a grouped launch's `experts`, whose bt_mma launch takes the routed slots (`ids`,
/// token-major) a blockIdx.y, a slot taking its expert unless an earlier slot chose it too
/// (btr_group); the other kernels take the experts. Slots where they are at
/// most a quarter of the experts: at B = 1, 8 rows of blocks instead of 128 mostly idle ones.
/// Measured (H200, Q4_0, Qwen3-30B-A3B's 128 experts, 8 a token, one call): slots against the
/// expert grid 180.0 / 312.5 / 470.7 / 584.6 tok/s against 143.2 / 265.0 / 451.3 / 662.3 at
/// B = 1 / 2 / 4 / 8: 64 slots lost to 128 groups (docs/performance.md).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Groups {
    Each(usize),
    Slots {
        ids: u64,
        slots: usize,
        experts: usize,
    },
}

impl Groups {
    /// A grouped launch's: slots where at most a quarter of the experts.
    pub(crate) fn routed(ids: u64, slots: usize, experts: usize) -> Groups {
        match 4 * slots <= experts {
            true => Groups::Slots {
                ids,
                slots,
                experts,
            },
            false => Groups::Each(experts),
        }
    }

    /// The groups themselves (the kernels other than bt_mma take a group a blockIdx.y or a
    /// work list over them).
    fn count(self) -> usize {
        let (Groups::Each(n) | Groups::Slots { experts: n, .. }) = self;
        n
    }
}

/// Where bt_mma's gate-and-up launch quantises silu(gate) * up (pf_quant's swiglu rows): the
/// quantised groups and padded floats of each slot, and a counter of each pair of blocks (zero
/// between launches: `swiglu_counters` of them).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Swiglu {
    pub hq: u64,
    pub hf: u64,
    pub count: u64,
}

/// Counters a fused gate-and-up launch of `dff` rows a part takes over `groups` (grid y).
pub(crate) fn swiglu_counters(groups: usize, dff: usize) -> usize {
    groups * dff.div_ceil(BTM_ROWS)
}

/// Whether gate and up (`dff` rows each) can quantise their product in their launch: bt_mma's
/// blocks are a quantised group's 32 rows.
pub(crate) fn swiglu_fuses(dff: usize) -> bool {
    dff.is_multiple_of(BTM_ROWS) && BTM_ROWS == 32
}

/// bt_mma over up to three matrices of split types (`parts`: weights, rows, output) against
/// `base`'s activations, entries, output stride and lists (the first part replaces its
/// weights, rows and output), over `groups`: one launch where pf_mma would take one each; with
/// `swiglu` (gate and up, `swiglu_fuses`), their product quantised too.
pub(crate) fn few_launch(
    base: PfRowsParams,
    parts: &[(Qw, usize, u64)],
    groups: Groups,
    swiglu: Option<Swiglu>,
) -> Launch {
    assert!((1..=3).contains(&parts.len()) && parts.iter().all(|p| splits(&p.0)));
    assert!(swiglu.is_none() || (parts.len() == 2 && parts[0].1 == parts[1].1));
    let part = |i: usize| parts.get(i).copied().unwrap_or((Qw::default(), 0, 0));
    let blocks = |i: usize| part(i).1.div_ceil(BTM_ROWS) as i32;
    let (w0, rows0, out0) = part(0);
    let p = BtRowsParams {
        p: PfRowsParams {
            w: w0,
            rows: rows0 as i32,
            out: out0,
            ..base
        },
        w1: part(1).0,
        w2: part(2).0,
        out1: part(1).2,
        out2: part(2).2,
        rows1: part(1).1 as i32,
        rows2: part(2).1 as i32,
        blocks0: blocks(0),
        blocks1: blocks(1),
        ids: match groups {
            Groups::Each(_) => 0,
            Groups::Slots { ids, .. } => ids,
        },
        hq: swiglu.map_or(0, |h| h.hq),
        hf: swiglu.map_or(0, |h| h.hf),
        hcount: swiglu.map_or(0, |h| h.count),
    };
    let (Groups::Each(y) | Groups::Slots { slots: y, .. }) = groups;
    let grid = ((blocks(0) + blocks(1) + blocks(2)) as u32, y as u32, 1);
    Launch::new(Kernel::BtMma, "bt_mma", grid, BTM_THREADS, BTM_SMEM, &p, 0)
}

/// pf_quant over `rows` activation rows of `k` values at `src` (RMSNorm'd with `norm` unless 0)
/// into the quantised groups and padded floats at `(xq, xf)`.
pub(crate) fn quant_launch(
    src: u64,
    norm: u64,
    (xq, xf): (u64, u64),
    k: usize,
    rows: usize,
    eps: f32,
) -> Launch {
    let p = quant_params(src, norm, (xq, xf), k, eps);
    Launch::new(
        Kernel::PfQuant,
        "pf_quant",
        (rows as u32, 1, 1),
        THREADS,
        0,
        &p,
        0,
    )
}

/// pf_quant's params for rows of `k` values at `src` (a row every k), RMSNorm'd with `norm`
/// unless 0 (pf_combine_quant's quantisation takes them too).
pub(crate) fn quant_params(
    src: u64,
    norm: u64,
    (xq, xf): (u64, u64),
    k: usize,
    eps: f32,
) -> PfQuantParams {
    PfQuantParams {
        src,
        norm,
        xq,
        xf,
        n: k as i32,
        stride: k as i32,
        swiglu: 0,
        eps,
    }
}

/// Dense rows of `w` against the n activation rows pf_quant put at `x`: out[t * stride + r]
/// (+= with `add`).
pub(crate) fn dense_launch(
    on: Rows,
    w: Qw,
    rows: usize,
    x: (u64, u64),
    out: (u64, usize),
    n: usize,
    add: bool,
) -> Launch {
    rows_launch(
        on,
        dense_params(w, rows, x, out, n, add),
        n,
        Groups::Each(1),
    )
}

/// A dense launch's params: `rows` rows of `w` against the n activation rows at `(xq, xf)`,
/// into out[t * stride + r] (+= with `add`).
pub(crate) fn dense_params(
    w: Qw,
    rows: usize,
    (xq, xf): (u64, u64),
    (out, stride): (u64, usize),
    n: usize,
    add: bool,
) -> PfRowsParams {
    PfRowsParams {
        w,
        xq,
        xf,
        out,
        rows: rows as i32,
        out_stride: stride as i32,
        n_dense: n as i32,
        accumulate: add as i32,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use q4moe_gguf::GgmlType;

    fn params(ty: GgmlType, k: usize, list: u64) -> PfRowsParams {
        PfRowsParams {
            w: Qw {
                ty: ty.id() as i32,
                k: k as i32,
                ..Default::default()
            },
            rows: 768,
            list,
            ..Default::default()
        }
    }

    /// Each `Rows` takes the kernels its doc names, with those kernels' grids: bt_mma a group a
    /// blockIdx.y and 32 rows a block, bt_f32rows 8 rows x 8 entries a block, and the types
    /// bt_mma does not take (or k not a multiple of 256) on pf_rows.
    #[test]
    fn rows_kinds_pick_their_kernels() {
        use GgmlType::*;
        let cases = [
            (Rows::Few, Q4_0, 2048, 1, 24, 128, "bt_mma", (24, 128, 1)),
            (Rows::Few, Q6_K, 2048, 0, 3, 1, "bt_mma", (24, 1, 1)),
            (Rows::Mma, Q4_K, 2048, 0, 3, 1, "pf_mma", (6, 1, 1)),
            (Rows::Few, F32, 2048, 0, 9, 1, "bt_f32rows", (96, 2, 1)),
            (Rows::Mma, F32, 2048, 0, 9, 1, "pf_f32rows", (24, 1, 1)),
            (Rows::Few, Q8_0, 2048, 0, 3, 1, "pf_rows", (24, 1, 1)),
            (Rows::Few, Q4_0, 2080, 0, 3, 1, "pf_rows", (24, 1, 1)),
        ];
        for (on, ty, k, list, entries, groups, name, grid) in cases {
            let l = rows_launch(on, params(ty, k, list), entries, Groups::Each(groups));
            assert_eq!((l.name, l.grid), (name, grid), "{on:?} {ty:?} k {k}");
        }
    }

    /// A grouped bt_mma launch takes the routed slots where they are at most a quarter of the
    /// experts (blockIdx.y a slot, BtRowsParams::ids their experts), else an expert a blockIdx.y.
    #[test]
    fn few_tokens_take_their_routed_slots() {
        let p = params(GgmlType::Q4_0, 2048, 1);
        let w = (p.w, 768, 0);
        let cases = [
            (8, 128, 8, 77),
            (32, 128, 32, 77),
            (64, 128, 128, 0),
            (128, 128, 128, 0),
        ];
        for (slots, experts, grid_y, ids) in cases {
            let g = Groups::routed(77, slots, experts);
            let l = few_launch(p, &[w], g, None);
            assert_eq!(
                l.grid,
                (24, grid_y, 1),
                "{slots} slots of {experts} experts"
            );
            let bytes: Vec<u8> = l.params.iter().flat_map(|x| x.to_le_bytes()).collect();
            // SAFETY: the launch's params are a BtRowsParams (plain integers), 8-byte aligned.
            let b: BtRowsParams = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
            assert_eq!(b.ids, ids, "{slots} slots of {experts} experts");
            // rows_launch takes the same grid for bt_mma, and the experts for pf_mma.
            assert_eq!(rows_launch(Rows::Few, p, slots, g).grid, l.grid);
            let mma = rows_launch(Rows::Mma, p, slots, g).grid;
            assert_eq!(mma.1 as usize, slots.div_ceil(PFM_ENTRIES) + experts);
        }
    }

    /// bt_f32rows' split form takes a chain of 256 values a blockIdx.z, its buffers sized for
    /// every chain, entry and row, and a counter a tile; the other form one blockIdx.z.
    #[test]
    fn f32_splits_take_a_chain_a_block() {
        let mut p = params(GgmlType::F32, 2048, 0);
        p.rows = 128;
        let l = f32_few_launch(p, 9, Some((5, 6)));
        assert_eq!((l.name, l.grid), ("bt_f32rows", (16, 2, 8)));
        let bytes: Vec<u8> = l.params.iter().flat_map(|x| x.to_le_bytes()).collect();
        // SAFETY: the launch's params are a BtF32Params (plain integers), 8-byte aligned.
        let b: BtF32Params = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
        assert_eq!((b.part, b.count, b.p.n_dense), (5, 6, 0));
        assert_eq!(f32_few_launch(p, 9, None).grid, (16, 2, 1));
        assert_eq!(f32_split_sizes(128, 2048, 9), (8 * 9 * 128, 16 * 2));
        assert_eq!(f32_split_sizes(128, 768, 64), (3 * 64 * 128, 16 * 8));
    }

    /// A gate-and-up launch with its product's quantisation: the pointers in the params, a
    /// counter for each pair of blocks over the launch's groups, and only where a block's rows
    /// are a quantised group's 32 (so the two parts' blocks pair up).
    #[test]
    fn gate_and_up_carry_their_product_s_buffers() {
        let p = params(GgmlType::Q4_0, 2048, 1);
        let parts = [(p.w, 768, 10), (p.w, 768, 20)];
        let h = Swiglu {
            hq: 1,
            hf: 2,
            count: 3,
        };
        let l = few_launch(p, &parts, Groups::Each(128), Some(h));
        let bytes: Vec<u8> = l.params.iter().flat_map(|x| x.to_le_bytes()).collect();
        // SAFETY: the launch's params are a BtRowsParams (plain integers), 8-byte aligned.
        let b: BtRowsParams = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
        assert_eq!((b.hq, b.hf, b.hcount), (1, 2, 3));
        assert_eq!((b.blocks0, b.blocks1, l.grid), (24, 24, (48, 128, 1)));
        assert_eq!(swiglu_counters(128, 768), 128 * 24);
        assert!(swiglu_fuses(768) && swiglu_fuses(512) && !swiglu_fuses(784));
        let plain = few_launch(p, &parts, Groups::Each(128), None);
        let bytes: Vec<u8> = plain.params.iter().flat_map(|x| x.to_le_bytes()).collect();
        // SAFETY: as above.
        let b: BtRowsParams = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
        assert_eq!((b.hq, b.hf, b.hcount), (0, 0, 0));
    }

    /// One bt_mma launch over three parts: each part's blocks in turn along x, and each
    /// part's weights, rows and output where BtRowsParams puts them.
    #[test]
    fn parts_take_their_blocks_in_turn() {
        use GgmlType::*;
        let w = |ty: GgmlType, data: u64| Qw {
            data,
            ty: ty.id() as i32,
            k: 2048,
            ..Default::default()
        };
        let parts = [
            (w(Q4_0, 1), 37, 100),
            (w(Q4_K, 2), 130, 200),
            (w(Q6_K, 3), 9, 300),
        ];
        let l = few_launch(params(Q4_0, 2048, 0), &parts, Groups::Each(1), None);
        assert_eq!((l.name, l.grid), ("bt_mma", (2 + 5 + 1, 1, 1)));
        let bytes: Vec<u8> = l.params.iter().flat_map(|x| x.to_le_bytes()).collect();
        // SAFETY: the launch's params are a BtRowsParams (plain integers), 8-byte aligned.
        let p: BtRowsParams = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
        assert_eq!((p.p.w.data, p.p.rows, p.p.out), (1, 37, 100));
        assert_eq!((p.w1.data, p.rows1, p.out1), (2, 130, 200));
        assert_eq!((p.w2.data, p.rows2, p.out2), (3, 9, 300));
        assert_eq!((p.blocks0, p.blocks1), (2, 5));
    }
}
