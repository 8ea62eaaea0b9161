//! Constrained decoding on llguidance (the grammar engine llama.cpp and vLLM use): JSON
//! schemas, any JSON object, and Lark grammars compiled against our vocabulary into token masks
//! that the host sampler applies before every choice (`q4moe_model::constraint`).
//!
//! The vocabulary (a token trie over every id's bytes, control tokens marked so no text can
//! spell them) and the grammar compiler's token slices are built once, on first use, and
//! shared; a grammar is compiled once per request, off the engine thread, under `GrammarLimits`.

use std::sync::{Arc, Mutex, OnceLock};

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{self, SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory, TokenParser};
use q4moe_model::constraint::{Constraint, ConstraintSource, TokenMask};
use q4moe_tokenizer::Tokenizer;
use serde_json::{json, Value};

/// What a request constrains its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// Any JSON object (`response_format: json_object`).
    JsonObject,
    /// JSON valid against this schema.
    JsonSchema(Value),
    /// A grammar in llguidance's Lark syntax (`%json {...}` embeds a schema).
    Lark(String),
}

impl Grammar {
    fn name(&self) -> &'static str {
        match self {
            Grammar::JsonObject => "json_object",
            Grammar::JsonSchema(_) => "json_schema",
            Grammar::Lark(_) => "grammar",
        }
    }
}

/// Bounds on compiling one grammar, so a hostile schema costs bounded time and memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrammarLimits {
    /// Symbols in the compiled grammar's productions.
    pub max_grammar_size: usize,
    /// Lexer work to build the initial regexes (about 50,000 a millisecond).
    pub initial_lexer_fuel: u64,
    /// Lexer work for one token's mask (about 14,000 a millisecond).
    pub step_lexer_fuel: u64,
}

impl Default for GrammarLimits {
    fn default() -> Self {
        GrammarLimits {
            max_grammar_size: 200_000,
            initial_lexer_fuel: 1_000_000,
            step_lexer_fuel: 200_000,
        }
    }
}

/// How JSON is laid out under a constraint: fixed separators as Python's `json.dumps` writes
/// them and no free whitespace, so a weak model cannot pad the output with blanks forever.
fn json_layout() -> Value {
    json!({ "whitespace_flexible": false, "item_separator": ", ", "key_separator": ": " })
}

/// A JSON schema with our layout, unless the schema sets its own (`x-guidance`).
pub fn with_layout(mut schema: Value) -> Value {
    if let Value::Object(o) = &mut schema {
        o.entry("x-guidance").or_insert_with(json_layout);
    }
    schema
}

/// The vocabulary llguidance sees, and the end-of-sequence ids a finished grammar allows.
struct Vocab {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Vocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        let text = String::from_utf8_lossy(s);
        let mut ids = self.tokenizer.encode(&text, false).unwrap_or_default();
        if self.tokenizer.add_bos() && ids.first() == self.tokenizer.bos_id().as_ref() {
            ids.remove(0);
        }
        ids
    }
}

/// Compiles grammars against one model's vocabulary. Cheap to clone; the vocabulary trie is
/// built on the first compile (a fraction of a second at 151,936 tokens).
#[derive(Clone)]
pub struct Grammars {
    tokenizer: Arc<Tokenizer>,
    /// The model's vocabulary (logits per step), which may exceed the tokenizer's.
    vocab: usize,
    limits: GrammarLimits,
    factory: Arc<OnceLock<Result<ParserFactory, String>>>,
}

impl Grammars {
    pub fn new(tokenizer: Arc<Tokenizer>, vocab: usize, limits: GrammarLimits) -> Self {
        Grammars {
            tokenizer,
            vocab,
            limits,
            factory: Arc::new(OnceLock::new()),
        }
    }

