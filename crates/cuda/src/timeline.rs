//! The launch timeline (cargo feature `timeline`, kernels built with -DQ4MOE_TIMELINE;
//! common.cuh `tl_*`; a probe: the product never builds it): for each launch, when its
//! blocks reached pdl_wait and when they passed it (%globaltimer), so the step's overlap can be
//! read directly instead of inferred by leaving launches out: how long a kernel's first block was
//! resident before its predecessor finished (lead: its early weight loads' head start), the
//! time from one launch's first pass to the next one's (step: what the launch costs the chain),
//! and how long its blocks kept arriving after the first passed (spread: waves, or blocks that
//! found no room beside the predecessor). The hot kernels also mark (common.cuh `tl_mark`) when
//! the slowest recorded warp had its first input value (in), the last recorded block had its
//! input staged (x), reached the kernel's midpoint (mid: attention's tiles done, moe_gate_up's
//! first unit, the matvecs with a norm their slowest warp's preloaded weights landed) and made
//! its last store (end), so a step splits into the input chain, the work, and the release: from
//! the last end to the next launch's first pass, what a launch boundary costs. Recorded for
//! `STEPS` steady decode steps from `FROM_STEP`: a graph's replays repeat its launches'
//! %gridid, so the table holds one step; it is emptied before each recorded step and copied to
//! a device ring after it, read after the decode.

use std::collections::HashMap;

use cudarc::driver::result;

use crate::device::Device;
use crate::launch::Launch;
use crate::memory::DevBuf;
use crate::profile::{kernel_time, Entry};
use crate::{KernelTime, Result};

/// Slots of the device table (`TL_SLOTS` in common.cuh, a launch at its %gridid modulo it): one
/// step's ~245 launches.
const SLOTS: usize = 1024;
/// Fields a slot (`tl_val`): %gridid + 1, !first ready, last ready, !first pass, shape, the
/// marks x and end (common.cuh TL_X, TL_END; 0 where the kernel has none), last pass, the marks
/// in and mid (TL_IN, TL_MID).
const FIELDS: usize = 10;
/// The decode step of a call from which launches are recorded (earlier ones warm up).
pub const FROM_STEP: usize = 32;
/// Steps recorded from `FROM_STEP`.
pub const STEPS: usize = 16;
const TABLE_BYTES: usize = 8 * SLOTS * FIELDS;

/// One launch as the table holds it (nanoseconds of %globaltimer; the device samples the first
/// and the last 64 blocks of a grid, those dispatched first and last).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LaunchStamp {
    pub first_ready: u64,
    pub last_ready: u64,
    pub first_pass: u64,
    /// (blocks in the grid, threads a block, dynamic shared memory), as `shape` packs them.
    pub shape: u64,
    /// The last recorded block's input staged, and its last store (0: not marked).
    pub x: u64,
    pub end: u64,
    /// The last recorded block's pass, its slowest warp's first input values, and the kernel's
    /// midpoint (attention: its warps' tiles done; moe_gate_up: its first unit done; qkv and
    /// the head: the slowest warp's preloaded weights landed) (0: not marked).
    pub last_pass: u64,
    pub input: u64,
    pub mid: u64,
}

/// The key a launch is recognised by on both sides (common.cuh packs the same).
pub fn shape(grid: (u32, u32, u32), block: u32, smem: u32) -> u64 {
    ((grid.0 * grid.1 * grid.2) as u64) << 40 | (block as u64) << 24 | smem as u64
}

/// The device table (the module's `tl_val`), the ring of recorded steps and what was read
/// from it, as profile entries.
pub struct Timeline {
    vals: u64,
    ring: DevBuf,
    profile: HashMap<String, Entry>,
}

impl Timeline {
    pub fn new(dev: &Device) -> Result<Timeline> {
        let (vals, bytes) = dev.global("tl_val")?;
        assert_eq!(bytes, TABLE_BYTES, "tl_val's size");
        let ring = DevBuf::new(dev, STEPS * TABLE_BYTES)?;
        ring.fill(dev, 0)?;
        Ok(Timeline {
            vals,
            ring,
            profile: HashMap::new(),
        })
    }

    /// Before decode step `step` of a call is submitted: empties the table where it records.
    pub fn begin(&self, dev: &Device, step: usize) -> Result<()> {
        match Self::records(step) {
            true => self.begin_step(dev),
            false => Ok(()),
        }
    }

