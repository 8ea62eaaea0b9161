//! `CudaBackend`: sessions (KV pool + setup cache), prefill, pipelined decode, profiling.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys};
use q4moe_model::backend::{
    self, Backend, BackendError, BackendInfo, BackendResult, DecodeRequest, DecodeStats, Flow,
    PhaseTimes, SessionId, TokenEvent,
};
use q4moe_model::sampling::Sampler;
use q4moe_model::{Config, Model};

use crate::device::{DevBuf, Device, Launch, Pinned};
use crate::fused::FusedStep;
use crate::graph::Graph;
use crate::l2::{L2Plan, L2Target};
use crate::params::StepState;
use crate::prefill::{self, Prefill};
use crate::step::{self, Choice, Ending, Kv, Scratch};
use crate::timeline::{self, Timeline};
use crate::weights::{self, Weights};
use crate::{AttGrid, CudaError, CudaOptions, GraphSetups, KernelTime, Result};

/// Steps whose token can be in flight at once (pinned read-back slots, event pairs); the step
/// at position pos uses slot pos % RING, as the kernels' finish_step publishes it.
const RING: usize = crate::params::STATE_RING;
/// A prompt's tokens queued on the device at once by `prefill` (pinned step states; the host
/// waits for the queue once a round).
const PREFILL_RING: usize = 64;

/// What a cached setup is valid for (DESIGN.md section 4).
#[derive(Debug, Clone, PartialEq, Eq)]
struct SessionKey {
    session: SessionId,
    geometry: String,
    batch: usize,
    kv_capacity: usize,
    fused: bool,
    /// What the step runs after its layers.
    ending: Ending,
    /// Steps the graph runs one after another (CudaOptions::graph_steps).
    steps: usize,
    /// Attention's blocks a KV head for the positions the steps reach (step::att_grid).
    att_grid: usize,
}

/// The setup cache entry: resolved launches, their fused form (op table, barrier) and the
/// graph captured from it (one node), or from the launches when there is no fused form.
struct StepCache {
    key: SessionKey,
    launches: Vec<Launch>,
    fused: Option<FusedStep>,
    graph: Graph,
}

struct Session {
    kv: Kv,
    len: usize,
    /// At most one entry per step variant (Ending): prefill and a sampled decode alternate
    /// without rebuilding.
    cache: Vec<StepCache>,
}

/// The positions a submission's attention reaches: its last step's, and the last its request (a
/// decode's max_tokens, a prompt's length) can reach (CudaOptions::attn_grid picks which sizes
/// the grid).
#[derive(Debug, Clone, Copy)]
struct Reach {
    last: usize,
    end: usize,
}

/// What `setup` resolved for one step.
enum StepRef {
    /// The cache is off: launches rebuilt for this token.
    Eager(Vec<Launch>),
    /// Index into the session's cache.
    Cached(usize),
}

pub struct CudaBackend {
    model: Arc<Model>,
    opts: CudaOptions,
    sessions: HashMap<SessionId, Session>,
    scratch: Scratch,
    w: Weights,
    pinned: Pinned<StepState>,
    /// The step states of the prompt tokens `prefill` has queued (PREFILL_RING).
    prompt_states: Pinned<StepState>,
    /// The logits of the host sampler's steps, copied in stream order after the step.
    host_logits: Pinned<f32>,
    /// Per-slot (start, end) events timing each step's GPU work.
    events: Vec<(sys::CUevent, sys::CUevent)>,
    /// Per slot, the event its step's GPU time counts from (`submit`), and the position of the
    /// last step submitted.
    timed_from: Vec<sys::CUevent>,
    last_submitted: Option<usize>,
    /// Per-launch event pairs of the profiled eager path.
    prof_events: Vec<(sys::CUevent, sys::CUevent)>,
    profile: HashMap<&'static str, (u64, f64, u64)>,
    /// Per-op times inside the fused step (Q4MOE_CUDA_STAMPS=1), same layout as `profile`.
    fused_profile: HashMap<String, (u64, f64, u64)>,
    /// The launch timeline's table (Q4MOE_CUDA_TIMELINE=1) and what it recorded.
    timeline: Option<Timeline>,
    timeline_profile: HashMap<String, (u64, f64, u64)>,
    /// The batched prefill's buffers (CudaOptions::prefill_chunk), where the geometry allows.
    prefill: Option<Prefill>,
    graph_setups: GraphSetups,
    dev: Device,
}

// SAFETY: raw handles are only used through &mut self after binding the context.
unsafe impl Send for CudaBackend {}

/// A submission's GPU time shared evenly by its steps.
fn share_gpu(steps: &mut [PhaseTimes], gpu: Duration) {
    let each = gpu / steps.len().max(1) as u32;
    steps.iter_mut().for_each(|p| p.gpu = Some(each));
}

