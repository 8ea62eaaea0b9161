//! Continuous batching on the CPU backend over a tiny synthetic model: each sequence's output
//! is what `Engine::generate` gives it alone, prompts come in under the prefill budget while
//! the others keep decoding, and a cancelled sequence leaves at the next step.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use q4moe_engine::{
    BatchOptions, Batcher, Engine, Finish, Flow, GenerateOutput, GenerateRequest, SamplingParams,
    SequenceSink,
};
use q4moe_model::synth::SynthQuant;

mod common;
use common::{alone, run_to_end, tiny_engine};

#[derive(Debug, Clone, PartialEq)]
enum Ev {
    Text(usize),
    Done(usize),
}

/// Records every sequence's events in one shared log, in the order the batch emits them.
struct Rec {
    id: usize,
    log: Arc<Mutex<Vec<Ev>>>,
    outs: Arc<Mutex<Vec<Option<GenerateOutput>>>>,
    cancel: Arc<AtomicBool>,
}

impl SequenceSink for Rec {
    fn piece(&mut self, _: q4moe_engine::Piece<'_>) -> Flow {
        self.log.lock().unwrap().push(Ev::Text(self.id));
        Flow::Continue
    }
    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }
    fn finished(self: Box<Self>, result: q4moe_engine::Result<GenerateOutput>) {
        self.log.lock().unwrap().push(Ev::Done(self.id));
        self.outs.lock().unwrap()[self.id] = Some(result.unwrap());
    }
}

struct Harness {
    log: Arc<Mutex<Vec<Ev>>>,
    outs: Arc<Mutex<Vec<Option<GenerateOutput>>>>,
    cancels: Vec<Arc<AtomicBool>>,
}

impl Harness {
    fn new(n: usize) -> Self {
        Harness {
            log: Arc::default(),
            outs: Arc::new(Mutex::new(vec![None; n])),
            cancels: (0..n).map(|_| Arc::default()).collect(),
        }
    }

    fn sink(&self, id: usize) -> Box<Rec> {
        Box::new(Rec {
            id,
            log: self.log.clone(),
            outs: self.outs.clone(),
            cancel: self.cancels[id].clone(),
        })
    }

    fn out(&self, id: usize) -> GenerateOutput {
        self.outs.lock().unwrap()[id].clone().expect("finished")
    }

    fn texts(&self, id: usize) -> usize {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|e| **e == Ev::Text(id))
            .count()
    }
}

fn requests(engine: &Engine) -> Vec<GenerateRequest> {
    let prompts = [
        "The quick brown fox jumps over the lazy dog.",
        "Once upon a time",
        "A much longer prompt, so that its prefill takes several chunks of the budget: one two three four five six seven eight nine ten.",
        "Hi",
    ];
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut req = GenerateRequest::new(engine.encode_prompt(p).unwrap(), 12 + 5 * i);
            req.stop_at_eos = false;
            if i % 2 == 1 {
                req.sampling = SamplingParams {
                    temperature: 0.9,
                    top_k: 40,
                    top_p: 0.95,
                    repetition_penalty: 1.1,
                    seed: 11 + i as u64,
                    ..Default::default()
                };
            }
            req
        })
        .collect()
}

#[test]
fn four_sequences_in_a_batch_give_what_each_gives_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = tiny_engine(&dir, SynthQuant::Q4_0);
    let reqs = requests(&engine);
    let outs = alone(&mut engine, &reqs);
    let h = Harness::new(reqs.len());
    let opts = BatchOptions {
        max_batch: 4,
        prefill_budget: 5,
    };
    let mut batch = Batcher::new(opts).unwrap();
    for (i, r) in reqs.iter().enumerate() {
        batch.admit(&mut engine, r.clone(), h.sink(i));
        // Staggered: each joins a batch already running.
        batch.step(&mut engine);
    }
    assert_eq!(batch.running(), 4);
    run_to_end(&mut engine, &mut batch);
    for (i, a) in outs.iter().enumerate() {
        let b = h.out(i);
        assert_eq!(
            b.tokens, a.tokens,
            "sequence {i}: tokens differ in the batch"
        );
        assert_eq!(b.text, a.text, "sequence {i}: text differs in the batch");
        assert_eq!((b.finish, a.finish), (Finish::Length, Finish::Length));
    }
    assert_ne!(h.out(0).tokens, h.out(2).tokens[..h.out(0).tokens.len()]);
}

