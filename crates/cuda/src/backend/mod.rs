//! `CudaBackend`: sessions (KV pool + setup cache), prefill, pipelined decode, profiling.

mod sessions;
mod step_batch;

use std::collections::HashMap;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::result;
use q4moe_model::backend::{
    self, Backend, BackendError, BackendInfo, BackendResult, DecodeRequest, DecodeStats, Flow,
    PhaseTimes, SessionId, TokenEvent,
};
use q4moe_model::sampling::Sampler;
use q4moe_model::{Config, Model};

use crate::batch::BatchBufs;
use crate::device::Device;
use crate::l2::L2Plan;
use crate::launch::Launch;
use crate::memory::{DevBuf, Pinned};
use crate::params::{StepState, ATT_TC_MIN_SPAN_DEFAULT};
use crate::pipeline::{Pipeline, RING};
use crate::prefill::{self, BtGqa, Prefill};
use crate::profile::Profiler;
use crate::session::{Session, SessionKey, StepCache};
use crate::step::{self, Choice, Ending, Kv, Scratch};
#[cfg(feature = "timeline")]
use crate::timeline::{self, Timeline};
use crate::weights::{self, Weights};
use crate::{CudaOptions, GraphSetups, KernelTime, Result};

/// A prompt's tokens queued on the device at once by `prefill` (pinned step states; the host
/// waits for the queue once a round).
const PREFILL_RING: usize = 64;

/// The positions a submission's attention reaches: its last step's, and the last its request (a
/// decode's max_tokens, a prompt's length) can reach; attention's grid is sized for the latter,
/// so a request's steps never change graph midway.
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
    /// The in-flight ring: each step's state published to the host, events timing each
    /// submission.
    pipeline: Pipeline,
    /// The step states of the prompt tokens `prefill` has queued (PREFILL_RING).
    prompt_states: Pinned<StepState>,
    /// The logits of the host sampler's steps, copied in stream order after the step.
    host_logits: Pinned<f32>,
    /// Per-launch GPU times of the eager path (CudaOptions::profile_kernels).
    profiler: Profiler,
    /// The launch timeline's table and what it recorded (the `timeline` feature).
    #[cfg(feature = "timeline")]
    timeline: Timeline,
    /// The batched prefill's buffers (CudaOptions::prefill_chunk), where the geometry allows.
    prefill: Option<Prefill>,
    /// The batched step's buffers (batch.rs).
    batch: BatchBufs,
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

impl CudaBackend {
    pub fn new(model: Arc<Model>, opts: CudaOptions) -> std::result::Result<Self, BackendError> {
        Ok(Self::build(model, opts)?)
    }

    fn build(model: Arc<Model>, mut opts: CudaOptions) -> Result<Self> {
        let c = model.config.clone();
        weights::check_config(&c)?;
        opts.kv_capacity = opts.kv_capacity.min(c.context_length).max(1);
        opts.in_flight = opts.in_flight.clamp(1, RING - 1);
        let dev = Device::new(&opts)?;
        let kv_bytes = Kv::bytes(&c, opts.kv_capacity, opts.kv_type);
        // A chunk never holds more tokens than a session's positions.
        let chunk = match prefill::supports(&c) {
            true => opts.prefill_chunk.min(opts.kv_capacity),
            false => 0,
        };
        let prefill_bytes = match chunk {
            0 => 0,
            n => Prefill::bytes(&c, n),
        };
        let scratch_bytes = Scratch::bytes(&c, opts.kv_capacity);
        let w = weights::upload(
            &dev,
            &model,
            kv_bytes + scratch_bytes + prefill_bytes,
            &opts,
        )?;
        let l2 = L2Plan::new(dev.max_l2_window()?);
        let mut scratch = Scratch::new(&dev, &c, &opts, l2)?;
        tracing::debug!(
            "device addresses: weights {:#x} ({} bytes), step state {:#x}",
            w.buf.ptr,
            w.buf.bytes,
            scratch.state.ptr
        );
        let prefill = match chunk {
            0 => None,
            n => Some(Prefill::new(
                &dev,
                &c,
                n,
                (opts.prefill_part_budget, opts.few_tokens),
                scratch.att_tc.then_some(BtGqa {
                    max_blocks: scratch.att_blocks,
                    min_span: ATT_TC_MIN_SPAN_DEFAULT,
                    stage: scratch.att_stage,
                }),
            )?),
        };
        let pipeline = Pipeline::new()?;
        scratch.publish = pipeline.publish_ptr();
        Ok(CudaBackend {
            model,
            opts,
            sessions: HashMap::new(),
            scratch,
            prefill,
            batch: BatchBufs::default(),
            w,
            pipeline,
            prompt_states: Pinned::new(PREFILL_RING)?,
            host_logits: Pinned::new(c.vocab_size)?,
            profiler: Profiler::default(),
            #[cfg(feature = "timeline")]
            timeline: Timeline::new(&dev)?,
            graph_setups: GraphSetups::default(),
            dev,
        })
    }

