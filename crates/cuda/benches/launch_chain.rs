//! What one dependent launch costs inside a captured graph (the decode step is 244 of them a
//! token), apart from any kernel's work: chains of empty `pdl_probe` launches (probe.cu) at the
//! grid sizes the step uses, with programmatic dependent launch where the device has it (sm_90+).
//! Prints one line a grid; skips where no GPU is usable.
//!   cargo bench -p q4moe-cuda --bench launch_chain

use q4moe_cuda::testing::TestDevice;

fn main() {
    if let Err(why) = q4moe_cuda::cuda_available() {
        println!("launch_chain: skipped ({why})");
        return;
    }
    let dev = TestDevice::new().expect("CUDA is available but the device did not start");
    let (n, reps) = (240, 50);
    println!("launch_chain: {n} dependent launches a graph, {reps} replays, PDL on sm_90+");
    for (blocks, threads) in [
        (1, 32),
        (32, 256),
        (132, 256),
        (264, 256),
        (528, 256),
        (768, 256),
    ] {
        let (us, count) = dev
            .launch_chain(n, blocks, threads, reps)
            .expect("launch chain");
        let ran = count as usize == n * (reps + 1);
        println!(
            "  {blocks:>4} blocks x {threads:>3} threads: {us:6.2} us a launch{}",
            if ran { "" } else { "  (COUNT WRONG)" }
        );
    }
    // A step's boundary: one graph replay per step with nothing between (bare), between the
    // events that time it (evented), with the copy read-back's copy too (copied), two steps in
    // one graph (joined).
    let b = dev.step_boundary(n, 132, reps).expect("step boundary");
    println!(
        "  step of {n} launches: {:.2} us bare, {:.2} us with events, {:.2} us with the copy read-back, {:.2} us two steps a graph",
        b.bare, b.evented, b.copied, b.joined
    );
}