fn ev() -> Result<sys::CUevent> {
    Ok(result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)?)
}

impl CudaBackend {
    pub fn new(model: Arc<Model>, opts: CudaOptions) -> std::result::Result<Self, BackendError> {
        Ok(Self::build(model, opts)?)
    }

    fn build(model: Arc<Model>, mut opts: CudaOptions) -> Result<Self> {
        let c = model.config.clone();
        weights::check_config(&c)?;
        opts.kv_capacity = opts.kv_capacity.min(c.context_length).max(1);
        opts.in_flight = opts.in_flight.clamp(1, RING - 1);
        if let Ok(v) = std::env::var("Q4MOE_CUDA_L2_TARGET") {
            opts.l2_targets = L2Target::parse_list(&v)
                .map_err(|e| CudaError::Unsupported(format!("Q4MOE_CUDA_L2_TARGET: {e}")))?;
        }
        let dev = Device::new(opts.kv_type)?;
        let kv_bytes = Kv::bytes(&c, opts.kv_capacity, opts.kv_type);
        // A chunk never holds more tokens than a session's positions.
        let chunk = if prefill::supports(&c) {
            opts.prefill_chunk.min(opts.kv_capacity)
        } else {
            0
        };
        let prefill_bytes = if chunk > 0 {
            Prefill::bytes(&c, chunk)
        } else {
            0
        };
        let w = weights::upload(
            &dev,
            &model,
            kv_bytes + Scratch::bytes(&c, opts.kv_capacity) + prefill_bytes,
            opts.router_fold,
        )?;
        let l2 = L2Plan::new(&dev, &c, &w, &opts)?;
        let mut scratch = Scratch::new(&dev, &c, &opts, l2)?;
        tracing::debug!(
            "device addresses: weights {:#x} ({} bytes), step state {:#x}",
            w.buf.ptr,
            w.buf.bytes,
            scratch.state.ptr
        );
        let prefill = match chunk {
            0 => None,
            n => Some(Prefill::new(&dev, &c, n, opts.prefill_part_budget)?),
        };
        let pinned = match opts.mapped_readback {
            true => Pinned::mapped(RING)?,
            false => Pinned::new(RING)?,
        };
        scratch.publish = pinned.device_ptr();
        let prompt_states = Pinned::new(PREFILL_RING)?;
        let host_logits = Pinned::new(c.vocab_size)?;
        let events = (0..RING)
            .map(|_| Ok((ev()?, ev()?)))
            .collect::<Result<Vec<_>>>()?;
        let timeline = match timeline::enabled() {
            true => Some(Timeline::new(&dev)?),
            false => None,
        };
        Ok(CudaBackend {
            model,
            opts,
            sessions: HashMap::new(),
            scratch,
            prefill,
            w,
            pinned,
            prompt_states,
            host_logits,
            timed_from: events.iter().map(|e| e.0).collect(),
            events,
            last_submitted: None,
            prof_events: Vec::new(),
            profile: HashMap::new(),
            fused_profile: HashMap::new(),
            timeline,
            timeline_profile: HashMap::new(),
            graph_setups: GraphSetups::default(),
            dev,
        })
    }

    pub fn set_setup_cache(&mut self, on: bool) {
        self.opts.setup_cache = on;
    }

    pub fn set_fused_step(&mut self, on: bool) {
        self.opts.fused_step = on;
    }

    pub fn set_in_flight(&mut self, n: usize) {
        self.opts.in_flight = n.clamp(1, RING - 1);
    }

    pub fn options(&self) -> &CudaOptions {
        &self.opts
    }

    /// The setup cache's graph captures and in-place attention regrids since the start.
    pub fn graph_setups(&self) -> GraphSetups {
        self.graph_setups
    }

    /// Per-kernel GPU times gathered on the eager path with `profile_kernels` on, per-op
    /// times inside the fused step (named "fused <op>") with Q4MOE_CUDA_STAMPS=1, and the
    /// launch timeline ("timeline <kernel> lead|step|spread") with Q4MOE_CUDA_TIMELINE=1.
    pub fn kernel_profile(&self) -> Vec<KernelTime> {
        let entry = |name: String, &(calls, secs, bytes): &(u64, f64, u64)| KernelTime {
            name,
            calls,
            total: Duration::from_secs_f64(secs),
            bytes_read: bytes,
        };
        let mut v: Vec<KernelTime> = self
            .profile
            .iter()
            .map(|(n, e)| entry(n.to_string(), e))
            .chain(
                self.fused_profile
                    .iter()
                    .map(|(n, e)| entry(format!("fused {n}"), e)),
            )
            .chain(
                self.timeline_profile
                    .iter()
                    .map(|(n, e)| entry(n.clone(), e)),
            )
            .collect();
        v.sort_by_key(|e| std::cmp::Reverse(e.total));
        v
    }