    /// After decode step `step` of a call is submitted: keeps its table where it records.
    pub fn end(&self, dev: &Device, step: usize) -> Result<()> {
        match Self::records(step) {
            true => self.end_step(dev, step),
            false => Ok(()),
        }
    }

    /// Adds what the ring holds, launches named after `launches` (the step as recorded).
    pub fn collect(&mut self, dev: &Device, launches: &[Launch]) -> Result<()> {
        for stamps in &self.read(dev)? {
            for (name, (calls, secs, _)) in summarize(stamps, launches) {
                let e = self.profile.entry(name).or_default();
                e.0 += calls;
                e.1 += secs;
            }
        }
        Ok(())
    }

    /// The entries collected so far ("timeline <kernel> lead|step|spread|...").
    pub fn report(&self) -> Vec<KernelTime> {
        self.profile
            .iter()
            .map(|(n, e)| kernel_time(n.clone(), e))
            .collect()
    }

    pub fn reset(&mut self) {
        self.profile.clear();
    }

    /// Whether decode step `step` of a call is recorded.
    pub fn records(step: usize) -> bool {
        (FROM_STEP..FROM_STEP + STEPS).contains(&step)
    }

    /// Empties the table in stream order: launches after this are recorded.
    pub fn begin_step(&self, dev: &Device) -> Result<()> {
        dev.memset_async(self.vals, 0, TABLE_BYTES)
    }

    /// Keeps what recorded step `step` wrote, in stream order after its launches.
    pub fn end_step(&self, dev: &Device, step: usize) -> Result<()> {
        let dst = self.ring.ptr + ((step - FROM_STEP) * TABLE_BYTES) as u64;
        // SAFETY: one table's bytes from the module variable into its slice of the ring.
        unsafe { result::memcpy_dtod_async(dst, self.vals, TABLE_BYTES, dev.stream)? };
        Ok(())
    }

    /// Each recorded step's launches in the order their first blocks passed pdl_wait (steps
    /// not recorded are empty); empties the ring.
    pub fn read(&self, dev: &Device) -> Result<Vec<Vec<LaunchStamp>>> {
        let mut vals = vec![0u64; STEPS * SLOTS * FIELDS];
        dev.download_raw(self.ring.ptr, &mut vals)?;
        self.ring.fill(dev, 0)?;
        Ok(vals.chunks_exact(SLOTS * FIELDS).map(stamps).collect())
    }
}

/// A table's launches in the order their first blocks passed pdl_wait.
fn stamps(table: &[u64]) -> Vec<LaunchStamp> {
    let mut v: Vec<LaunchStamp> = table
        .chunks_exact(FIELDS)
        .filter(|f| f[0] != 0)
        .map(|f| LaunchStamp {
            first_ready: !f[1],
            last_ready: f[2],
            first_pass: !f[3],
            shape: f[4],
            x: f[5],
            end: f[6],
            last_pass: f[7],
            input: f[8],
            mid: f[9],
        })
        .collect();
    v.sort_by_key(|s| s.first_pass);
    v
}