    fn factory(&self) -> Result<&ParserFactory, String> {
        self.factory
            .get_or_init(|| build_factory(&self.tokenizer, self.vocab, self.limits))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Compiles `grammar`; `after`: a token (e.g. `</think>`) before which output is free and
    /// the grammar starts after it. The error says what is wrong with the grammar.
    pub fn compile(&self, grammar: &Grammar, after: Option<u32>) -> Result<Constraint, String> {
        Ok(Constraint::new(Arc::new(self.compiled(grammar, after)?)))
    }

    fn compiled(&self, grammar: &Grammar, after: Option<u32>) -> Result<Compiled, String> {
        let factory = self.factory()?;
        let top = match grammar {
            Grammar::JsonObject => {
                TopLevelGrammar::from_json_schema(with_layout(json!({ "type": "object" })))
            }
            Grammar::JsonSchema(s) => {
                if !s.is_object() {
                    return Err("the schema must be a JSON object".into());
                }
                TopLevelGrammar::from_json_schema(with_layout(s.clone()))
            }
            Grammar::Lark(text) if text.trim().is_empty() => {
                return Err("the grammar is empty".into())
            }
            Grammar::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        };
        let parser = factory.create_parser(top).map_err(|e| e.to_string())?;
        let mut stop_ids = self.tokenizer.stop_ids();
        stop_ids.retain(|&t| (t as usize) < self.vocab);
        Ok(Compiled {
            parser: Mutex::new(parser),
            name: grammar.name(),
            stop_ids: stop_ids.into(),
            eos: self.tokenizer.eos_id(),
            after,
        })
    }
}

fn build_factory(
    tokenizer: &Arc<Tokenizer>,
    vocab: usize,
    limits: GrammarLimits,
) -> Result<ParserFactory, String> {
    let n = vocab.max(tokenizer.vocab_size());
    let words: Vec<Vec<u8>> = (0..n as u32)
        .map(|id| match tokenizer.token_bytes(id) {
            // Control tokens are spelled with llguidance's marker byte: no text matches them.
            Some(b) if tokenizer.is_control(id) => [&[TokTrie::SPECIAL_TOKEN_MARKER], b].concat(),
            Some(b) => b.to_vec(),
            None => Vec::new(),
        })
        .collect();
    let info = TokRxInfo::new(n as u32, tokenizer.eos_id());
    let trie = TokTrie::from(&info, &words);
    let env: TokEnv = Arc::new(Vocab {
        trie,
        tokenizer: tokenizer.clone(),
    });
    let mut factory = ParserFactory::new(
        &env,
        toktrie::InferenceCapabilities::default(),
        &llguidance::earley::SlicedBiasComputer::general_slices(),
    )
    .map_err(|e| format!("building the grammar engine's vocabulary: {e}"))?;
    factory.quiet();
    let l: &mut ParserLimits = factory.limits_mut();
    l.max_grammar_size = limits.max_grammar_size;
    l.initial_lexer_fuel = limits.initial_lexer_fuel;
    l.step_lexer_fuel = limits.step_lexer_fuel;
    // Errors go back to clients: the reason, not a dump of the grammar and the parser state.
    l.verbose_errors = false;
    Ok(factory)
}

/// One compiled grammar; each sequence starts from a copy of its parser.
struct Compiled {
    /// Behind a lock only to be shareable; each `start` copies it.
    parser: Mutex<TokenParser>,
    name: &'static str,
    stop_ids: Arc<[u32]>,
    /// The id llguidance allows once the grammar is complete (among `stop_ids`).
    eos: u32,
    after: Option<u32>,
}

impl Compiled {
    fn mask(&self) -> GrammarMask {
        let parser = self.parser.lock().unwrap_or_else(|p| p.into_inner());
        GrammarMask {
            matcher: Matcher::new(Ok(parser.deep_clone())),
            stop_ids: self.stop_ids.clone(),
            eos: self.eos,
            waiting_for: self.after,
            failed: false,
            next: None,
            kept: Vec::new(),
        }
    }
}

impl ConstraintSource for Compiled {
    fn start(&self) -> Box<dyn TokenMask> {
        Box::new(self.mask())
    }

    fn describe(&self) -> &str {
        self.name
    }
}

/// One sequence's grammar state.
struct GrammarMask {
    matcher: Matcher,
    stop_ids: Arc<[u32]>,
    eos: u32,
    /// Output is free until this token has been chosen.
    waiting_for: Option<u32>,
    /// The grammar engine refused a token or failed: only the stop tokens remain.
    failed: bool,
    /// The next position's allowed tokens, worked out by `prepare` (None inside: none but the
    /// stop tokens); taken by `mask`, dropped by `commit`.
    next: Option<Option<SimpleVob>>,
    /// The stop tokens' logits, kept while the rest are masked.
    kept: Vec<(usize, f32)>,
}

impl GrammarMask {
    /// What the grammar allows next: None where it failed or allows nothing.
    fn allowed(&mut self) -> Option<SimpleVob> {
        match self.failed {
            true => None,
            false => self.matcher.compute_mask_or_eos().ok(),
        }
        .filter(|v| v.num_set() > 0)
    }
}

impl TokenMask for GrammarMask {
    fn prepare(&mut self) {
        if self.waiting_for.is_none() && self.next.is_none() {
            self.next = Some(self.allowed());
        }
    }