    pub fn reset_kernel_profile(&mut self) {
        self.profile.clear();
        self.fused_profile.clear();
        self.timeline_profile.clear();
    }

    pub fn set_profile_kernels(&mut self, on: bool) {
        self.opts.profile_kernels = on;
    }

    /// GB/s of a large device-to-device copy, counting bytes read and written.
    pub fn measure_copy_bandwidth(&self) -> f64 {
        self.copy_bandwidth().unwrap_or(0.0)
    }

    fn copy_bandwidth(&self) -> Result<f64> {
        self.dev.bind()?;
        let (free, _) = self.dev.free_mem()?;
        let bytes = (1usize << 30).min(free / 4).max(1 << 20);
        let (a, b) = (
            DevBuf::new(&self.dev, bytes)?,
            DevBuf::new(&self.dev, bytes)?,
        );
        a.fill(&self.dev, 1)?;
        let reps = 10;
        let stream = self.dev.stream;
        // SAFETY: both buffers hold `bytes`.
        unsafe { result::memcpy_dtod_async(b.ptr, a.ptr, bytes, stream)? };
        let ms = self.dev.time_ms(|| {
            for _ in 0..reps {
                // SAFETY: as above.
                unsafe { result::memcpy_dtod_async(b.ptr, a.ptr, bytes, stream)? };
            }
            Ok(())
        })?;
        Ok(2.0 * bytes as f64 * reps as f64 / (ms as f64 * 1e-3) / 1e9)
    }

    /// The key of `steps` steps of `ending` whose attention lengths reach `reach` at most.
    fn key(&self, session: SessionId, ending: Ending, steps: usize, reach: usize) -> SessionKey {
        SessionKey {
            session,
            geometry: format!("{:?}", self.model.config),
            batch: 1,
            kv_capacity: self.opts.kv_capacity,
            fused: self.opts.fused_step,
            ending,
            steps,
            att_grid: step::att_grid(&self.model.config, &self.scratch, reach),
        }
    }

    /// Steps a decode graph runs at once: CudaOptions::graph_steps where the steps' states are
    /// published to the host as they end (mapped read-back) and the graph is plain (the setup
    /// cache on, no fused step, no timeline recording, which keeps one step a table), else 1;
    /// at most what the state ring holds with in_flight + 1 submissions outstanding.
    fn graph_steps(&self) -> usize {
        let plain = self.opts.setup_cache && !self.opts.fused_step && self.timeline.is_none();
        match self.opts.mapped_readback && plain {
            true => (self.opts.graph_steps).clamp(1, RING / (self.opts.in_flight + 1)),
            false => 1,
        }
    }

    fn session(&mut self, id: SessionId) -> Result<&mut Session> {
        if !self.sessions.contains_key(&id) {
            let kv = Kv::new(&self.dev, &self.model.config, self.opts.kv_capacity)?;
            self.sessions.insert(
                id,
                Session {
                    kv,
                    len: 0,
                    cache: Vec::new(),
                },
            );
        }
        Ok(self.sessions.get_mut(&id).expect("inserted"))
    }

    /// The attention lengths a step's launches are built for (step::att_grid sizes the grid):
    /// the request's whole reach, or the step's own.
    fn att_reach(&self, at: Reach) -> usize {
        let last = match self.opts.attn_grid {
            AttGrid::Request => at.last.max(at.end),
            AttGrid::Step | AttGrid::Capacity => at.last,
        };
        last + 1
    }