    pub fn set_setup_cache(&mut self, on: bool) {
        self.opts.setup_cache = on;
    }

    pub fn set_in_flight(&mut self, n: usize) {
        self.opts.in_flight = n.clamp(1, RING - 1);
    }

    pub fn options(&self) -> &CudaOptions {
        &self.opts
    }

    /// The setup cache's graph captures since the start.
    pub fn graph_setups(&self) -> GraphSetups {
        self.graph_setups
    }

    /// Per-kernel GPU times gathered on the eager path with `profile_kernels` on (and with the
    /// `timeline` feature the launch timeline's "timeline <kernel> lead|step|spread|..."),
    /// longest first.
    pub fn kernel_profile(&self) -> Vec<KernelTime> {
        let mut v = self.profiler.report();
        #[cfg(feature = "timeline")]
        v.extend(self.timeline.report());
        v.sort_by_key(|e| std::cmp::Reverse(e.total));
        v
    }

    pub fn reset_kernel_profile(&mut self) {
        self.profiler.reset();
        #[cfg(feature = "timeline")]
        self.timeline.reset();
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
            kv_capacity: self.sessions.get(&session).map_or(0, |s| s.kv.capacity),
            ending,
            steps,
            att_grid: step::att_grid(&self.model.config, &self.scratch, reach),
        }
    }

    /// Steps a decode graph runs at once: CudaOptions::graph_steps where the setup cache is on
    /// (and no timeline records, which keeps one step a table), else 1; at most what the state
    /// ring holds with in_flight + 1 submissions outstanding.
    fn graph_steps(&self) -> usize {
        match self.opts.setup_cache && !cfg!(feature = "timeline") {
            true => (self.opts.graph_steps).clamp(1, RING / (self.opts.in_flight + 1)),
            false => 1,
        }
    }

    /// `tokens` may go into `session` next (backend::check_span).
    fn check_span(&self, session: SessionId, tokens: &[u32]) -> BackendResult<()> {
        let held = self.kv_len(session);
        backend::check_span(
            &self.model.config,
            session,
            held,
            self.opts.kv_capacity,
            tokens,
        )
    }

    /// The attention lengths a step's launches are built for (step::att_grid sizes the grid):
    /// the request's whole reach.
    fn att_reach(at: Reach) -> usize {
        at.last.max(at.end) + 1
    }

    /// Host setup for `steps` steps in one graph (1 where the cache is off), the last at
    /// position `at.last`: a cache hit costs a key comparison; a miss (or the cache off)
    /// resolves every launch again from the weights' tables.
    fn setup(&mut self, id: SessionId, ending: Ending, steps: usize, at: Reach) -> Result<StepRef> {
        let reach = Self::att_reach(at);
        self.session(id)?;
        let key = self.key(id, ending, steps, reach);
        let (c, w, s) = (&self.model.config, &self.w, &self.scratch);
        let sess = self.sessions.get_mut(&id).expect("created");
        if !self.opts.setup_cache {
            let launches = step::build(c, w, s, (&sess.kv, reach), ending);
            return Ok(StepRef::Eager(launches));
        }
        if let Some(i) = sess.lookup(&key) {
            return Ok(StepRef::Cached(i));
        }
        let entry = StepCache::capture(&self.dev, (c, w, s), &sess.kv, key, reach)?;
        self.graph_setups.captures += 1;
        Ok(StepRef::Cached(sess.insert(entry)))
    }

    /// Submits the `steps` steps from position `first` (one graph replay, or eager launches)
    /// inside the pipeline's events; each state reaches its slot's mapped memory from the
    /// step's own token choice.
    fn submit(&mut self, id: SessionId, step: StepRef, first: usize, steps: usize) -> Result<()> {
        let last = first + steps - 1;
        self.pipeline.begin(self.dev.stream, first, last)?;
        self.run_step(id, step)?;
        self.pipeline.end(self.dev.stream, last)
    }

    /// The step's work in stream order: the graph replay, or the eager launches.
    fn run_step(&mut self, id: SessionId, step: StepRef) -> Result<()> {
        match step {
            StepRef::Cached(i) => self.sessions[&id].entry(i).graph.launch(&self.dev),
            StepRef::Eager(ls) => self.launch_eager(&ls),
        }
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

    /// One batched submission: `group`'s tokens through every layer and the head, their
    /// logits appended to `out.logits`, their sessions one position longer.
    /// Adds what the timeline recorded in this decode's recorded steps, launches named after
    /// this session's step as `setup` built it for the first recorded step's reach (the grids
    /// must match the recorded ones).
    #[cfg(feature = "timeline")]
    fn read_timeline(&mut self, id: SessionId, ending: Ending, reach: usize) -> Result<()> {
        let kv = &self.sessions[&id].kv;
        let (c, w, s) = (&self.model.config, &self.w, &self.scratch);
        let launches = step::build(c, w, s, (kv, reach), ending);
        self.timeline.collect(&self.dev, &launches)
    }

    /// Launches one by one, each timed with events where `profile_kernels`.
    fn launch_eager(&mut self, ls: &[Launch]) -> Result<()> {
        match self.opts.profile_kernels {
            true => self.profiler.launch_timed(&self.dev, ls),
            false => ls.iter().try_for_each(|l| self.dev.launch(l)),
        }
    }

    /// How a step's token reaches the host, for the bench's conditions.
    fn describe_readback(&self) -> String {
        format!(
            "step state written to host-mapped memory by the token choice; greedy choice in \
             the output head's tail; {} decode step(s) a graph replay (cache on)",
            self.graph_steps()
        )
    }

    fn set_state(&mut self, st: StepState) -> Result<()> {
        self.scratch
            .state
            .upload(&self.dev, 0, std::slice::from_ref(&st))
    }

    /// Runs one full step synchronously at `pos` with `token` (prefill, host sampling); with
    /// `logits_to_host` its logits are in `host_logits` on return. `meanwhile` runs on the
    /// host once the step is submitted, before the wait (a constraint's next mask).
    fn step_sync(
        &mut self,
        id: SessionId,
        token: u32,
        at: Reach,
        logits_to_host: bool,
        meanwhile: &mut dyn FnMut(),
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
        meanwhile();
        let gpu = self.pipeline.wait(pos)?.1;
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

    /// The device's state for a decode of `req` from position `len0`: the step state, and the
    /// sampler's settings, draw sequence and penalty counts where the choice uses them.
    fn start_device_decode(&mut self, req: &DecodeRequest<'_>, len0: usize) -> Result<Choice> {
        self.set_state(StepState {
            token: req.first_token,
            pos: len0 as u32,
        })?;
        let choice = Choice::of(req.sampling);
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
        Ok(choice)
    }

    /// A decode's session, the positions it holds, and the steps it may run (what it asked
    /// for, at most what the capacity has left).
    fn decode_span(&self, req: &DecodeRequest<'_>) -> (SessionId, usize, usize) {
        let len0 = self.kv_len(req.session);
        (
            req.session,
            len0,
            req.max_tokens.min(self.opts.kv_capacity - len0),
        )
    }

    /// The device chooses every token; with `constrained` (the request's sampler, holding a
    /// constraint), among the ids the constraint allows: the host writes them as bits before
    /// each step (Sampler::mask_bits) and tells the sampler the token after it, so a step waits
    /// for the one before (one in flight, a step a graph) but only its token comes back.
    fn decode_device(
        &mut self,
        req: &DecodeRequest<'_>,
        mut constrained: Option<&mut Sampler>,
        on_token: &mut dyn FnMut(TokenEvent<'_>) -> Flow,
    ) -> Result<(DecodeStats, usize, bool)> {
        let (id, len0, steps) = self.decode_span(req);
        let masked = constrained.is_some();
        let f = if masked { 1 } else { self.opts.in_flight };
        let choice = self.start_device_decode(req, len0)?;
        let ending = Ending::Head(Choice { masked, ..choice });
        let mut bits = vec![0u32; self.model.config.vocab_size.div_ceil(32)];
        let mut phases = vec![PhaseTimes::default(); steps];
        let (mut submitted, mut handed, mut stopped) = (0usize, 0usize, false);
        // Up to `f` submissions of k_max steps (one graph each) ahead of the host, oldest first
        // as (first step, steps); a remainder shorter than k_max goes a step a graph.
        let k_max = if masked { 1 } else { self.graph_steps() };
        let mut queued: VecDeque<(usize, usize)> = VecDeque::new();
        while handed < steps && !stopped {
            while submitted < steps && submitted < handed + f * k_max {
                let k = if steps - submitted >= k_max { k_max } else { 1 };
                if let Some(s) = constrained.as_deref_mut() {
                    // The step before is done (one in flight): its mask may be rewritten.
                    if !s.mask_bits(&mut bits) {
                        bits.fill(u32::MAX);
                    }
                    self.scratch.mask.upload(&self.dev, 0, &bits)?;
                }
                #[cfg(feature = "timeline")]
                self.timeline.begin(&self.dev, submitted)?;
                let t0 = Instant::now();
                let at = Reach {
                    last: len0 + submitted + k - 1,
                    end: len0 + steps - 1,
                };
                let step = self.setup(id, ending, k, at)?;
                let t1 = Instant::now();
                self.submit(id, step, len0 + submitted, k)?;
                #[cfg(feature = "timeline")]
                self.timeline.end(&self.dev, submitted)?;
                phases[submitted].setup = t1 - t0;
                phases[submitted].submit = t1.elapsed();
                queued.push_back((submitted, k));
                submitted += k;
            }
            let (first, k) = *queued.front().expect("the next step was submitted");
            let last = first + k - 1;
            let t0 = Instant::now();
            let st = if handed == last {
                let (st, gpu) = self.pipeline.wait(len0 + last)?;
                share_gpu(&mut phases[first..=last], gpu);
                queued.pop_front();
                st
            } else {
                self.pipeline.wait_published(len0 + handed, len0 + last)?
            };
            let t1 = Instant::now();
            if let Some(s) = constrained.as_deref_mut() {
                s.accept(st.token);
            }
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
            let gpu = self.pipeline.gpu_time(len0 + first + k - 1)?;
            share_gpu(&mut phases[first..first + k], gpu);
        }
        #[cfg(feature = "timeline")]
        if submitted > timeline::FROM_STEP {
            let first = Reach {
                last: len0 + timeline::FROM_STEP,
                end: len0 + steps - 1,
            };
            self.read_timeline(id, ending, Self::att_reach(first))?;
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
        let (id, len0, steps) = self.decode_span(req);
        let mut sampler = Sampler::new(req.sampling.clone(), req.history);
        let mut stats = DecodeStats::default();
        let (mut token, mut handed) = (req.first_token, 0);
        while handed < steps {
            let t0 = Instant::now();
            let at = Reach {
                last: len0 + handed,
                end: len0 + steps - 1,
            };
            // The grammar engine works out the next mask while the device runs the step.
            let gpu = self.step_sync(id, token, at, true, &mut || sampler.prepare())?;
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
            batched_step: self.opts.batched_step && self.prefill.is_some(),
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
        self.check_span(session, tokens)?;
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
        self.session_holding(session, len0 + tokens.len())?;
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
            self.step_sync(session, t, at(i), false, &mut || {})?;
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
        self.check_span(req.session, &[req.first_token])?;
        self.dev.bind()?;
        let (_, len0, steps) = self.decode_span(req);
        self.session_holding(req.session, len0 + steps)?;
        // The device handles greedy and the samplers step::sample_config accepts, penalties
        // included, under a constraint's token mask too (the host's grammar engine gives the
        // bits each step); the rest (top-k above SAMPLE_MAX_K, a logit bias, logits wanted)
        // samples on the host.
        let device_ok = req.sampling.logit_bias.is_empty()
            && (req.sampling.is_greedy() || step::sample_config(req.sampling).is_some());
        let masked = req.sampling.constraint.is_some();
        let (stats, handed, full) = if req.want_logits || !device_ok {
            self.decode_host(req, on_token)?
        } else if masked {
            let mut sampler = Sampler::new(req.sampling.clone(), req.history);
            self.decode_device(req, Some(&mut sampler), on_token)?
        } else {
            self.decode_device(req, None, on_token)?
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

    /// The batched step (batch.rs) on the batched prefill's kernels; where the geometry has
    /// none (prefill::supports), refused, changing nothing.
    fn step_batch(
        &mut self,
        rows: &mut [backend::BatchRow<'_>],
        out: &mut backend::BatchOut,
    ) -> BackendResult<()> {
        self.run_batch(rows, out)
    }

    fn kv_len(&self, session: SessionId) -> usize {
        self.sessions.get(&session).map_or(0, |s| s.len)
    }

    fn kv_bytes(&self, session: SessionId) -> usize {
        self.sessions.get(&session).map_or(0, |s| s.kv.held_bytes())
    }

    fn kv_pool(&self) -> Option<backend::KvPoolStats> {
        let o = &self.opts;
        (o.kv_pool_bytes != usize::MAX).then(|| backend::KvPoolStats {
            capacity_bytes: o.kv_pool_bytes,
            used_bytes: self.kv_used(),
            page_positions: o.kv_grow_from,
            page_bytes: Kv::bytes(&self.model.config, o.kv_grow_from, o.kv_type),
        })
    }

    fn kv_needed(&self, session: SessionId, positions: usize) -> usize {
        let need = self.kv_len(session) + positions;
        self.kv_growth(session, need.min(self.opts.kv_capacity))
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

    fn fork(&mut self, src: SessionId, dst: SessionId, len: usize) -> BackendResult<()> {
        backend::check_fork(src, dst, len, self.kv_len(src))?;
        Ok(self.fork_kv(src, dst, len)?)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let _ = self.dev.bind();
        let _ = self.dev.sync();
        self.sessions.clear();
        // The pipeline's and the profiler's events and the pinned buffers free themselves
        // after this, with the context still bound.
    }
}
