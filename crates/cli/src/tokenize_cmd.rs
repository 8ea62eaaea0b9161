//! `q4moe tokenize` and `q4moe detokenize`: the model's tokenizer from the command line, read as
//! the server's `/tokenize` and `/detokenize` read it (llama-server's defaults: no BOS unless
//! `--add-special`, control tokens spelled in the text parsed unless `--no-parse-special`).

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use q4moe_tokenizer::Tokenizer;

#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// The GGUF model file (only its tokenizer is read).
    #[arg(long, short)]
    model: PathBuf,
    /// The text; `-` or none (and no -f) reads standard input.
    #[arg(conflicts_with = "file")]
    text: Option<String>,
    /// Read the text from this file.
    #[arg(short = 'f', long = "file", value_name = "FILE")]
    file: Option<PathBuf>,
    /// Put BOS first where the model adds one (llama-server's add_special).
    #[arg(long)]
    add_special: bool,
    /// Keep control tokens spelled in the text (`<|im_start|>`) as plain text.
    #[arg(long)]
    no_parse_special: bool,
    /// Output: ids (space separated), json (an array), pieces (a line per token: id, then its
    /// text as a JSON string, or its bytes when they are not UTF-8).
    #[arg(long, default_value = "ids", value_parser = ["ids", "json", "pieces"])]
    format: String,
}

#[derive(Args, Debug)]
pub struct DetokenizeArgs {
    /// The GGUF model file (only its tokenizer is read).
    #[arg(long, short)]
    model: PathBuf,
    /// Token ids, as a JSON array or separated by spaces or commas; `-` or none (and no -f)
    /// reads standard input.
    #[arg(conflicts_with = "file")]
    ids: Option<String>,
    /// Read the ids from this file.
    #[arg(short = 'f', long = "file", value_name = "FILE")]
    file: Option<PathBuf>,
    /// Leave control tokens (`<|im_end|>`) out of the text.
    #[arg(long)]
    skip_special: bool,
}

fn load_tokenizer(path: &Path) -> anyhow::Result<Tokenizer> {
    let model = crate::load_model(path)?;
    Tokenizer::from_spec(&model.tokenizer).context("building the model's tokenizer")
}

/// The input as given: an argument, `-f FILE`, or standard input.
fn input(arg: Option<&str>, file: Option<&Path>) -> anyhow::Result<String> {
    crate::run::read_prompt(Some(arg.unwrap_or("-")), file)
}

pub fn tokenize(a: TokenizeArgs) -> anyhow::Result<()> {
    let text = input(a.text.as_deref(), a.file.as_deref())?;
    let tk = load_tokenizer(&a.model)?;
    let ids = tk.tokenize(&text, a.add_special, !a.no_parse_special, usize::MAX)?;
    match a.format.as_str() {
        "json" => println!("{}", serde_json::to_string(&ids)?),
        "pieces" => {
            for id in ids {
                let bytes = tk.token_bytes(id).unwrap_or_default();
                let piece = match std::str::from_utf8(bytes) {
                    Ok(s) => serde_json::to_string(s)?,
                    Err(_) => serde_json::to_string(bytes)?,
                };
                println!("{id}\t{piece}");
            }
        }
        _ => {
            let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
            println!("{}", ids.join(" "));
        }
    }
    Ok(())
}

/// Ids from a JSON array or a list separated by whitespace or commas.
pub fn parse_ids(s: &str) -> anyhow::Result<Vec<u32>> {
    let s = s.trim();
    if s.starts_with('[') {
        return serde_json::from_str(s)
            .context("the ids look like JSON but are not an array of token ids");
    }
    s.split(|c: char| c.is_whitespace() || c == ',')
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<u32>()
                .map_err(|_| anyhow::anyhow!("'{t}' is not a token id"))
        })
        .collect()
}

pub fn detokenize(a: DetokenizeArgs) -> anyhow::Result<()> {
    let ids = parse_ids(&input(a.ids.as_deref(), a.file.as_deref())?)?;
    let tk = load_tokenizer(&a.model)?;
    let text = tk.decode(&ids, a.skip_special)?;
    use std::io::Write;
    // The text exactly, with no newline added, so that tokenize | detokenize round-trips.
    std::io::stdout().write_all(text.as_bytes())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_parse_from_json_or_lists() {
        assert_eq!(super::parse_ids("[1, 2,3]").unwrap(), [1, 2, 3]);
        assert_eq!(super::parse_ids(" 1 2,3\n4 ").unwrap(), [1, 2, 3, 4]);
        assert!(super::parse_ids("").unwrap().is_empty());
        let e = super::parse_ids("1 x 3").unwrap_err().to_string();
        assert!(e.contains("'x'"), "{e}");
        assert!(super::parse_ids("[1, -2]").is_err());
    }
}