/// Sequences admitted together have their prompts prefilled together (`prefill_many`: one
/// pass for all their chunks under the budget, cut where the budget ends), and each still gives
/// what it gives alone: with a budget that takes every prompt at once, and one that cuts them.
#[test]
fn prompts_admitted_together_prefill_together_and_give_what_each_gives_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = tiny_engine(&dir, SynthQuant::Q4_0);
    let reqs = requests(&engine);
    let outs = alone(&mut engine, &reqs);
    for budget in [512, 7] {
        engine.reset_sessions();
        let h = Harness::new(reqs.len());
        let opts = BatchOptions {
            max_batch: 4,
            prefill_budget: budget,
        };
        let mut batch = Batcher::new(opts).unwrap();
        for (i, r) in reqs.iter().enumerate() {
            batch.admit(&mut engine, r.clone(), h.sink(i));
        }
        run_to_end(&mut engine, &mut batch);
        for (i, a) in outs.iter().enumerate() {
            let b = h.out(i);
            assert_eq!(b.tokens, a.tokens, "budget {budget}, sequence {i}: tokens");
            assert_eq!(b.text, a.text, "budget {budget}, sequence {i}: text");
        }
    }
}

#[test]
fn a_long_prompt_coming_in_does_not_stop_running_streams() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = tiny_engine(&dir, SynthQuant::Q4_0);
    let reqs = requests(&engine);
    let h = Harness::new(3);
    let mut batch = Batcher::new(BatchOptions {
        max_batch: 8,
        prefill_budget: 8,
    })
    .unwrap();
    for i in 0..2 {
        let mut r = reqs[i].clone();
        r.max_tokens = 100;
        batch.admit(&mut engine, r, h.sink(i));
    }
    for _ in 0..3 {
        batch.step(&mut engine);
    }
    let long: Vec<u32> = (0..160).map(|i| (i * 7 % 200) as u32 + 3).collect();
    let before = (h.texts(0), h.texts(1));
    batch.admit(&mut engine, GenerateRequest::new(long, 4), h.sink(2));
    while h.texts(2) == 0 && !batch.is_empty() {
        batch.step(&mut engine);
    }
    let during = (h.texts(0), h.texts(1));
    assert!(h.texts(2) > 0, "the long prompt never produced text");
    // 160 prompt tokens at 8 a step: about 20 steps in which both others decode.
    assert!(
        during.0 >= before.0 + 10 && during.1 >= before.1 + 10,
        "streams stalled while the long prompt came in: {before:?} -> {during:?}"
    );
    run_to_end(&mut engine, &mut batch);
}

#[test]
fn a_cancelled_sequence_leaves_at_the_next_step_and_keeps_its_text() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = tiny_engine(&dir, SynthQuant::Q4_0);
    let reqs = requests(&engine);
    let h = Harness::new(3);
    let mut batch = Batcher::new(BatchOptions {
        max_batch: 2,
        prefill_budget: 64,
    })
    .unwrap();
    for i in 0..2 {
        let mut r = reqs[i].clone();
        r.max_tokens = 200;
        batch.admit(&mut engine, r, h.sink(i));
    }
    for _ in 0..4 {
        batch.step(&mut engine);
    }
    assert!(!batch.has_room());
    h.cancels[0].store(true, Ordering::Relaxed);
    batch.step(&mut engine);
    assert!(batch.has_room(), "the cancelled sequence kept its slot");
    let out = h.out(0);
    assert_eq!(out.finish, Finish::Cancelled);
    assert!(out.tokens.len() < 10, "{} tokens", out.tokens.len());
    batch.admit(&mut engine, reqs[3].clone(), h.sink(2));
    run_to_end(&mut engine, &mut batch);
    let log = h.log.lock().unwrap().clone();
    let done = |id| log.iter().position(|e| *e == Ev::Done(id)).unwrap();
    assert!(
        done(2) < done(1),
        "the newcomer did not run beside sequence 1"
    );
}

#[test]
fn bad_options_and_bad_requests_are_refused() {
    for (max_batch, prefill_budget) in [(0, 8), (257, 8), (4, 0)] {
        let opts = BatchOptions {
            max_batch,
            prefill_budget,
        };
        assert!(Batcher::new(opts).is_err(), "{opts:?}");
    }
    let dir = tempfile::tempdir().unwrap();
    let mut engine = tiny_engine(&dir, SynthQuant::Q4_0);
    let mut batch = Batcher::new(BatchOptions::default()).unwrap();
    let got: Arc<Mutex<Option<String>>> = Arc::default();
    struct Err1(Arc<Mutex<Option<String>>>);
    impl SequenceSink for Err1 {
        fn piece(&mut self, _: q4moe_engine::Piece<'_>) -> Flow {
            Flow::Continue
        }
        fn cancelled(&self) -> bool {
            false
        }
        fn finished(self: Box<Self>, r: q4moe_engine::Result<GenerateOutput>) {
            *self.0.lock().unwrap() = Some(r.unwrap_err().to_string());
        }
    }
    batch.admit(
        &mut engine,
        GenerateRequest::new(vec![], 4),
        Box::new(Err1(got.clone())),
    );
    assert!(batch.is_empty());
    let msg = got
        .lock()
        .unwrap()
        .clone()
        .expect("the refusal reached the sink");
    assert!(msg.contains("empty"), "{msg}");
}