/// Per kernel name (launches told apart by shape; names sharing one are joined by "|"): the
/// mean lead, step and spread over one step's launches as profile entries "timeline <name>
/// <what>" of (calls, seconds, 0), and where the kernel marks them, pass, in, x, mid and end
/// (from its first pass) and release (from its end to the next launch's first pass). The last
/// launch has no step or release (nothing recorded after it).
pub fn summarize(stamps: &[LaunchStamp], launches: &[Launch]) -> HashMap<String, (u64, f64, u64)> {
    let mut names: HashMap<u64, Vec<&str>> = HashMap::new();
    for l in launches {
        let n = names.entry(shape(l.grid, l.block, l.smem)).or_default();
        if !n.contains(&l.name) {
            n.push(l.name);
        }
    }
    let mut out: HashMap<String, (u64, f64, u64)> = HashMap::new();
    let mut add = |name: &str, what: &str, ns: u64| {
        let e = out.entry(format!("timeline {name} {what}")).or_default();
        e.0 += 1;
        e.1 += ns as f64 * 1e-9;
    };
    for (i, s) in stamps.iter().enumerate() {
        let name = names
            .get(&s.shape)
            .map_or_else(|| "(other)".to_string(), |n| n.join("|"));
        add(&name, "lead", s.first_pass.saturating_sub(s.first_ready));
        add(&name, "spread", s.last_ready.saturating_sub(s.first_pass));
        let marks = [
            ("pass", s.last_pass),
            ("in", s.input),
            ("x", s.x),
            ("mid", s.mid),
            ("end", s.end),
        ];
        for (what, at) in marks {
            if at != 0 {
                add(&name, what, at.saturating_sub(s.first_pass));
            }
        }
        if let Some(next) = stamps.get(i + 1) {
            add(&name, "step", next.first_pass.saturating_sub(s.first_pass));
            if s.end != 0 {
                add(&name, "release", next.first_pass.saturating_sub(s.end));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::Kernel;

    fn launch(name: &'static str, blocks: u32) -> Launch {
        Launch::new(Kernel::Embed, name, (blocks, 1, 1), 256, 0, &0u32, 0)
    }

    fn stamp(blocks: u32, ready: u64, pass: u64, last_ready: u64) -> LaunchStamp {
        LaunchStamp {
            first_ready: ready,
            last_ready,
            first_pass: pass,
            shape: shape((blocks, 1, 1), 256, 0),
            x: 0,
            end: 0,
            last_pass: 0,
            input: 0,
            mid: 0,
        }
    }

    #[test]
    fn summary_names_launches_by_shape() {
        let ls = [
            launch("qkv", 320),
            launch("attn", 128),
            launch("o_proj", 384),
        ];
        // Two layers' worth: qkv resident 400 ns early, attention not at all and 300 ns of
        // its blocks arriving late, a launch no step names.
        let st = [
            stamp(320, 600, 1000, 1000),
            stamp(128, 2000, 2000, 2300),
            stamp(384, 2500, 3000, 3000),
            stamp(320, 3600, 4000, 4100),
            stamp(7, 4500, 4600, 4600),
        ];
        let s = summarize(&st, &ls);
        let check = |k: &str, calls: u64, ns: f64| {
            let (c, secs, _) = s[k];
            assert_eq!(c, calls, "{k} calls");
            assert!(
                (secs * 1e9 - ns).abs() < 1e-6,
                "{k}: {} ns, want {ns}",
                secs * 1e9
            );
        };
        check("timeline qkv lead", 2, 800.0);
        check("timeline qkv step", 2, 1600.0);
        check("timeline qkv spread", 2, 100.0);
        check("timeline attn lead", 1, 0.0);
        check("timeline attn spread", 1, 300.0);
        check("timeline o_proj step", 1, 1000.0);
        check("timeline (other) lead", 1, 100.0);
        assert!(
            !s.contains_key("timeline (other) step"),
            "the last launch has no step"
        );
        assert!(
            !s.contains_key("timeline qkv release"),
            "no marks, no release"
        );
    }

    #[test]
    fn marks_split_a_step_into_input_work_and_release() {
        let ls = [launch("qkv", 320), launch("attn", 128)];
        let marked = |blocks, pass, x, end| LaunchStamp {
            x,
            end,
            ..stamp(blocks, pass, pass, pass)
        };
        // qkv passes at 1000, stages its input by 1600, ends at 2500; attention passes at 3100
        // and ends at 5000 with nothing after it.
        let mut attn = marked(128, 3100, 3500, 5000);
        attn.mid = 4200;
        let st = [marked(320, 1000, 1600, 2500), attn];
        let s = summarize(&st, &ls);
        let ns = |k: &str| s[k].1 * 1e9;
        assert!((ns("timeline attn mid") - 1100.0).abs() < 1e-6);
        assert!(!s.contains_key("timeline qkv mid"), "no mid mark");
        assert!((ns("timeline qkv x") - 600.0).abs() < 1e-6);
        assert!((ns("timeline qkv end") - 1500.0).abs() < 1e-6);
        assert!((ns("timeline qkv release") - 600.0).abs() < 1e-6);
        assert!((ns("timeline attn end") - 1900.0).abs() < 1e-6);
        assert!(!s.contains_key("timeline attn release"), "the last launch");
    }

    #[test]
    fn shared_shapes_join_names() {
        let ls = [launch("qkv", 320), launch("head", 320), launch("qkv", 320)];
        let s = summarize(&[stamp(320, 0, 10, 10)], &ls);
        assert!(s.contains_key("timeline qkv|head lead"));
    }
}