    /// Host setup for `steps` steps in one graph (1 where the cache is off), the last at
    /// position `at.last`: a cache hit costs a key comparison; a miss (or the cache off)
    /// resolves every launch again from the weights' tables, unless only the attention's grid
    /// differs (regrid in place). The steps repeat the same launches: each reads its token and
    /// position from the device's step state, which the one before advanced.
    fn setup(&mut self, id: SessionId, ending: Ending, steps: usize, at: Reach) -> Result<StepRef> {
        let reach = self.att_reach(at);
        let key = self.key(id, ending, steps, reach);
        let cfg = self.model.config.clone();
        self.session(id)?;
        let (dev, w, s) = (&self.dev, &self.w, &self.scratch);
        let sess = self.sessions.get_mut(&id).expect("created");
        if !self.opts.setup_cache {
            let launches = step::build(&cfg, w, s, (&sess.kv, reach), ending);
            return Ok(StepRef::Eager(launches));
        }
        if let Some(i) = sess.cache.iter().position(|c| c.key == key) {
            return Ok(StepRef::Cached(i));
        }
        // The same step at another attention grid: its nodes take the grid in place.
        let regrid = step::att_regrid(&cfg, s, reach).filter(|_| self.opts.regrid_in_place);
        let same_but_grid = |c: &StepCache| {
            SessionKey {
                att_grid: key.att_grid,
                ..c.key.clone()
            } == key
        };
        if let (Some(i), Some((kernel, grid))) = (sess.cache.iter().position(same_but_grid), regrid)
        {
            let entry = &mut sess.cache[i];
            entry.graph.regrid(dev.func(kernel), grid)?;
            let attention = entry.launches.iter_mut().filter(|l| l.kernel == kernel);
            attention.for_each(|l| l.grid = grid);
            entry.key = key;
            self.graph_setups.regrids += 1;
            return Ok(StepRef::Cached(i));
        }
        // A stale entry of the same variant (options changed) is replaced.
        sess.cache
            .retain(|c| c.key.ending != ending || c.key.steps != steps);
        {
            let mut launches = step::layers(&cfg, w, s, (&sess.kv, reach));
            let tail = step::tail(&cfg, w, s, ending);
            let fused = match key.fused {
                true => {
                    let bytes = launches.iter().map(|l| l.bytes_read).sum();
                    FusedStep::new(dev, &cfg, w, s, &sess.kv, bytes)?
                }
                false => None,
            };
            let graph = match &fused {
                Some(f) => Graph::capture(dev, std::iter::once(f.launch()).chain(&tail))?,
                None => {
                    let step = launches.iter().chain(&tail);
                    Graph::capture(dev, std::iter::repeat_n(step, steps).flatten())?
                }
            };
            launches.extend(tail);
            self.graph_setups.captures += 1;
            sess.cache.push(StepCache {
                key,
                launches,
                fused,
                graph,
            });
        }
        Ok(StepRef::Cached(sess.cache.len() - 1))
    }

    /// Submits the `steps` steps from position `first` (one graph replay, or eager launches)
    /// before the end event of the last one's slot; each state reaches its slot's pinned
    /// memory from the step's own token choice (mapped read-back) or by a copy after the step.
    /// Their GPU time counts from the previous submission's end event where that is still
    /// queued or running (the GPU goes from one to the other: no start event need sit between
    /// them in the stream, ~1.3 us a step), else from a start event of its own.
    fn submit(&mut self, id: SessionId, step: StepRef, first: usize, steps: usize) -> Result<()> {
        let last = first + steps - 1;
        let (e0, e1) = self.events[last % RING];
        let prev = self.events[(first + RING - 1) % RING].1;
        // SAFETY: events created in `build`, recorded on our stream.
        let busy = self.last_submitted == first.checked_sub(1)
            && unsafe { result::event::query(prev) }
                .is_err_and(|e| e.0 == sys::CUresult::CUDA_ERROR_NOT_READY);
        self.timed_from[last % RING] = if busy { prev } else { e0 };
        if !busy {
            unsafe { result::event::record(e0, self.dev.stream)? };
        }
        self.last_submitted = Some(last);
        (first..=last).for_each(|p| self.pinned.clear(p));
        self.run_step(id, step)?;
        let st = self.scratch.state.ptr;
        // SAFETY: pinned slot of one StepState; copied in stream order after the step.
        unsafe {
            if self.scratch.publish == 0 {
                result::memcpy_dtoh_async(self.pinned.slot(last), st, self.dev.stream)?;
            }
            result::event::record(e1, self.dev.stream)?;
        }
        Ok(())
    }

    /// The step's work in stream order: the graph replay (and the fused step's phase times),
    /// or the eager launches.
    fn run_step(&mut self, id: SessionId, step: StepRef) -> Result<()> {
        match step {
            StepRef::Cached(i) => {
                let cache = &self.sessions[&id].cache[i];
                cache.graph.launch(&self.dev)?;
                if let Some(f) = &cache.fused {
                    for (name, secs) in f.phase_times(&self.dev)? {
                        let e = self.fused_profile.entry(name).or_insert((0, 0.0, 0));
                        e.0 += 1;
                        e.1 += secs;
                    }
                }
            }
            StepRef::Eager(ls) => self.launch_eager(&ls)?,
        }
        Ok(())
    }

