//! q4moe's tokenizer on Qwen's real vocabulary (151,643 ranked BPE tokens from `qwen.tiktoken`)
//! against tiktoken and Hugging Face `tokenizers`: `tools/qwen_vocab.py` writes the GGUF and the
//! ids both references agree on for a corpus of over 1 MB; these tests require the same ids and
//! an exact decode. Without the fixture (it is generated, 20 MB) they are reported as ignored.

use std::path::PathBuf;

use q4moe_gguf::GgufFile;
use q4moe_model::{spec_from_gguf, Model};
use q4moe_tokenizer::{ChatMessage, ChatTemplate, Tokenizer};
use serde::Deserialize;

#[derive(Deserialize)]
struct Fixture {
    version: u32,
    docs: Vec<Doc>,
}

#[derive(Deserialize)]
struct Doc {
    name: String,
    text: String,
    /// Every added token parsed.
    ids: Vec<u32>,
    /// Control tokens as text (user-defined ones still matched); `None`: same as `ids`.
    ids_plain: Option<Vec<u32>>,
}

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen_vocab")
}

fn tokenizer() -> Tokenizer {
    let file = GgufFile::open(dir().join("qwen3_vocab.gguf")).unwrap();
    let spec = spec_from_gguf(&file.header, "qwen3_vocab.gguf").unwrap();
    Tokenizer::from_spec(&spec).unwrap()
}

#[test]
#[cfg_attr(
    not(qwen_vocab_fixture),
    ignore = "needs tests/fixtures/qwen_vocab: run tools/qwen_vocab.py"
)]
fn ids_and_text_match_tiktoken_and_tokenizers_on_a_real_corpus() {
    let text = std::fs::read_to_string(dir().join("expected.json")).unwrap();
    let fx: Fixture = serde_json::from_str(&text).unwrap();
    assert_eq!(fx.version, 1, "unknown fixture version");
    let tok = tokenizer();
    assert_eq!(tok.vocab_size(), 151_936);
    let (mut bytes, mut tokens, mut bad) = (0, 0, Vec::new());
    for d in &fx.docs {
        let plain_ref = d.ids_plain.as_ref().unwrap_or(&d.ids);
        let ids = tok.encode(&d.text, true).unwrap();
        let plain = tok.encode(&d.text, false).unwrap();
        let back = tok.decode(&ids, false).unwrap();
        let back_plain = tok.decode(&plain, false).unwrap();
        let first_diff = |a: &[u32], b: &[u32]| a.iter().zip(b).position(|(x, y)| x != y);
        if ids != d.ids {
            let at = first_diff(&ids, &d.ids);
            bad.push(format!(
                "{}: ids differ (first at {at:?}, {} vs {})",
                d.name,
                ids.len(),
                d.ids.len()
            ));
        }
        if &plain != plain_ref {
            bad.push(format!(
                "{}: plain ids differ (first at {:?})",
                d.name,
                first_diff(&plain, plain_ref)
            ));
        }
        if back != d.text || back_plain != d.text {
            bad.push(format!("{}: decode does not give the text back", d.name));
        }
        bytes += d.text.len();
        tokens += d.ids.len();
    }
    eprintln!(
        "qwen vocabulary: {} documents, {bytes} bytes, {tokens} tokens, {} mismatches",
        fx.docs.len(),
        bad.len()
    );
    assert!(bad.is_empty(), "{}", bad.join("\n"));
    assert!(
        bytes >= 1 << 20 && fx.docs.len() >= 100,
        "corpus too small: {bytes} bytes"
    );
}

#[test]
#[cfg_attr(
    not(qwen_vocab_fixture),
    ignore = "needs tests/fixtures/qwen_vocab: run tools/qwen_vocab.py"
)]
fn the_fixture_loads_as_a_model_and_renders_qwen3_chats() {
    let model = Model::load(dir().join("qwen3_vocab.gguf")).unwrap();
    assert_eq!(model.config.vocab_size, 151_936);
    let tok = Tokenizer::from_spec(&model.tokenizer).unwrap();
    assert_eq!(tok.token_id("<|im_start|>"), Some(151_644));
    assert_eq!(tok.eos_id(), 151_645);
    let template = ChatTemplate::new(tok.chat_template().unwrap()).unwrap();
    let text = template
        .render(&[ChatMessage::user("Bonjour 😀")], true, Some(false))
        .unwrap();
    let ids = tok.encode(&text, true).unwrap();
    // <|im_start|>user\n ... <|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n
    assert_eq!(ids[0], 151_644);
    assert_eq!(ids.iter().filter(|&&id| id == 151_644).count(), 2);
    assert!(ids.contains(&151_667) && ids.contains(&151_668), "{ids:?}");
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
}

#[test]
#[cfg_attr(
    not(qwen_vocab_fixture),
    ignore = "needs tests/fixtures/qwen_vocab: run tools/qwen_vocab.py"
)]
fn the_tokenizer_fuzz_target_holds_on_the_real_vocabulary() {
    use q4moe_fuzz::{corpus_dir, load_corpus, target_by_name, Fuzzer, Options, TargetConfig};
    let scratch = tempfile::tempdir().unwrap();
    let config = TargetConfig {
        vocab: Some(dir().join("qwen3_vocab.gguf")),
        ..TargetConfig::new(scratch.path())
    };
    let mut target = target_by_name("tokenizer", &config).unwrap();
    let seeds = load_corpus(&corpus_dir("tokenizer")).unwrap();
    let opts = Options {
        execs: seeds.len() as u64 + 500,
        seed: 2,
        ..Options::default()
    };
    let report = Fuzzer::new(target.as_mut(), seeds)
        .run(&opts, |_, _| {})
        .unwrap();
    let failures: Vec<_> = report.failures.iter().map(|f| &f.message).collect();
    assert!(failures.is_empty(), "{}: {failures:?}", report.summary());
}
