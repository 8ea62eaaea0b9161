//! Qwen3 chat template rendering and the `<think>` split.

use q4moe_tokenizer::{
    split_reasoning, ChatMessage, ChatTemplate, TemplateLimit, TemplateLimits, TokenizerError,
    QWEN3_CHAT_TEMPLATE,
};

fn qwen3() -> ChatTemplate {
    ChatTemplate::new(QWEN3_CHAT_TEMPLATE).unwrap()
}

#[test]
fn multi_turn_qwen3_format() {
    let msgs = [
        ChatMessage::system("Be brief."),
        ChatMessage::user("Hi"),
        ChatMessage::assistant("<think>\ngreet\n</think>\n\nHello!"),
        ChatMessage::user("Bye"),
    ];
    let text = qwen3().render(&msgs, true, None).unwrap();
    // Past turns lose their reasoning; the generation prompt opens the assistant turn.
    let want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
                <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(text, want);
    let no_gen = qwen3().render(&msgs, false, None).unwrap();
    assert_eq!(
        no_gen,
        want.strip_suffix("<|im_start|>assistant\n").unwrap()
    );
}

#[test]
fn enable_thinking_false_adds_empty_think_block() {
    let msgs = [ChatMessage::user("2+2?")];
    let base = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(
        qwen3().render(&msgs, true, Some(false)).unwrap(),
        format!("{base}<think>\n\n</think>\n\n")
    );
    assert_eq!(qwen3().render(&msgs, true, Some(true)).unwrap(), base);
    assert_eq!(qwen3().render(&msgs, true, None).unwrap(), base);
}

#[test]
fn reasoning_content_of_the_last_turn_is_kept() {
    let mut a = ChatMessage::assistant("4");
    a.reasoning_content = Some("add".into());
    let text = qwen3()
        .render(&[ChatMessage::user("2+2?"), a], false, None)
        .unwrap();
    assert!(
        text.ends_with("<|im_start|>assistant\n<think>\nadd\n</think>\n\n4<|im_end|>\n"),
        "{text:?}"
    );
}

#[test]
fn template_errors_are_reported() {
    assert!(ChatTemplate::new("{% if %}").is_err());
    let t = ChatTemplate::new("{{ raise_exception('no system role') }}").unwrap();
    let err = t.render(&[], false, None).unwrap_err().to_string();
    assert!(err.contains("no system role"), "{err}");
}

#[test]
fn split_reasoning_cases() {
    let s = |t: &str| split_reasoning(t);
    assert_eq!(
        s("<think>\nplan\n</think>\n\nanswer"),
        (Some("plan".into()), "answer".into())
    );
    // The generation prompt already opened <think>: the text starts inside the block.
    assert_eq!(
        s("plan\n</think>\n\nanswer"),
        (Some("plan".into()), "answer".into())
    );
    assert_eq!(s("<think>\n\n</think>\n\nanswer"), (None, "answer".into()));
    assert_eq!(
        s("<think>\nstill thinking"),
        (Some("still thinking".into()), String::new())
    );
    assert_eq!(s("just an answer"), (None, "just an answer".into()));
}

#[test]
fn tools_and_tool_calls_render_like_qwen3() {
    let messages = serde_json::json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"},
    ]);
    let tools = serde_json::json!([{"type": "function", "function": {"name": "get_weather"}}]);
    let text = qwen3()
        .render_json(&messages, Some(&tools), true, None)
        .unwrap();
    assert!(
        text.starts_with("<|im_start|>system\n# Tools\n\n"),
        "{text}"
    );
    assert!(text.contains("<tools>\n{\"function\": {\"name\": \"get_weather\"}, \"type\": \"function\"}\n</tools>"), "{text}");
    assert!(text.contains("<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n"), "{text}");
    assert!(text.ends_with("<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"), "{text}");
}

fn limit_of(source: &str) -> TemplateLimit {
    let t = ChatTemplate::new(source).unwrap();
    match t.render(&[ChatMessage::user("hi")], true, None) {
        Err(TokenizerError::TemplateLimit(limit)) => limit,
        other => panic!("{source}: expected a limit error, got {other:?}"),
    }
}

