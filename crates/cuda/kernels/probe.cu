// Launch-chain probe (benches/launch_chain.rs): what one dependent launch costs inside a
// captured graph with programmatic dependent launch, apart from any kernel's own work. Each
// launch waits for its predecessor, then block 0 reads what the predecessor wrote and writes it
// plus one: a data dependency through L2, as between the step's kernels. The final count shows
// every launch ran.
struct ProbeParams {
    u64 cell;  // u32*
};
SIZE_IS(ProbeParams, 8); FIELD_AT(ProbeParams, cell, 0);

extern "C" __global__ void pdl_probe(const ProbeParams p) {
    pdl_start();
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        u32* c = (u32*)p.cell;
        *c = __ldcg(c) + 1;
    }
}
