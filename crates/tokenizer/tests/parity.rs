//! Parity with Hugging Face transformers' GGUF tokenizer (the oracle): the fixtures under
//! tests/fixtures/tokenizer were written by tools/tokenizer_parity/make_fixture.py from the same
//! deterministic `synthetic_spec`, so this test regenerates the spec instead of storing it.

use q4moe_tokenizer::{synthetic_spec, ChatMessage, ChatTemplate, Tokenizer};
use serde::Deserialize;

#[derive(Deserialize)]
struct Fixture {
    version: u32,
    vocab_size: usize,
    seed: u64,
    cases: Vec<Case>,
    chat: Vec<ChatCase>,
}

/// `apply_chat_template(messages, add_generation_prompt, enable_thinking)` in transformers.
#[derive(Deserialize)]
struct ChatCase {
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    enable_thinking: Option<bool>,
    rendered: String,
    ids: Vec<u32>,
}

#[derive(Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
    ids_no_special: Vec<u32>,
    decoded: String,
    decoded_skip_special: String,
}

fn fixtures() -> Vec<std::path::PathBuf> {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokenizer");
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("parity_")
        })
        .collect();
    paths.sort();
    paths
}

fn check(path: &std::path::Path) -> usize {
    let fx: Fixture = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(fx.version, 1, "{}: unknown fixture version", path.display());
    let tok = Tokenizer::from_spec(&synthetic_spec(fx.vocab_size, fx.seed)).unwrap();
    let mut failures = Vec::new();
    for c in &fx.cases {
        let ids = tok.encode(&c.text, true).unwrap();
        let plain = tok.encode(&c.text, false).unwrap();
        let dec = tok.decode(&c.ids, false).unwrap();
        let dec_skip = tok.decode(&c.ids, true).unwrap();
        if ids != c.ids
            || plain != c.ids_no_special
            || dec != c.decoded
            || dec_skip != c.decoded_skip_special
        {
            failures.push(format!("{:?}: ids {:?} vs hf {:?}; plain {:?} vs {:?}; dec {:?} vs {:?}; skip {:?} vs {:?}",
                c.text, ids, c.ids, plain, c.ids_no_special, dec, c.decoded, dec_skip, c.decoded_skip_special));
        }
    }
    let template = ChatTemplate::new(tok.chat_template().unwrap()).unwrap();
    for c in &fx.chat {
        let text = template
            .render(&c.messages, c.add_generation_prompt, c.enable_thinking)
            .unwrap();
        let ids = tok.encode(&text, true).unwrap();
        if text != c.rendered || ids != c.ids {
            failures.push(format!(
                "chat {:?}: rendered {text:?} vs hf {:?}",
                c.messages, c.rendered
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{}: {} of {} cases differ:\n{}",
        path.display(),
        failures.len(),
        fx.cases.len(),
        failures.join("\n")
    );
    fx.cases.len()
}

#[test]
fn matches_transformers_on_every_fixture() {
    let paths = fixtures();
    assert!(!paths.is_empty(), "no parity fixtures found");
    let total: usize = paths.iter().map(|p| check(p)).sum();
    assert!(total >= 200, "only {total} parity cases");
}