    /// Every token the grammar does not allow to -inf, a word of the bit set at a time (the
    /// allowed words skipped whole: a JSON string allows most of a 152k vocabulary; a test of
    /// id after id took 277 us a token over 151,936 ids on the 2-core development machine, this
    /// 4 us), then the stop tokens' logits back where the grammar is complete (or failed):
    /// every stop id ends the text alike.
    fn mask(&mut self, logits: &mut [f32]) {
        if self.waiting_for.is_some() {
            return;
        }
        let allowed = match self.next.take() {
            Some(a) => a,
            None => self.allowed(),
        };
        // A complete grammar allows llguidance's one EOS.
        let stops_ok = allowed.as_ref().is_none_or(|v| v.is_allowed(self.eos));
        self.kept.clear();
        if stops_ok {
            let ids = self.stop_ids.iter().map(|&t| t as usize);
            self.kept
                .extend(ids.filter_map(|t| logits.get(t).map(|&l| (t, l))));
        }
        let n = logits.len();
        let covered = match &allowed {
            Some(v) => {
                v.iter_unset_entries(|id| {
                    if id < n {
                        logits[id] = f32::NEG_INFINITY;
                    }
                });
                v.len().min(n)
            }
            None => 0,
        };
        logits[covered..].fill(f32::NEG_INFINITY);
        for &(t, l) in &self.kept {
            logits[t] = l;
        }
    }

    /// `mask`'s rule as bits: the grammar's allowed ids below what its bit set covers, and
    /// the stop ids where the grammar allows its end (or failed); every id while waiting.
    fn allowed_bits(&mut self, words: &mut [u32]) -> bool {
        if self.waiting_for.is_some() {
            words.fill(u32::MAX);
            return true;
        }
        let allowed = match self.next.take() {
            Some(a) => a,
            None => self.allowed(),
        };
        let stops_ok = allowed.as_ref().is_none_or(|v| v.is_allowed(self.eos));
        words.fill(0);
        if let Some(v) = &allowed {
            let covered = v.len().min(words.len() * 32);
            let (full, part) = (covered / 32, covered % 32);
            words[..full].copy_from_slice(&v.as_slice()[..full]);
            if part > 0 {
                words[full] = v.as_slice()[full] & ((1u32 << part) - 1);
            }
        }
        if stops_ok {
            for &t in self.stop_ids.iter() {
                if let Some(w) = words.get_mut(t as usize / 32) {
                    *w |= 1 << (t % 32);
                }
            }
        }
        true
    }