/// Issue 55 item 2: hostile templates from a model file stop with an error naming the limit,
/// instead of hanging (1e10 loop steps) or allocating without bound.
#[test]
fn hostile_templates_hit_a_named_limit() {
    let defaults = TemplateLimits::default();
    let nested =
        "{% for i in range(100000) %}{% for j in range(100000) %}.{% endfor %}{% endfor %}";
    let fuel = limit_of(nested);
    assert_eq!(fuel, TemplateLimit::Fuel(defaults.fuel));
    assert!(fuel.to_string().contains("fuel limit"), "{fuel}");
    let big = TemplateLimit::OutputBytes(defaults.max_output_bytes);
    assert_eq!(limit_of(r#"{{ "x" * 100000000 }}"#), big);
    let t = ChatTemplate::new(r#"{{ ("x" * 1000000).replace("x", "y" * 1000000) }}"#).unwrap();
    let err = t.render(&[], false, None).unwrap_err().to_string();
    assert!(err.contains("output limit"), "{err}");
    // Captured blocks are not output yet; their rendering still burns fuel.
    let captured = "{% set s %}{% for i in range(100000) %}{% for j in range(100000) %}.{% endfor %}{% endfor %}{% endset %}";
    assert_eq!(limit_of(captured), TemplateLimit::Fuel(defaults.fuel));
}

#[test]
fn limits_are_configurable_and_generous_for_real_templates() {
    let mut messages = vec![serde_json::json!({"role": "system", "content": "Be brief."})];
    for i in 0..100 {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        let content = format!("message {i}: {}", "some words ".repeat(50));
        messages.push(serde_json::json!({"role": role, "content": content}));
    }
    let messages = serde_json::Value::Array(messages);
    let tool = serde_json::json!({"type": "function", "function": {"name": "f", "parameters": {}}});
    let tools = serde_json::Value::Array(vec![tool; 20]);
    let text = qwen3()
        .render_json(&messages, Some(&tools), true, Some(true))
        .unwrap();
    assert!(text.contains("message 99:") && text.len() > 50_000);
    let tight = TemplateLimits {
        fuel: 1_000_000,
        max_output_bytes: text.len() - 1,
        ..TemplateLimits::default()
    };
    let t = ChatTemplate::with_limits(QWEN3_CHAT_TEMPLATE, tight).unwrap();
    let err = t.render_json(&messages, Some(&tools), true, Some(true));
    assert!(
        matches!(err, Err(TokenizerError::TemplateLimit(TemplateLimit::OutputBytes(n))) if n == text.len() - 1),
        "{err:?}"
    );
}

/// Issue 56 item 9: the Python methods real templates call (minijinja-contrib's pycompat) and
/// `tojson(indent=...)` as Python's `json.dumps` writes it.
#[test]
fn python_methods_and_indented_tojson_render() {
    let src = r#"{%- for m in messages -%}
{%- if m.content.startswith('/') -%}cmd:{{ m.content.split(' ')[0].lstrip('/') }}
{% else -%}
{%- for k, v in m.items() | sort -%}{{ k }}={{ v }};{% endfor %}
{% endif -%}
{%- endfor -%}
{{ {"name": "f", "args": [1, "x"]} | tojson(indent=2) }}
{{ "a,b,,c".split(",") | length }} {{ "Hello".upper().replace("L", "l", 1) }} {{ "-".join(["x", "y"]) }}"#;
    let t = ChatTemplate::new(src).unwrap();
    let text = t
        .render(
            &[
                ChatMessage::user("/reset now"),
                ChatMessage::assistant("ok"),
            ],
            false,
            None,
        )
        .unwrap();
    let want = "cmd:reset\ncontent=ok;role=assistant;{\n  \"args\": [\n    1,\n    \"x\"\n  ],\n  \"name\": \"f\"\n}\n4 HElLO x-y";
    assert_eq!(text, want);
}

/// The guards in front of pycompat keep a method from building past the output limit.
#[test]
fn python_methods_stay_under_the_output_limit() {
    for src in [
        // Only the length is output, so nothing but the guard stops the 100 MB string.
        r#"{{ ("x" * 100000).replace("x", "y" * 1000) | length }}"#,
        r#"{{ ("y" * 10000).join(range(10000)) | length }}"#,
        r#"{{ ("y" * 10000).join(["a"] * 10000) | length }}"#,
    ] {
        let tight = TemplateLimits {
            fuel: 1_000_000,
            max_output_bytes: 1 << 20,
            ..TemplateLimits::default()
        };
        let t = ChatTemplate::with_limits(src, tight).unwrap();
        let err = t.render(&[], false, None).unwrap_err().to_string();
        assert!(err.contains("output limit"), "{src}: {err}");
    }
}

/// Tool calls and tool results carried on `ChatMessage` reach Qwen3's template.
#[test]
fn tool_calls_on_chat_messages_render() {
    let mut call = ChatMessage::assistant("");
    call.tool_calls = vec![q4moe_tokenizer::ToolCall::function(
        "toolu_1",
        "get_weather",
        serde_json::json!({"city": "Paris"}),
    )];
    let mut result = ChatMessage::new("tool", "sunny");
    result.tool_call_id = Some("toolu_1".into());
    let text = qwen3()
        .render(&[ChatMessage::user("Weather?"), call, result], true, None)
        .unwrap();
    assert!(text.contains("<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"), "{text}");
}
