//! The APIs people's tools already speak, each driven by its real client package against a
//! real `weft serve` (`api_clients.py`): OpenAI tool calls, structured output and
//! Responses, Anthropic Messages, Ollama. The real model where it can follow the format;
//! a synthetic model, which writes noise, where only constrained decoding can make the
//! output well-formed; and a two-node cluster. Malformed requests get each API's own
//! error shape, naming the field.

mod common;

use std::path::PathBuf;

use serde_json::{json, Value};

use common::real_model;
use common::server::{Server, KEY};

fn python() -> Option<PathBuf> {
    common::server::python(&["openai", "anthropic", "ollama", "jsonschema"])
}

#[test]
fn openai_tool_calls_structured_output_and_responses() {
    let (Some(model), Some(py)) = (real_model(), python()) else {
        return;
    };
    let s = Server::start(&model, &[]);
    let r = s.script(&py, "api_clients.py", &s.url, &["openai"]);
    // The forced call names a declared tool; the client script validated its arguments
    // and the JSON output against their schemas.
    assert!(r["openai_call"]["name"].is_string(), "{r}");
    assert!(r["openai_json_schema"]["age"].is_u64(), "{r}");
}

#[test]
fn anthropic_messages_through_the_anthropic_package() {
    let (Some(model), Some(py)) = (real_model(), python()) else {
        return;
    };
    let s = Server::start(&model, &[]);
    let r = s.script(&py, "api_clients.py", &s.url, &["anthropic"]);
    assert!(r["anthropic_tool_use"]["city"].is_string(), "{r}");
}

#[test]
fn ollama_clients_work_unchanged() {
    let (Some(model), Some(py)) = (real_model(), python()) else {
        return;
    };
    let s = Server::start(&model, &[]);
    let r = s.script(&py, "api_clients.py", &s.url, &["ollama"]);
    assert!(r["ollama_tok_s"].as_f64().is_some_and(|t| t > 0.0), "{r}");
}

/// Sampled (not greedy) forced calls and schema output: on a synthetic model, whose
/// free text is noise, and on a TP=2 cluster, whose coordinator sees only each rank's
/// best candidates.
#[test]
fn forced_output_holds_whatever_the_model_writes() {
    let Some(py) = python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let synthetic = PathBuf::from(common::synthetic_llama_q8(dir.path()));
    // Its byte-level vocabulary spells the tool prompt out in some 800 tokens.
    let s = Server::start(&synthetic, &["--ctx", "2048"]);
    s.script(&py, "api_clients.py", &s.url, &["forced"]);
    drop(s);
    let Some(model) = real_model() else {
        return;
    };
    let s = Server::start(&model, &["--nodes", "2", "--tp", "2"]);
    s.script(&py, "api_clients.py", &s.url, &["forced"]);
}

/// POSTs `body` (raw text) to `path` with `headers`; (HTTP status, parsed body).
fn raw(s: &Server, path: &str, body: &str, headers: &[&str]) -> (u16, Value) {
    let mut args = vec!["-w", "\n%{http_code}", "-d", body];
    for h in headers {
        args.extend(["-H", h]);
    }
    let url = format!("{}{path}", s.url);
    args.push(&url);
    let (out, err) = s.curl(&args);
    let (json_text, code) = out
        .rsplit_once('\n')
        .unwrap_or_else(|| panic!("{out} {err}"));
    let v = serde_json::from_str(json_text).unwrap_or_else(|e| panic!("{path}: {e}: {out}"));
    (code.parse().unwrap(), v)
}

