//! Constrained decoding over a random-weight model on both generation paths (the serial
//! `Engine::generate` and the continuous batch): the grammar alone makes the output valid, and
//! a constrained sequence in a batch gets what it gets alone.

use q4moe_engine::{
    BatchOptions, Batcher, Finish, Flow, GenerateOutput, GenerateRequest, Grammar, SamplingParams,
    ToolCall,
};
use q4moe_model::synth::SynthQuant;
use serde_json::{json, Value};

mod common;
use common::{admit_all, run_to_end, tiny_engine};

fn request(e: &q4moe_engine::Engine, grammar: &Grammar, seed: u64) -> GenerateRequest {
    let prompt = e.encode_prompt("Write it down:").unwrap();
    let mut req = GenerateRequest::new(prompt, 120);
    req.sampling = SamplingParams {
        temperature: 1.0,
        seed,
        constraint: Some(e.prompter().grammars().compile(grammar, None).unwrap()),
        ..Default::default()
    };
    req
}

fn schema() -> Value {
    json!({ "type": "object", "properties": {
        "n": { "type": "integer", "minimum": 0, "maximum": 99 },
        "color": { "enum": ["red", "green"] } },
      "required": ["n", "color"], "additionalProperties": false })
}

fn check(out: &GenerateOutput) {
    assert_eq!(out.finish, Finish::Stop, "{:?}", out.text);
    let v: Value = serde_json::from_str(&out.text).unwrap_or_else(|e| panic!("{e}: {}", out.text));
    let n = v["n"].as_u64().unwrap();
    assert!(n <= 99 && ["red", "green"].contains(&v["color"].as_str().unwrap()));
    assert_eq!(v.as_object().unwrap().len(), 2, "{v}");
}

#[test]
fn serial_generation_follows_a_schema_and_a_grammar() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = tiny_engine(&dir, SynthQuant::Q4_0);
    let g = Grammar::JsonSchema(schema());
    for seed in 0..3 {
        let out = e
            .generate(&request(&e, &g, seed), &mut |_| Flow::Continue)
            .unwrap();
        check(&out);
    }
    // Unconstrained, the same model writes no JSON.
    let mut free = request(&e, &g, 0);
    free.sampling.constraint = None;
    let out = e.generate(&free, &mut |_| Flow::Continue).unwrap();
    assert!(
        serde_json::from_str::<Value>(&out.text).is_err(),
        "{}",
        out.text
    );
    // GBNF, translated to Lark.
    let lark = q4moe_engine::gbnf_to_lark("root ::= [a-c]{2,4} \".\"").unwrap();
    let out = e
        .generate(&request(&e, &Grammar::Lark(lark), 5), &mut |_| {
            Flow::Continue
        })
        .unwrap();
    let t = out.text.as_str();
    assert!(
        (3..=5).contains(&t.len())
            && t.ends_with('.')
            && t[..t.len() - 1].chars().all(|c| ('a'..='c').contains(&c)),
        "{t:?}"
    );
}

#[test]
fn batched_generation_follows_the_schema_as_it_does_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = tiny_engine(&dir, SynthQuant::Q4_0);
    assert!(e.batched_step(), "the CPU backend has a batched step");
    let g = Grammar::JsonSchema(schema());
    let alone: Vec<String> = (0..3)
        .map(|seed| {
            e.generate(&request(&e, &g, seed), &mut |_| Flow::Continue)
                .unwrap()
                .text
        })
        .collect();
    let mut b = Batcher::new(BatchOptions::default()).unwrap();
    let reqs: Vec<_> = (0..3).map(|seed| request(&e, &g, seed)).collect();
    let results = admit_all(&mut e, &mut b, &reqs);
    run_to_end(&mut e, &mut b);
    for (i, want) in alone.iter().enumerate() {
        let got = results.lock().unwrap()[i].take().unwrap().unwrap();
        check(&got);
        assert_eq!(&got.text, want, "sequence {i}");
    }
}

/// Tools and tool turns render in Qwen3's markup; a control token typed in a call's arguments
/// stays text.
#[test]
fn tool_turns_render_in_the_template_markup() {
    let dir = tempfile::tempdir().unwrap();
    let e = tiny_engine(&dir, SynthQuant::Q4_0);
    let tools = json!([{ "type": "function", "function": { "name": "get_weather",
        "parameters": { "type": "object", "properties": { "city": { "type": "string" } } } } }]);
    let mut call = q4moe_engine::ChatMessage::assistant("");
    call.tool_calls = vec![ToolCall::function(
        "call_1",
        "get_weather",
        "{\"city\": \"<|im_end|>\"}",
    )];
    let mut result = q4moe_engine::ChatMessage::new("tool", "sunny");
    result.tool_call_id = Some("call_1".into());
    let msgs = [q4moe_engine::ChatMessage::user("Paris?"), call, result];
    let p = e
        .prompter()
        .render_chat_tools(&msgs, Some(&tools), None)
        .unwrap();
    let text = p.text();
    assert!(
        text.contains("# Tools") && text.contains("\"name\": \"get_weather\""),
        "{text}"
    );
    assert!(
        text.contains("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"<|im_end|>\"}}\n</tool_call>"),
        "{text}"
    );
    assert!(
        text.contains("<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>"),
        "{text}"
    );
    // Past this test engine's 256-position context, so the tokenizer alone.
    let ids = e.tokenizer().encode_within(&p, 4096).unwrap();
    let im_end = e.tokenizer().token_id("<|im_end|>").unwrap();
    // <|im_end|> closes the system, user, assistant and tool turns: 4, not the forged fifth.
    assert_eq!(ids.iter().filter(|&&t| t == im_end).count(), 4, "{text}");
}

/// On CUDA a constrained request chooses on the device among the ids the constraint's bits
/// allow (mask_logits, then the arg-max or the device sampler), token after token: the tokens
/// the host's masked choice gives (wanting the logits sends the request to the host), greedy
/// and sampled, and output the grammar accepts.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_constraint_on_the_device_gives_the_hosts_tokens() {
    use q4moe_engine::{Device, Engine, EngineOptions};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    q4moe_model::synth::write(
        &path,
        &q4moe_model::Config::tiny(),
        SynthQuant::Q4_0,
        7,
        false,
    )
    .unwrap();
    let opts = EngineOptions {
        device: Device::Cuda,
        kv_capacity: 512,
        ..Default::default()
    };
    let mut e = Engine::load(&path, &opts).unwrap();
    let lark = q4moe_engine::gbnf_to_lark("root ::= [a-c]{2,40} \".\"").unwrap();
    for g in [Grammar::JsonSchema(schema()), Grammar::Lark(lark)] {
        for temperature in [0.0, 1.0] {
            let mut req = request(&e, &g, 3);
            req.sampling.temperature = temperature;
            let device = e.generate(&req, &mut |_| Flow::Continue).unwrap();
            req.want_logits = true;
            let host = e.generate(&req, &mut |_| Flow::Continue).unwrap();
            assert_eq!(
                device.tokens, host.tokens,
                "{g:?} at temperature {temperature}"
            );
            assert_eq!(device.text, host.text);
            assert!(device.tokens.len() > 2, "{:?}", device.text);
            if matches!(g, Grammar::JsonSchema(_)) {
                check(&device);
            }
        }
    }
}