    /// Queues prompt token `i` (at `pos`) without the output head (Ending::LayersOnly): its
    /// step state goes up from a pinned slot in stream order, so the host neither uploads
    /// synchronously nor waits for the step; it waits for the queue once every PREFILL_RING
    /// tokens, before it reuses the slots.
    fn queue_prompt_step(&mut self, id: SessionId, token: u32, at: Reach, i: usize) -> Result<()> {
        let pos = at.last;
        if i > 0 && i.is_multiple_of(PREFILL_RING) {
            self.dev.sync()?;
        }
        // Set up first: a first use captures the graph, which no copy may precede in its stream.
        let step = self.setup(id, Ending::LayersOnly, 1, at)?;
        let slot = self.prompt_states.slot(i);
        slot[0] = StepState {
            token,
            pos: pos as u32,
        };
        // SAFETY: one pinned StepState, not rewritten until the queue has drained (above).
        unsafe { result::memcpy_htod_async(self.scratch.state.ptr, slot, self.dev.stream)? };
        self.run_step(id, step)
    }

    /// The keys and values of `tokens` at positions pos0.. by the batched prefill, a chunk at a
    /// time (the host waits for each chunk before it rewrites the chunk's tokens).
    fn prefill_batched(&mut self, id: SessionId, tokens: &[u32], pos0: usize) -> Result<()> {
        self.session(id)?;
        // Out of self while its launches run, which the kernel profile needs self for.
        let mut p = self.prefill.take().expect("batched prefill");
        let done = self.prefill_chunks(&mut p, id, tokens, pos0);
        self.prefill = Some(p);
        done
    }

    fn prefill_chunks(
        &mut self,
        p: &mut Prefill,
        id: SessionId,
        tokens: &[u32],
        pos0: usize,
    ) -> Result<()> {
        let c = self.model.config.clone();
        for (i, chunk) in tokens.chunks(p.chunk).enumerate() {
            let pos = pos0 + i * p.chunk;
            self.dev.sync()?;
            p.load(&self.dev, &c, chunk, pos)?;
            let ls = p.launches(&c, &self.w, &self.sessions[&id].kv, pos, chunk.len());
            self.launch_eager(&ls)?;
        }
        self.dev.sync()
    }

    /// The timeline, where it records decode step `step` of a call.
    fn recording(&self, step: usize) -> Option<&Timeline> {
        self.timeline.as_ref().filter(|_| Timeline::records(step))
    }

    /// Adds what the timeline recorded in this decode's recorded steps, launches named after
    /// this session's step as `setup` built it for attention lengths up to `reach` (the grids
    /// must match the recorded ones); a no-op without Q4MOE_CUDA_TIMELINE=1.
    fn read_timeline(&mut self, id: SessionId, ending: Ending, reach: usize) -> Result<()> {
        let Some(t) = &self.timeline else {
            return Ok(());
        };
        let steps = t.read(&self.dev)?;
        let kv = &self.sessions[&id].kv;
        let launches = step::build(
            &self.model.config,
            &self.w,
            &self.scratch,
            (kv, reach),
            ending,
        );
        for stamps in &steps {
            for (name, (calls, secs, _)) in timeline::summarize(stamps, &launches) {
                let e = self.timeline_profile.entry(name).or_default();
                e.0 += calls;
                e.1 += secs;
            }
        }
        Ok(())
    }

    /// Launches one by one, each timed with events where `profile_kernels`.
    fn launch_eager(&mut self, ls: &[Launch]) -> Result<()> {
        match self.opts.profile_kernels {
            true => self.launch_profiled(ls),
            false => ls.iter().try_for_each(|l| self.dev.launch(l)),
        }
    }

    fn launch_profiled(&mut self, ls: &[Launch]) -> Result<()> {
        while self.prof_events.len() < ls.len() {
            self.prof_events.push((ev()?, ev()?));
        }
        for (l, &(a, b)) in ls.iter().zip(&self.prof_events) {
            unsafe { result::event::record(a, self.dev.stream)? };
            self.dev.launch(l)?;
            unsafe { result::event::record(b, self.dev.stream)? };
        }
        self.dev.sync()?;
        for (l, &(a, b)) in ls.iter().zip(&self.prof_events) {
            let ms = unsafe { result::event::elapsed(a, b)? };
            let e = self.profile.entry(l.name).or_insert((0, 0.0, 0));
            e.0 += 1;
            e.1 += ms as f64 * 1e-3;
            e.2 += l.bytes_read;
        }
        Ok(())
    }

    /// How a step's token reaches the host, for the bench's conditions.
    fn describe_readback(&self) -> String {
        let state = match self.opts.mapped_readback {
            true => "step state written to host-mapped memory by the token choice",
            false => "step state copied back after each step",
        };
        let greedy = match self.opts.head_argmax {
            true => "greedy choice in the output head's tail",
            false => "greedy choice by two arg-max launches after the head",
        };
        let steps = self.graph_steps();
        format!("{state}; {greedy}; {steps} decode step(s) a graph replay (cache on)")
    }