    fn commit(&mut self, token: u32) {
        self.next = None;
        if let Some(t) = self.waiting_for {
            if t == token {
                self.waiting_for = None;
            }
            return;
        }
        if self.failed || self.stop_ids.contains(&token) {
            return;
        }
        if self.matcher.consume_token(token).is_err() {
            self.failed = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use q4moe_model::sampling::{Sampler, SamplingParams};

    fn grammars() -> Grammars {
        let spec = q4moe_tokenizer::synthetic_spec(1024, 7);
        let tk = Arc::new(Tokenizer::from_spec(&spec).unwrap());
        Grammars::new(tk, 1040, GrammarLimits::default())
    }

    /// Greedy choices over logits that favour `favourite`: what the grammar leaves of them.
    fn run(g: &Grammars, c: Constraint, favourite: u32, steps: usize) -> Vec<u32> {
        let mut s = Sampler::new(
            SamplingParams {
                constraint: Some(c),
                ..SamplingParams::greedy()
            },
            &[],
        );
        (0..steps)
            .map(|i| {
                let mut logits: Vec<f32> =
                    (0..g.vocab).map(|t| ((t * 7 + i) % 13) as f32).collect();
                logits[favourite as usize] = 100.0;
                s.sample(&mut logits)
            })
            .collect()
    }

    /// The word-at-a-time mask leaves exactly what the id-by-id rule leaves (allowed by the
    /// grammar, or a stop id where the grammar allows its end), with and without `prepare`
    /// ahead of it, and `allowed_bits` sets exactly those ids, over a schema's whole course to
    /// its end and past it.
    #[test]
    fn masking_by_words_matches_id_by_id_with_or_without_prepare() {
        let g = grammars();
        let schema = json!({ "type": "object", "properties": { "a": { "type": "integer" },
            "b": { "type": "string", "maxLength": 3 } }, "required": ["a", "b"] });
        let c = g.compiled(&Grammar::JsonSchema(schema), None).unwrap();
        let (mut reference, mut plain, mut prepared) = (c.mask(), c.mask(), c.mask());
        let mut as_bits = c.mask();
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut ended = 0;
        for step in 0..200 {
            let logits: Vec<f32> = (0..g.vocab)
                .map(|_| {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    (rng >> 40) as f32 / (1u64 << 24) as f32 * 8.0 - 4.0
                })
                .collect();
            let allowed = reference.allowed();
            let stops_ok = allowed.as_ref().is_none_or(|v| v.is_allowed(reference.eos));
            let mut want = logits.clone();
            for (id, l) in want.iter_mut().enumerate() {
                let by_grammar = allowed
                    .as_ref()
                    .is_some_and(|v| id < v.len() && v.is_allowed(id as u32));
                if !(by_grammar || stops_ok && reference.stop_ids.contains(&(id as u32))) {
                    *l = f32::NEG_INFINITY;
                }
            }
            let (mut a, mut b) = (logits.clone(), logits.clone());
            plain.mask(&mut a);
            prepared.prepare();
            prepared.mask(&mut b);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&a),
                bits(&want),
                "step {step}: by words against id by id"
            );
            assert_eq!(bits(&b), bits(&want), "step {step}: with prepare");
            // The device's form: the same tokens as bits.
            let mut words = vec![0u32; g.vocab.div_ceil(32)];
            assert!(as_bits.allowed_bits(&mut words));
            for (id, l) in want.iter().enumerate() {
                let set = words[id / 32] >> (id % 32) & 1 == 1;
                assert_eq!(set, l.is_finite(), "step {step}: id {id} as bits");
            }
            let token = q4moe_model::sampling::argmax(&want);
            if reference.stop_ids.contains(&token) {
                ended += 1;
            }
            for m in [&mut reference, &mut plain, &mut prepared, &mut as_bits] {
                m.commit(token);
            }
        }
        assert!(
            ended > 0,
            "the random logits never reached the schema's end"
        );
    }

    #[test]
    fn a_grammar_waits_for_its_token_then_ends_at_a_stop_id() {
        let g = grammars();
        let tk = g.tokenizer.clone();
        let think_end = tk.token_id("</think>").unwrap();
        let eos = tk.eos_id();
        let lark = Grammar::Lark("start: \"ok\"".into());
        // Free until </think> (favoured here once, then the grammar), then "ok", then a stop.
        let c = g.compile(&lark, Some(think_end)).unwrap();
        let ids = run(&g, c, think_end, 6);
        assert_eq!(ids[0], think_end);
        let after = &ids[1..];
        let stop = after
            .iter()
            .position(|t| tk.stop_ids().contains(t))
            .unwrap();
        assert_eq!(tk.decode(&after[..stop], false).unwrap(), "ok");
        // From the start, the favourite (a stop id) waits until the grammar is complete.
        let c = g.compile(&lark, None).unwrap();
        let ids = run(&g, c, eos, 6);
        let stop = ids.iter().position(|&t| t == eos).unwrap();
        assert_eq!(tk.decode(&ids[..stop], false).unwrap(), "ok");
    }

    #[test]
    fn bad_grammars_are_errors_that_say_why() {
        let g = grammars();
        for (bad, want) in [
            (Grammar::Lark("start: missing".into()), "missing"),
            (Grammar::Lark("  ".into()), "empty"),
            (Grammar::JsonSchema(json!([1])), "object"),
            (Grammar::JsonSchema(json!({"type": "strnig"})), "strnig"),
        ] {
            let err = g.compile(&bad, None).map(|_| ()).unwrap_err();
            assert!(err.contains(want), "{bad:?}: {err}");
        }
    }
}
