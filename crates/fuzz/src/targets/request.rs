//! The server's OpenAI request parser on arbitrary bodies: every body is a parsed request or a
//! 4xx in the OpenAI error shape naming the field, and what parses respects the documented
//! ranges, so nothing after the parser sees a value it would have to check again. An input that
//! starts with `\x01` is a recipe for a JSON object built from known fields and edge values
//! (byte mutations of JSON text mostly break its syntax; recipes always reach the fields); with
//! `\x02` the recipe's fields go over a valid request, so they reach the later checks too.

use q4moe_server::errors::ApiError;
use q4moe_server::openai::{chat_request, completion_request, parse_body, GenParams, Prompt};

use super::Target;

pub struct Request;

const DICT: &[&[u8]] = &[
    b"\"messages\"",
    b"\"role\"",
    b"\"content\"",
    b"\"system\"",
    b"\"developer\"",
    b"\"user\"",
    b"\"assistant\"",
    b"\"tool\"",
    b"\"reasoning_content\"",
    b"\"type\": \"text\"",
    b"\"text\"",
    b"\"prompt\"",
    b"\"model\"",
    b"\"max_tokens\"",
    b"\"max_completion_tokens\"",
    b"\"temperature\"",
    b"\"top_p\"",
    b"\"top_k\"",
    b"\"min_p\"",
    b"\"seed\"",
    b"\"stop\"",
    b"\"stream\"",
    b"\"stream_options\": {\"include_usage\": true}",
    b"\"repetition_penalty\"",
    b"\"presence_penalty\"",
    b"\"frequency_penalty\"",
    b"\"enable_thinking\"",
    b"\"chat_template_kwargs\"",
    b"\"ignore_eos\"",
    b"\"tools\"",
    b"\"tool_choice\"",
    b"\"response_format\"",
    b"\"logprobs\"",
    b"\"logit_bias\"",
    b"\"echo\"",
    b"\"n\"",
    b"\"best_of\"",
    b"\"suffix\"",
    b"\"functions\"",
    b"\"function_call\"",
    b"\"function\"",
    b"null",
    b"true",
    b"false",
    b"[]",
    b"{}",
    b"-1",
    b"-0.0",
    b"1e309",
    b"18446744073709551616",
    b"4294967296",
    b"2.0000001",
    b"\"\\ud800\"",
    b"\"\\u0000\"",
];

impl Target for Request {
    fn name(&self) -> &'static str {
        "request"
    }

    fn max_len(&self) -> usize {
        4096
    }

    fn dict(&self) -> &'static [&'static [u8]] {
        DICT
    }

    fn run(&mut self, input: &[u8]) -> Result<String, String> {
        let built;
        let input = match input.split_first() {
            Some((mode @ (1 | 2), recipe)) => {
                let body = recipe_object(recipe, *mode == 2);
                built = serde_json::to_vec(&body).expect("JSON serialises");
                &built[..]
            }
            _ => input,
        };
        let o = match parse_body(input) {
            Ok(o) => o,
            Err(e) => return refusal("body", &e),
        };
        let chat = match chat_request(&o) {
            Ok(r) => {
                if r.messages.is_empty() {
                    return Err("a chat request with no messages parsed".into());
                }
                let roles = ["system", "user", "assistant", "tool"];
                if let Some(m) = r
                    .messages
                    .iter()
                    .find(|m| !roles.contains(&m.role.as_str()))
                {
                    return Err(format!("role {:?} parsed", m.role));
                }
                check_gen(&r.gen)?;
                "chat ok".to_string()
            }
            Err(e) => refusal("chat", &e)?,
        };
        let completion = match completion_request(&o) {
            Ok(r) => {
                if r.prompts.is_empty() {
                    return Err("a request with no prompt parsed".into());
                }
                let empty = |p: &Prompt| match p {
                    Prompt::Text(s) => s.is_empty(),
                    Prompt::Tokens(t) => t.is_empty(),
                };
                if r.prompts.iter().any(empty) {
                    return Err("an empty prompt parsed".into());
                }
                check_gen(&r.gen)?;
                "completion ok".to_string()
            }
            Err(e) => refusal("completion", &e)?,
        };
        Ok(format!("{chat} / {completion}"))
    }
}

const FIELDS: &[&str] = &[
    "messages",
    "prompt",
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "enable_thinking",
    "chat_template_kwargs",
    "ignore_eos",
    "tools",
    "tool_choice",
    "response_format",
    "logprobs",
    "logit_bias",
    "echo",
    "n",
    "best_of",
    "suffix",
    "functions",
    "function_call",
    "role",
    "content",
    "type",
    "text",
    "include_usage",
    "reasoning_content",
];

