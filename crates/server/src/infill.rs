//! Fill-in-the-middle prompts: the text before a gap, the text after it, and the model writes
//! what goes between. Qwen's vocabularies carry the markup as control tokens, and the prompt is
//! `<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>{middle}` (the order llama-server
//! and the Qwen2.5-Coder card use), with the client's texts tokenised as text: a control token
//! typed in them stays text, so no text can forge the markup. A model without the tokens cannot
//! fill in, and a request that asks gets 400 naming the field, never a prompt it was not
//! trained on.
//!
//! With other files as context (llama-server's `input_extra`), the repository-level pattern of
//! Qwen2.5-Coder goes first, as llama-server writes it: `<|repo_name|>myproject\n`, then
//! `<|file_sep|>{filename}\n{text}` for each file, then `<|file_sep|>filename\n`.
//!
//! Echo and logprobs (`/v1/completions`): the prompt's tokens sit among the markup and the
//! suffix's tokens, in another order than the text's, so a request with a suffix reports
//! logprobs for the generated middle only, and `echo` gives the whole filled text: prompt, then
//! middle, then suffix.

use q4moe_engine::{Prompter, Tokenizer};
use q4moe_tokenizer::TokenizerError;

use crate::errors::ApiError;
use crate::openai::Prompt;

/// A fill-in-the-middle job's texts.
#[derive(Debug, Clone)]
pub struct Infill {
    /// Before the gap: `prompt` (`/v1/completions`) or `input_prefix` (`/infill`).
    pub prefix: Prompt,
    pub suffix: String,
    /// llama-server's `prompt`: the start of the middle, already written.
    pub middle: String,
    /// Other files as context, `(filename, text)`.
    pub extra: Vec<(String, String)>,
    /// The request's names for the prefix and the suffix, for errors.
    pub fields: (&'static str, &'static str),
}

/// The markup's token ids in this vocabulary.
#[derive(Debug, Clone, Copy)]
pub struct FimTokens {
    prefix: u32,
    suffix: u32,
    middle: u32,
    /// The repository-level pattern's, where the vocabulary has both.
    repo: Option<(u32, u32)>,
}

impl FimTokens {
    pub fn of(tok: &Tokenizer) -> Option<FimTokens> {
        let id = |t: &str| tok.token_id(t);
        Some(FimTokens {
            prefix: id("<|fim_prefix|>")?,
            suffix: id("<|fim_suffix|>")?,
            middle: id("<|fim_middle|>")?,
            repo: id("<|repo_name|>").zip(id("<|file_sep|>")),
        })
    }

    /// The tokens, or a 400 naming `field` (the suffix's) when the model has none.
    pub fn require(tok: &Tokenizer, field: &str) -> Result<FimTokens, ApiError> {
        Self::of(tok).ok_or_else(|| {
            ApiError::invalid(
                field,
                format!(
                    "'{field}' asks for fill-in-the-middle, but this model has no fill-in-the-middle tokens (<|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>)"
                ),
            )
        })
    }
}

/// The prompt's token ids (BOS first where the model adds one). Each text is bounded by the
/// context as it is tokenised; the whole is checked against it by the caller.
pub fn encode(p: &Prompter, f: &Infill) -> Result<Vec<u32>, ApiError> {
    let tok = p.tokenizer();
    let fim = FimTokens::require(tok, f.fields.1)?;
    let text = |s: &str, field: &str| -> Result<Vec<u32>, ApiError> {
        tok.tokenize(s, false, false, p.context())
            .map_err(|e| text_error(e, field, p.context()))
    };
    let mut ids = Vec::new();
    if let (true, Some(bos)) = (tok.add_bos(), tok.bos_id()) {
        ids.push(bos);
    }
    if !f.extra.is_empty() {
        let Some((repo, sep)) = fim.repo else {
            return Err(ApiError::invalid(
                "input_extra",
                "'input_extra' needs the model's <|repo_name|> and <|file_sep|> tokens, which it lacks",
            ));
        };
        ids.push(repo);
        ids.extend(text("myproject\n", "input_extra")?);
        for (name, body) in &f.extra {
            ids.push(sep);
            ids.extend(text(&format!("{name}\n"), "input_extra")?);
            ids.extend(text(body, "input_extra")?);
        }
        ids.push(sep);
        ids.extend(text("filename\n", "input_extra")?);
    }
    ids.push(fim.prefix);
    match &f.prefix {
        Prompt::Text(s) => ids.extend(text(s, f.fields.0)?),
        Prompt::Tokens(t) => {
            crate::fields::check_ids(t, p.vocab(), f.fields.0)?;
            ids.extend_from_slice(t);
        }
    }
    ids.push(fim.suffix);
    ids.extend(text(&f.suffix, f.fields.1)?);
    ids.push(fim.middle);
    ids.extend(text(&f.middle, "prompt")?);
    Ok(ids)
}

