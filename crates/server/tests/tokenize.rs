//! llama-server's `/tokenize` and `/detokenize` on the real server (tiny synthetic model, CPU).

mod common;

use common::start_default;
use serde_json::{json, Value};

#[tokio::test]
async fn tokenize_round_trips_through_detokenize() {
    let s = start_default().await;
    let text = "Hello world, 1234 héllo\n  indented <|im_start|>";
    let (status, v) = s.post("/tokenize", &json!({ "content": text })).await;
    assert_eq!(status, 200, "{v}");
    let ids: Vec<u64> = v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert!(ids.len() > 5);
    let (status, d) = s.post("/detokenize", &json!({ "tokens": ids })).await;
    assert_eq!(status, 200, "{d}");
    assert_eq!(d["content"], text);
    // Typed control tokens are parsed by default (llama-server's parse_special), kept as text
    // with parse_special false: more tokens, same text back.
    let (_, lit) = s
        .post(
            "/tokenize",
            &json!({ "content": text, "parse_special": false }),
        )
        .await;
    let lit_ids = lit["tokens"].as_array().unwrap();
    assert!(
        lit_ids.len() > ids.len(),
        "{} vs {}",
        lit_ids.len(),
        ids.len()
    );
    let (_, d) = s.post("/detokenize", &json!({ "tokens": lit_ids })).await;
    assert_eq!(d["content"], text);
}

#[tokio::test]
async fn with_pieces_pairs_each_id_with_its_text() {
    let s = start_default().await;
    let text = "pieces of text";
    let (_, plain) = s.post("/tokenize", &json!({ "content": text })).await;
    let (status, v) = s
        .post(
            "/tokenize",
            &json!({ "content": text, "with_pieces": true }),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let pieces = v["tokens"].as_array().unwrap();
    let ids: Vec<Value> = pieces.iter().map(|p| p["id"].clone()).collect();
    assert_eq!(Value::Array(ids), plain["tokens"]);
    let joined: String = pieces
        .iter()
        .map(|p| p["piece"].as_str().unwrap())
        .collect();
    assert_eq!(joined, text);
}

#[tokio::test]
async fn bad_and_oversized_inputs_are_refused() {
    let s = start_default().await;
    let cases = [
        ("/tokenize", json!({}), "content"),
        ("/tokenize", json!({ "content": 5 }), "content"),
        (
            "/tokenize",
            json!({ "content": "x", "with_pieces": "yes" }),
            "with_pieces",
        ),
        ("/detokenize", json!({ "tokens": "1 2" }), "tokens"),
        ("/detokenize", json!({ "tokens": [1, -2] }), "tokens[1]"),
        (
            "/detokenize",
            json!({ "tokens": [1, 99999999] }),
            "tokens[1]",
        ),
    ];
    for (path, body, field) in cases {
        let (status, v) = s.post(path, &body).await;
        assert_eq!(status, 400, "{path} {body}: {v}");
        assert_eq!(v["error"]["param"], field, "{path} {body}: {v}");
    }
    // Longer than the context: refused, not tokenized whole.
    let (status, v) = s
        .post("/tokenize", &json!({ "content": "word ".repeat(12_000) }))
        .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    let (status, v) = s
        .post("/detokenize", &json!({ "tokens": vec![1; 10_000] }))
        .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], "context_length_exceeded");
}