    /// Waits for the submission whose last step is at position `pos`; returns that step's
    /// state and the submission's GPU time.
    fn wait(&mut self, pos: usize) -> Result<(StepState, Duration)> {
        let (e0, e1) = (self.timed_from[pos % RING], self.events[pos % RING].1);
        let ms = unsafe {
            result::event::synchronize(e1)?;
            result::event::elapsed(e0, e1)?
        };
        Ok((
            self.read_state(pos)?,
            Duration::from_secs_f64(ms as f64 * 1e-3),
        ))
    }

    /// The state the finished step at position `pos` read back, which must be its own
    /// (position pos + 1): a mapped write that has not arrived yet is waited for (briefly),
    /// anything else is an error, not a token.
    fn read_state(&self, pos: usize) -> Result<StepState> {
        let want = pos as u32 + 1;
        let t0 = Instant::now();
        let mut st = self.pinned.read_state(pos);
        while st.pos != want && t0.elapsed() < Duration::from_secs(1) {
            std::hint::spin_loop();
            st = self.pinned.read_state(pos);
        }
        if st.pos != want {
            return Err(CudaError::ReadBack(format!(
                "the step at position {pos} read back a state of position {} (want {want})",
                st.pos
            )));
        }
        Ok(st)
    }

    /// The state of the step at position `pos`, published by its token choice, where a later
    /// step of the same graph (ending at `last`) holds the end event: read as it lands, the
    /// graph's end event queried now and then so an error or a missing write is reported, not
    /// waited for.
    fn wait_published(&self, pos: usize, last: usize) -> Result<StepState> {
        let end = self.events[last % RING].1;
        let want = pos as u32 + 1;
        let mut polls = 0u32;
        loop {
            let st = self.pinned.read_state(pos);
            if st.pos == want {
                return Ok(st);
            }
            polls = polls.wrapping_add(1);
            if polls.is_multiple_of(1024) {
                // SAFETY: an event of ours, recorded after the graph.
                match unsafe { result::event::query(end) } {
                    Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => {}
                    Err(e) => return Err(e.into()),
                    // The graph is done: its write has had its time.
                    Ok(()) => return self.read_state(pos),
                }
            }
            std::hint::spin_loop();
        }
    }

    fn set_state(&mut self, st: StepState) -> Result<()> {
        self.scratch
            .state
            .upload(&self.dev, 0, std::slice::from_ref(&st))
    }

    /// Runs one full step synchronously at `pos` with `token` (prefill, host sampling); with
    /// `logits_to_host` its logits are in `host_logits` on return.
    fn step_sync(
        &mut self,
        id: SessionId,
        token: u32,
        at: Reach,
        logits_to_host: bool,
    ) -> Result<Duration> {
        let pos = at.last;
        self.set_state(StepState {
            token,
            pos: pos as u32,
        })?;
        let step = self.setup(id, Ending::Head(Choice::default()), 1, at)?;
        self.submit(id, step, pos, 1)?;
        if logits_to_host {
            // SAFETY: vocab_size pinned floats; copied in stream order after the step.
            unsafe {
                result::memcpy_dtoh_async(
                    self.host_logits.all(),
                    self.scratch.logits.ptr,
                    self.dev.stream,
                )?
            };
        }
        let gpu = self.wait(pos)?.1;
        if logits_to_host {
            self.dev.sync()?;
        }
        Ok(gpu)
    }

    fn logits(&mut self) -> Result<Vec<f32>> {
        let mut v = vec![0f32; self.model.config.vocab_size];
        self.scratch.logits.download(&self.dev, 0, &mut v)?;
        Ok(v)
    }