const STRINGS: &[&str] = &[
    "",
    "user",
    "system",
    "developer",
    "assistant",
    "tool",
    "robot",
    "text",
    "image_url",
    "q4moe",
    "auto",
    "none",
    "json_object",
    "<|im_start|>",
    "\u{0}",
    "\u{fdd0}",
];

const NUMBERS: &[f64] = &[
    0.0,
    -0.0,
    1.0,
    -1.0,
    0.5,
    2.0,
    2.0000001,
    10.0,
    16.0,
    17.0,
    1e-30,
    1e30,
    4294967295.0,
    4294967296.0,
    18446744073709551615.0,
    -9007199254740993.0,
];

/// Reads a recipe byte by byte; running out gives zeros.
struct Recipe<'a>(std::slice::Iter<'a, u8>);

impl Recipe<'_> {
    fn next(&mut self) -> usize {
        self.0.next().copied().unwrap_or(0) as usize
    }

    fn value(&mut self, depth: u32) -> serde_json::Value {
        use serde_json::Value as V;
        match (self.next() % 9, depth < 3) {
            (0, _) => V::Null,
            (1, _) => V::Bool(self.next() % 2 == 1),
            (2, _) => serde_json::json!(NUMBERS[self.next() % NUMBERS.len()]),
            (3, _) => serde_json::json!(self.next() as u64 * 7919),
            (4, _) => V::from(STRINGS[self.next() % STRINGS.len()]),
            (5 | 6, true) => {
                let n = self.next() % 18;
                V::Array((0..n).map(|_| self.value(depth + 1)).collect())
            }
            (7 | 8, true) => self.object(depth + 1),
            _ => V::from("x"),
        }
    }

    fn object(&mut self, depth: u32) -> serde_json::Value {
        let n = self.next() % 8;
        let fields = (0..n).map(|_| {
            let key = FIELDS[self.next() % FIELDS.len()].to_string();
            (key, self.value(depth))
        });
        serde_json::Value::Object(fields.collect())
    }
}

fn recipe_object(recipe: &[u8], over_valid: bool) -> serde_json::Value {
    let mut body = Recipe(recipe.iter()).object(0);
    if over_valid {
        let mut valid = serde_json::json!({
            "messages": [{"role": "user", "content": "hi"}],
            "prompt": "hi",
        });
        let fields = body.as_object_mut().expect("an object").clone();
        valid.as_object_mut().expect("an object").extend(fields);
        body = valid;
    }
    body
}

/// A refusal is a 4xx with a message, in the OpenAI error shape; a 400 about a field names it.
fn refusal(what: &str, e: &ApiError) -> Result<String, String> {
    if !e.status.is_client_error() {
        return Err(format!(
            "{what}: a bad request answered {}: {e:?}",
            e.status
        ));
    }
    let body = e.body();
    let message = body["error"]["message"].as_str().unwrap_or("");
    if message.is_empty() || body["error"]["type"].as_str().is_none() {
        return Err(format!(
            "{what}: error body not in the OpenAI shape: {body}"
        ));
    }
    if e.code == Some("invalid_value") && e.param.as_deref().is_none_or(str::is_empty) {
        return Err(format!("{what}: invalid value without a param: {body}"));
    }
    Ok(format!(
        "{what} {}: {}",
        e.status.as_u16(),
        e.param.as_deref().unwrap_or("-")
    ))
}

fn check_gen(g: &GenParams) -> Result<(), String> {
    let s = &g.sampling;
    let ok = (0.0..=2.0).contains(&s.temperature)
        && s.top_p > 0.0
        && s.top_p <= 1.0
        && (0.0..=1.0).contains(&s.min_p)
        && s.repetition_penalty > 0.0
        && s.repetition_penalty <= 10.0
        && (-2.0..=2.0).contains(&s.presence_penalty)
        && (-2.0..=2.0).contains(&s.frequency_penalty)
        && g.max_tokens != Some(0)
        && g.stop.len() <= 16
        && (1..=64).contains(&g.n)
        && (g.n..=64).contains(&g.best_of)
        && !(g.stream && g.best_of > g.n)
        && g.logprobs.is_none_or(|l| l.top <= 20)
        && s.logit_bias
            .iter()
            .all(|(_, b)| (-100.0..=100.0).contains(b));
    if ok {
        Ok(())
    } else {
        Err(format!("out-of-range generation settings parsed: {g:?}"))
    }
}