/// What the server does when a step panics (here: a sink's text callback): `abort` ends every
/// running sequence with an error, and the batch serves the next request as before.
#[test]
fn after_a_panicking_step_abort_ends_the_batch_and_it_serves_on() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = tiny_engine(&dir, SynthQuant::Q4_0);
    let reqs = requests(&engine);
    let expected = engine.generate(&reqs[1], &mut |_| Flow::Continue).unwrap();
    engine.reset_sessions();
    struct Boom;
    impl SequenceSink for Boom {
        fn piece(&mut self, _: q4moe_engine::Piece<'_>) -> Flow {
            panic!("a sink that panics");
        }
        fn cancelled(&self) -> bool {
            false
        }
        fn finished(self: Box<Self>, _: q4moe_engine::Result<GenerateOutput>) {}
    }
    let errors: Arc<Mutex<Vec<String>>> = Arc::default();
    struct Errs(Arc<Mutex<Vec<String>>>);
    impl SequenceSink for Errs {
        fn piece(&mut self, _: q4moe_engine::Piece<'_>) -> Flow {
            Flow::Continue
        }
        fn cancelled(&self) -> bool {
            false
        }
        fn finished(self: Box<Self>, r: q4moe_engine::Result<GenerateOutput>) {
            self.0
                .lock()
                .unwrap()
                .push(r.err().map(|e| e.to_string()).unwrap_or_default());
        }
    }
    let mut batch = Batcher::new(BatchOptions::default()).unwrap();
    batch.admit(&mut engine, reqs[0].clone(), Box::new(Errs(errors.clone())));
    batch.admit(&mut engine, reqs[0].clone(), Box::new(Boom));
    let stepped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        for _ in 0..50 {
            batch.step(&mut engine);
        }
    }));
    assert!(stepped.is_err(), "the sink never panicked");
    batch.abort(&mut engine, "a step panicked");
    engine.reset_sessions();
    assert!(batch.is_empty());
    let errs = errors.lock().unwrap().clone();
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(errs[0].contains("aborted: a step panicked"), "{errs:?}");
    let h = Harness::new(2);
    batch.admit(&mut engine, reqs[1].clone(), h.sink(1));
    run_to_end(&mut engine, &mut batch);
    assert_eq!(h.out(1).tokens, expected.tokens);
}

/// The `n` choices of one prompt compute it once: the later ones wait while the first takes its
/// prompt in (a budget of a few tokens a step), then copy its KV (Backend::fork), and each
/// choice's tokens are what it gives alone.
#[test]
fn choices_of_one_prompt_share_its_prefill_and_give_what_each_gives_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = tiny_engine(&dir, SynthQuant::Q4_0);
    let prompt = requests(&engine)[2].prompt.clone();
    let reqs: Vec<GenerateRequest> = (0..3)
        .map(|i| {
            let mut req = GenerateRequest::new(prompt.clone(), 10);
            req.stop_at_eos = false;
            req.sampling = SamplingParams {
                temperature: 1.0,
                seed: 100 + i,
                ..Default::default()
            };
            req
        })
        .collect();
    let alone = alone(&mut engine, &reqs);
    let h = Harness::new(reqs.len());
    let mut batch = Batcher::new(BatchOptions {
        max_batch: 4,
        prefill_budget: 5,
    })
    .unwrap();
    for (i, r) in reqs.iter().enumerate() {
        batch.admit(&mut engine, r.clone(), h.sink(i));
    }
    run_to_end(&mut engine, &mut batch);
    assert!(prompt.len() > 10, "the prompt spans several budgets");
    assert_eq!(h.out(0).cached_tokens, 0);
    for (i, a) in alone.iter().enumerate() {
        let b = h.out(i);
        assert_eq!(b.tokens, a.tokens, "choice {i}: tokens differ");
        if i > 0 {
            assert_eq!(
                b.cached_tokens,
                prompt.len() - 1,
                "choice {i} computed its prompt"
            );
        }
    }
    assert_ne!(
        h.out(0).tokens,
        h.out(1).tokens,
        "the seeds give different choices"
    );
}