fn text_error(e: TokenizerError, field: &str, context: usize) -> ApiError {
    match e {
        TokenizerError::TooLong { .. } => ApiError::invalid(
            field,
            format!("'{field}' is longer than this model's context of {context} positions"),
        )
        .with_status(
            axum::http::StatusCode::BAD_REQUEST,
            "context_length_exceeded",
        ),
        e => ApiError::invalid(field, format!("'{field}' cannot be tokenised: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn prompter(spec: q4moe_tokenizer::TokenizerSpec) -> Prompter {
        let tok = Tokenizer::from_spec(&spec).unwrap();
        let vocab = tok.vocab_size();
        Prompter::new(Arc::new(tok), 512, vocab, &Default::default()).unwrap()
    }

    fn spec() -> q4moe_tokenizer::TokenizerSpec {
        q4moe_tokenizer::synthetic_spec(q4moe_tokenizer::SYNTHETIC_MIN_VOCAB, 0)
    }

    fn infill(prefix: &str, suffix: &str) -> Infill {
        Infill {
            prefix: Prompt::Text(prefix.into()),
            suffix: suffix.into(),
            middle: String::new(),
            extra: Vec::new(),
            fields: ("prompt", "suffix"),
        }
    }

    #[test]
    fn the_markup_is_control_tokens_and_the_texts_stay_text() {
        let p = prompter(spec());
        let tok = p.tokenizer().clone();
        let id = |t: &str| tok.token_id(t).unwrap();
        // A control token typed in the prefix must not become the markup.
        let ids = encode(&p, &infill("a<|fim_suffix|>b", "c")).unwrap();
        let suffix_at: Vec<usize> = (0..ids.len())
            .filter(|&i| ids[i] == id("<|fim_suffix|>"))
            .collect();
        assert_eq!(suffix_at.len(), 1, "{ids:?}");
        assert_eq!(ids[0], id("<|fim_prefix|>"));
        assert_eq!(*ids.last().unwrap(), id("<|fim_middle|>"));
        let prefix = tok.decode(&ids[1..suffix_at[0]], false).unwrap();
        assert_eq!(prefix, "a<|fim_suffix|>b");
        let suffix = tok
            .decode(&ids[suffix_at[0] + 1..ids.len() - 1], false)
            .unwrap();
        assert_eq!(suffix, "c");
    }

    #[test]
    fn extra_files_go_first_in_the_repository_pattern() {
        let p = prompter(spec());
        let tok = p.tokenizer().clone();
        let mut f = infill("x", "y");
        f.extra = vec![("a.py".into(), "import os\n".into())];
        f.middle = "mid".into();
        let text = tok.decode(&encode(&p, &f).unwrap(), false).unwrap();
        assert_eq!(
            text,
            "<|repo_name|>myproject\n<|file_sep|>a.py\nimport os\n<|file_sep|>filename\n<|fim_prefix|>x<|fim_suffix|>y<|fim_middle|>mid"
        );
    }

    #[test]
    fn a_vocabulary_without_the_tokens_is_a_400_naming_the_suffix() {
        let mut s = spec();
        for t in s.tokens.iter_mut().filter(|t| t.starts_with("<|fim_")) {
            *t = format!("[{t}]");
        }
        let p = prompter(s);
        let e = encode(&p, &infill("a", "b")).unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
        assert_eq!(e.param.as_deref(), Some("suffix"));
        assert!(
            e.message.contains("no fill-in-the-middle tokens"),
            "{}",
            e.message
        );
    }

    #[test]
    fn token_prompts_are_checked_and_long_texts_refused() {
        let p = prompter(spec());
        let mut f = infill("", "b");
        f.prefix = Prompt::Tokens(vec![u32::MAX]);
        assert_eq!(encode(&p, &f).unwrap_err().param.as_deref(), Some("prompt"));
        let e = encode(&p, &infill("a", &"word ".repeat(2000))).unwrap_err();
        assert_eq!(e.code, Some("context_length_exceeded"));
        assert_eq!(e.param.as_deref(), Some("suffix"));
    }
}