    fn decode_device(
        &mut self,
        req: &DecodeRequest<'_>,
        on_token: &mut dyn FnMut(TokenEvent<'_>) -> Flow,
    ) -> Result<(DecodeStats, usize, bool)> {
        let id = req.session;
        let len0 = self.kv_len(id);
        let steps = req.max_tokens.min(self.opts.kv_capacity - len0);
        let f = self.opts.in_flight;
        self.set_state(StepState {
            token: req.first_token,
            pos: len0 as u32,
        })?;
        let choice = Choice::of(req.sampling);
        let ending = Ending::Head(choice);
        let s = &self.scratch;
        if let Some(cfg) = step::sample_config(req.sampling) {
            s.sample_cfg
                .upload(&self.dev, 0, std::slice::from_ref(&cfg))?;
        }
        // The draw sequence and the penalties' counts start where the host sampler's would
        // (DecodeRequest).
        let host = Sampler::new(req.sampling.clone(), req.history);
        if choice.sampled {
            s.rng.upload(&self.dev, 0, &[host.rng_state()])?;
        }
        if choice.penalized {
            let counts = host.counts(self.model.config.vocab_size);
            s.sample_counts.upload(&self.dev, 0, &counts)?;
        }
        let mut phases = vec![PhaseTimes::default(); steps];
        let (mut submitted, mut handed, mut stopped) = (0usize, 0usize, false);
        // Up to `f` submissions of k_max steps (one graph each) ahead of the host, oldest first
        // as (first step, steps); a remainder shorter than k_max goes a step a graph.
        let k_max = self.graph_steps();
        let mut queued: VecDeque<(usize, usize)> = VecDeque::new();
        while handed < steps && !stopped {
            while submitted < steps && submitted < handed + f * k_max {
                let k = if steps - submitted >= k_max { k_max } else { 1 };
                if let Some(t) = self.recording(submitted) {
                    t.begin_step(&self.dev)?;
                }
                let t0 = Instant::now();
                let at = Reach {
                    last: len0 + submitted + k - 1,
                    end: len0 + steps - 1,
                };
                let step = self.setup(id, ending, k, at)?;
                let t1 = Instant::now();
                self.submit(id, step, len0 + submitted, k)?;
                if let Some(t) = self.recording(submitted) {
                    t.end_step(&self.dev, submitted)?;
                }
                phases[submitted].setup = t1 - t0;
                phases[submitted].submit = t1.elapsed();
                queued.push_back((submitted, k));
                submitted += k;
            }
            let (first, k) = *queued.front().expect("the next step was submitted");
            let last = first + k - 1;
            let t0 = Instant::now();
            let st = if handed == last {
                let (st, gpu) = self.wait(len0 + last)?;
                share_gpu(&mut phases[first..=last], gpu);
                queued.pop_front();
                st
            } else {
                self.wait_published(len0 + handed, len0 + last)?
            };
            let t1 = Instant::now();
            stopped = on_token(TokenEvent {
                token: st.token,
                logits: None,
            }) == Flow::Stop;
            let p = &mut phases[handed];
            (p.wait, p.tail) = (t1 - t0, t1.elapsed());
            handed += 1;
        }
        // Steps computed ahead are discarded: the KV length below ignores what they wrote.
        self.dev.sync()?;
        // A stop inside a graph: its handed steps take their share of its time too.
        if let Some(&(first, k)) = queued.front().filter(|q| q.0 < handed) {
            let last = len0 + first + k - 1;
            let gpu = unsafe {
                result::event::elapsed(self.timed_from[last % RING], self.events[last % RING].1)?
            };
            share_gpu(
                &mut phases[first..first + k],
                Duration::from_secs_f64(gpu as f64 * 1e-3),
            );
        }
        if submitted > timeline::FROM_STEP {
            let first = Reach {
                last: len0 + timeline::FROM_STEP,
                end: len0 + steps - 1,
            };
            self.read_timeline(id, ending, self.att_reach(first))?;
        }
        phases.truncate(handed);
        Ok((
            DecodeStats { phases },
            handed,
            !stopped && handed < req.max_tokens,
        ))
    }

    fn decode_host(
        &mut self,
        req: &DecodeRequest<'_>,
        on_token: &mut dyn FnMut(TokenEvent<'_>) -> Flow,
    ) -> Result<(DecodeStats, usize, bool)> {
        let id = req.session;
        let len0 = self.kv_len(id);
        let steps = req.max_tokens.min(self.opts.kv_capacity - len0);
        let mut sampler = Sampler::new(req.sampling.clone(), req.history);
        let mut stats = DecodeStats::default();
        let (mut token, mut handed) = (req.first_token, 0);
        while handed < steps {
            let t0 = Instant::now();
            let at = Reach {
                last: len0 + handed,
                end: len0 + steps - 1,
            };
            let gpu = self.step_sync(id, token, at, true)?;
            let t1 = Instant::now();
            let logits = self.host_logits.all();
            let flow;
            (token, flow) =
                backend::sample_and_emit(&mut sampler, logits, req.want_logits, on_token);
            stats.phases.push(PhaseTimes {
                wait: t1 - t0,
                tail: t1.elapsed(),
                gpu: Some(gpu),
                ..Default::default()
            });
            handed += 1;
            if flow == Flow::Stop {
                return Ok((stats, handed, false));
            }
        }
        Ok((stats, handed, handed < req.max_tokens))
    }
}

impl Backend for CudaBackend {
    fn info(&self) -> BackendInfo {
        BackendInfo {
            kind: "cuda".into(),
            device: self.dev.name.clone(),
            resident_bytes: self.w.resident_bytes() as u64,
            kv_capacity: self.opts.kv_capacity,
            kv_type: self.opts.kv_type,
            cache_policy: self.scratch.l2.describe(),
            step_readback: self.describe_readback(),
            batched_step: false,
        }
    }

    fn config(&self) -> &Config {
        &self.model.config
    }

    fn prefill(
        &mut self,
        session: SessionId,
        tokens: &[u32],
        logits: backend::Logits,
    ) -> BackendResult<Vec<f32>> {
        let held = self.kv_len(session);
        backend::check_span(
            &self.model.config,
            session,
            held,
            self.opts.kv_capacity,
            tokens,
        )?;
        logits.check(tokens)?;
        if tokens.is_empty() {
            return Ok(Vec::new());
        }
        self.dev.bind()?;
        let vocab = self.model.config.vocab_size;
        let all_logits = logits == backend::Logits::All;
        let mut out = Vec::with_capacity(if all_logits {
            tokens.len() * vocab
        } else {
            vocab
        });
        let len0 = self.kv_len(session);
        let at = |i: usize| Reach {
            last: len0 + i,
            end: len0 + tokens.len() - 1,
        };
        // Only the positions whose logits are asked for go through the head.
        let queued = match logits {
            backend::Logits::None => tokens.len(),
            backend::Logits::Last => tokens.len() - 1,
            backend::Logits::All => 0,
        };
        if self.prefill.is_some() {
            self.prefill_batched(session, &tokens[..queued], len0)?;
        } else {
            for (i, &t) in tokens[..queued].iter().enumerate() {
                self.queue_prompt_step(session, t, at(i), i)?;
            }
            if queued == tokens.len() {
                // No step_sync follows to drain the queue, and the next prefill rewrites the
                // queued steps' pinned states.
                self.dev.sync()?;
            }
        }
        self.session(session)?.len = len0 + queued;
        for (i, &t) in tokens.iter().enumerate().skip(queued) {
            self.step_sync(session, t, at(i), false)?;
            self.session(session)?.len = len0 + i + 1;
            if all_logits || i + 1 == tokens.len() {
                out.extend(self.logits()?);
            }
        }
        Ok(out)
    }

    fn decode(
        &mut self,
        req: &DecodeRequest<'_>,
        on_token: &mut dyn FnMut(TokenEvent<'_>) -> Flow,
    ) -> BackendResult<DecodeStats> {
        if req.max_tokens == 0 {
            return Ok(DecodeStats::default());
        }
        let held = self.kv_len(req.session);
        backend::check_span(
            &self.model.config,
            req.session,
            held,
            self.opts.kv_capacity,
            &[req.first_token],
        )?;
        self.dev.bind()?;
        let len0 = self.kv_len(req.session);
        self.session(req.session)?;
        // The device handles greedy and the samplers step::sample_config accepts, penalties
        // included; the rest (top-k above SAMPLE_MAX_K, logits wanted) samples on the host.
        let device_ok = req.sampling.is_greedy() || step::sample_config(req.sampling).is_some();
        let host = req.want_logits || !device_ok;
        let (stats, handed, full) = if host {
            self.decode_host(req, on_token)?
        } else {
            self.decode_device(req, on_token)?
        };
        // The KV holds first_token and every handed token but the last.
        self.session(req.session)?.len = len0 + handed;
        if full {
            return Err(BackendError::ContextFull {
                session: req.session,
                needed: len0 + handed + 1,
                capacity: self.opts.kv_capacity,
            });
        }
        Ok(stats)
    }

    /// The CUDA batched step is issue 54's next part (slot tables on the device, the MoE
    /// grouped by expert on the device); until then a batched step is refused, changing nothing.
    fn step_batch(
        &mut self,
        _rows: &mut [backend::BatchRow<'_>],
        _out: &mut backend::BatchOut,
    ) -> BackendResult<()> {
        Err(BackendError::Unsupported(
            "the batched decode step on CUDA (issue 54)".into(),
        ))
    }

    fn kv_len(&self, session: SessionId) -> usize {
        self.sessions.get(&session).map_or(0, |s| s.len)
    }

    fn truncate(&mut self, session: SessionId, len: usize) {
        if let Some(s) = self.sessions.get_mut(&session) {
            s.len = s.len.min(len);
        }
    }

    fn drop_session(&mut self, session: SessionId) {
        let _ = self.dev.bind();
        self.sessions.remove(&session);
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let _ = self.dev.bind();
        let _ = self.dev.sync();
        self.sessions.clear();
        // SAFETY: events were created in `build` and are destroyed once (the pinned buffers
        // free themselves after this, with the context still bound).
        unsafe {
            for &(a, b) in self.events.iter().chain(&self.prof_events) {
                let _ = result::event::destroy(a);
                let _ = result::event::destroy(b);
            }
        }
    }
}