#[test]
fn malformed_requests_get_each_apis_error_shape() {
    let dir = tempfile::tempdir().unwrap();
    let model = PathBuf::from(common::synthetic_llama_q8(dir.path()));
    let s = Server::start(&model, &[]);
    let id = s.model_id.clone();
    let ct = "Content-Type: application/json";
    // OpenAI chat: a tool without a name, a schema the grammar engine cannot hold.
    let body = json!({"model": id, "messages": [{"role": "user", "content": "x"}],
                      "tools": [{"type": "function", "function": {"description": "no name"}}]});
    let (code, v) = raw(&s, "/v1/chat/completions", &body.to_string(), &[ct]);
    assert_eq!(code, 400, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("name"),
        "{v}"
    );
    assert!(
        v["error"]["param"]
            .as_str()
            .unwrap()
            .starts_with("tools[0]"),
        "{v}"
    );
    let body = json!({"model": id, "messages": [{"role": "user", "content": "x"}],
                      "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"$ref": "#/nowhere"}}}});
    let (code, v) = raw(&s, "/v1/chat/completions", &body.to_string(), &[ct]);
    assert_eq!(
        (code, v["error"]["param"].as_str()),
        (400, Some("response_format")),
        "{v}"
    );
    // Responses: input missing.
    let (code, v) = raw(
        &s,
        "/v1/responses",
        &json!({"model": id}).to_string(),
        &[ct],
    );
    assert_eq!(code, 400, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("input"),
        "{v}"
    );
    // Anthropic: max_tokens missing, a bad role; a missing key is Anthropic's 401 too.
    let key = format!("x-api-key: {KEY}");
    let body = json!({"model": id, "messages": [{"role": "user", "content": "x"}]});
    let (code, v) = raw(&s, "/v1/messages", &body.to_string(), &[ct, &key]);
    assert_eq!((code, v["type"].as_str()), (400, Some("error")), "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_tokens"),
        "{v}"
    );
    let body =
        json!({"model": id, "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]});
    let (code, v) = raw(&s, "/v1/messages", &body.to_string(), &[ct, &key]);
    assert_eq!(code, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("messages.0.role"),
        "{v}"
    );
    let out = std::process::Command::new("curl")
        .args(["-sS", "-w", "\n%{http_code}", "-H", ct, "-d", "{}"])
        .arg(format!("{}/v1/messages", s.url))
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&out.stdout).into_owned();
    let (text, code) = out.rsplit_once('\n').unwrap();
    let v: Value = serde_json::from_str(text).unwrap();
    assert_eq!(
        (code, v["error"]["type"].as_str()),
        ("401", Some("authentication_error")),
        "{v}"
    );
    // A limit past the context's room is cut to fit in the APIs whose clients send large
    // limits of their own (OpenAI's refuses it, naming the field).
    let body =
        json!({"model": id, "max_tokens": 100_000, "messages": [{"role": "user", "content": "x"}]});
    let (code, v) = raw(&s, "/v1/messages", &body.to_string(), &[ct, &key]);
    assert_eq!(code, 200, "{v}");
    assert!(
        v["usage"]["output_tokens"]
            .as_u64()
            .is_some_and(|n| n > 0 && n < 1024),
        "{v}"
    );
    let body = json!({"model": id, "max_output_tokens": 100_000, "input": "x"});
    let (code, v) = raw(&s, "/v1/responses", &body.to_string(), &[ct]);
    assert_eq!(code, 200, "{v}");
    let body =
        json!({"model": id, "max_tokens": 100_000, "messages": [{"role": "user", "content": "x"}]});
    let (code, v) = raw(&s, "/v1/chat/completions", &body.to_string(), &[ct]);
    assert_eq!(
        (code, v["error"]["param"].as_str()),
        (400, Some("max_tokens")),
        "{v}"
    );
    // Ollama: messages of the wrong type; no Content-Type at all is still read as JSON.
    let body = json!({"model": id, "messages": 5});
    let (code, v) = raw(&s, "/api/chat", &body.to_string(), &[]);
    assert_eq!(code, 400, "{v}");
    assert!(v["error"].as_str().unwrap().contains("messages"), "{v}");
    let body = json!({"model": id, "prompt": "hi", "stream": false, "options": {"num_predict": 3}});
    let (code, v) = raw(&s, "/api/generate", &body.to_string(), &[]);
    assert_eq!((code, v["done"].as_bool()), (200, Some(true)), "{v}");
    assert!(
        v["eval_count"]
            .as_u64()
            .is_some_and(|n| (1..=3).contains(&n)),
        "{v}"
    );
}
