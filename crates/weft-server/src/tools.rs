//! Tool calling, whatever the API: declared tools, the choice of whether to call one,
//! the prompt text for templates that know no tools, the grammar that forces a call, and
//! the calls read back out of what the model wrote.

use serde_json::{json, Value};

use crate::error::ApiError;

/// One declared function.
#[derive(Clone, Debug)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    /// A JSON Schema for the arguments object.
    pub parameters: Value,
}

impl ToolSpec {
    /// The OpenAI shape templates expect (`{"type": "function", "function": {...}}`).
    pub fn as_openai(&self) -> Value {
        json!({"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters,
        }})
    }
}

/// Whether and which tool the model must call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides; calls it writes are recognised.
    Auto,
    /// No calls: the tools are not shown and nothing is parsed.
    None,
    /// Exactly one call to some declared tool, held by a grammar.
    Required,
    /// Exactly one call to this tool, held by a grammar.
    Named(String),
}

/// A call the model made, or one an earlier assistant turn made (fed back in).
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

impl ToolCall {
    pub fn new(name: String, arguments: &Value) -> Self {
        ToolCall {
            id: format!("call_{:016x}", rand::random::<u64>()),
            name,
            arguments: arguments.to_string(),
        }
    }

    /// The Qwen/Hermes text of this call, as a template without tool support is shown
    /// it in earlier turns.
    pub fn as_text(&self) -> String {
        let args: Value =
            serde_json::from_str(&self.arguments).unwrap_or(Value::String(self.arguments.clone()));
        format!(
            "{CALL_OPEN}\n{}\n{CALL_CLOSE}",
            json!({"name": self.name, "arguments": args})
        )
    }
}

pub const CALL_OPEN: &str = "<tool_call>";
pub const CALL_CLOSE: &str = "</tool_call>";

/// Checks the declared tools and the choice against each other: `field` names the
/// request's tools field in errors.
pub fn check_choice(tools: &[ToolSpec], choice: &ToolChoice, field: &str) -> Result<(), ApiError> {
    let mut seen = std::collections::HashSet::new();
    for (i, t) in tools.iter().enumerate() {
        let ok = !t.name.is_empty()
            && t.name.len() <= 64
            && t.name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.');
        if !ok {
            return Err(ApiError::bad_request(
                format!("{field}[{i}].name"),
                format!(
                    "tool name {:?} must be 1 to 64 letters, digits, '_', '-' or '.'",
                    t.name
                ),
            ));
        }
        if !seen.insert(t.name.as_str()) {
            return Err(ApiError::bad_request(
                format!("{field}[{i}].name"),
                format!("tool '{}' is declared twice", t.name),
            ));
        }
        if !t.parameters.is_object() {
            return Err(ApiError::bad_request(
                format!("{field}[{i}].parameters"),
                "parameters must be a JSON Schema object",
            ));
        }
    }
    match choice {
        ToolChoice::Required if tools.is_empty() => Err(ApiError::bad_request(
            "tool_choice",
            "tool_choice requires a call, but no tools are declared",
        )),
        ToolChoice::Named(n) if !tools.iter().any(|t| &t.name == n) => Err(ApiError::bad_request(
            "tool_choice",
            format!("tool_choice names '{n}', which is not among the declared tools"),
        )),
        _ => Ok(()),
    }
}

/// The instructions a template without tool support gets as a system message.
pub fn fallback_prompt(tools: &[ToolSpec]) -> String {
    let mut s = String::from(
        "You can call functions. To call one, answer with only this, and nothing else:\n\
         <tool_call>\n{\"name\": \"FUNCTION_NAME\", \"arguments\": {ARGUMENTS}}\n</tool_call>\n\
         The functions:\n",
    );
    for t in tools {
        s.push_str(&t.as_openai()["function"].to_string());
        s.push('\n');
    }
    s
}

/// A Lark grammar (llguidance's dialect) for exactly one call to one of `tools`, in the
/// Qwen/Hermes form the fallback prompt teaches.
pub fn call_grammar(tools: &[ToolSpec]) -> String {
    let options: Vec<Value> = tools
        .iter()
        .map(|t| {
            json!({
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        })
        .collect();
    let schema = if options.len() == 1 {
        options[0].clone()
    } else {
        json!({"anyOf": options})
    };
    let schema = weft_grammar::compact(&schema);
    format!("start: \"{CALL_OPEN}\\n\" call \"\\n{CALL_CLOSE}\"\ncall: %json {schema}\n")
}

/// A JSON value `{"name": N, "arguments"|"parameters": {...}}` naming a declared tool.
fn call_from_json(v: &Value, tools: &[ToolSpec]) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?;
    if !tools.iter().any(|t| t.name == name) {
        return None;
    }
    let args = v.get("arguments").or_else(|| v.get("parameters"))?;
    // Some models write the arguments as a JSON string.
    let args = match args {
        Value::String(s) => serde_json::from_str(s).ok()?,
        other => other.clone(),
    };
    args.is_object()
        .then(|| ToolCall::new(name.to_string(), &args))
}

/// Reads the calls out of a whole output: `<tool_call>` blocks (Qwen, Hermes), or an
/// output that is only JSON calls (Llama 3's form, with or without `<|python_tag|>`, and
/// what small models write when they drop the tags), one or several separated by `;` or
/// new lines. Returns the text left outside the calls, and the calls; no call is read
/// unless it names a declared tool and parses.
pub fn parse_calls(text: &str, tools: &[ToolSpec]) -> (String, Vec<ToolCall>) {
    let mut calls = Vec::new();
    let mut rest = String::new();
    let mut at = text;
    while let Some(open) = at.find(CALL_OPEN) {
        let after = &at[open + CALL_OPEN.len()..];
        let Some(close) = after.find(CALL_CLOSE) else {
            break;
        };
        match serde_json::from_str::<Value>(after[..close].trim())
            .ok()
            .and_then(|v| call_from_json(&v, tools))
        {
            Some(c) => {
                rest.push_str(&at[..open]);
                calls.push(c);
            }
            None => rest.push_str(&at[..open + CALL_OPEN.len() + close + CALL_CLOSE.len()]),
        }
        at = &after[close + CALL_CLOSE.len()..];
    }
    rest.push_str(at);
    if !calls.is_empty() {
        return (rest.trim().to_string(), calls);
    }
    let bare = text.trim();
    let bare = bare.strip_prefix("<|python_tag|>").unwrap_or(bare).trim();
    if bare.starts_with('{') {
        if let Some(found) = bare_calls(bare, tools) {
            return (String::new(), found);
        }
    }
    (text.to_string(), Vec::new())
}

/// `text` as nothing but calls, separated by whitespace or `;`.
fn bare_calls(text: &str, tools: &[ToolSpec]) -> Option<Vec<ToolCall>> {
    let mut at = text;
    let mut calls = Vec::new();
    while !at.is_empty() {
        let mut values = serde_json::Deserializer::from_str(at).into_iter::<Value>();
        let v = values.next()?.ok()?;
        calls.push(call_from_json(&v, tools)?);
        at = at[values.byte_offset()..].trim_start_matches(|c: char| c.is_whitespace() || c == ';');
    }
    (!calls.is_empty()).then_some(calls)
}

/// Splits streamed text into text that can be shown now and calls as they complete:
/// text that may be the start of a call is held back until it is one or is not.
#[derive(Default)]
pub struct CallSplitter {
    /// Text not yet given out.
    held: String,
    /// Whether anything but whitespace has been given out as text (a bare JSON call must
    /// be the whole output).
    said: bool,
    /// Calls given out so far.
    pub calls: usize,
    /// Whitespace after a call, given out only if text follows (the whole answer's text
    /// is trimmed, and the newlines between calls are not content).
    gap: String,
}

/// What the splitter gives out.
#[derive(Debug, PartialEq)]
pub enum Piece {
    Text(String),
    Call(ToolCall),
}

impl CallSplitter {
    /// Takes the next piece of text; returns what can be given out now.
    pub fn push(&mut self, text: &str, tools: &[ToolSpec]) -> Vec<Piece> {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            let t = self.held.trim_start();
            // A possible bare JSON call (or Llama's tag) at the very start: hold it all.
            if !self.said
                && self.calls == 0
                && (t.starts_with('{') || t.starts_with("<|python_tag|>"))
            {
                return out;
            }
            if let Some(open) = self.held.find(CALL_OPEN) {
                if open > 0 {
                    let before: String = self.held.drain(..open).collect();
                    self.give_text(before, &mut out);
                    continue;
                }
                let Some(close) = self.held.find(CALL_CLOSE) else {
                    return out;
                };
                let block: String = self.held.drain(..close + CALL_CLOSE.len()).collect();
                let (left, calls) = parse_calls(&block, tools);
                self.give_text(left, &mut out);
                self.calls += calls.len();
                out.extend(calls.into_iter().map(Piece::Call));
                continue;
            }
            // Hold back a tail that may begin the opening tag, or leading whitespace
            // before it might be known whether the output is a bare call.
            let keep = (1..CALL_OPEN.len())
                .rev()
                .find(|&k| self.held.ends_with(&CALL_OPEN[..k]))
                .unwrap_or(0);
            let cut = self.held.len() - keep;
            if !self.said && self.calls == 0 && self.held[..cut].trim().is_empty() {
                return out;
            }
            let now: String = self.held.drain(..cut).collect();
            self.give_text(now, &mut out);
            return out;
        }
    }

    fn give_text(&mut self, text: String, out: &mut Vec<Piece>) {
        if text.is_empty() {
            return;
        }
        if self.calls > 0 && text.trim().is_empty() {
            self.gap.push_str(&text);
            return;
        }
        self.said |= !text.trim().is_empty();
        let text = std::mem::take(&mut self.gap) + &text;
        out.push(Piece::Text(text));
    }

    /// The end of the output: what was held, as calls if it reads as calls.
    pub fn finish(&mut self, tools: &[ToolSpec]) -> Vec<Piece> {
        let held = std::mem::take(&mut self.held);
        let mut out = Vec::new();
        let (left, calls) = if !self.said && self.calls == 0 {
            parse_calls(&held, tools)
        } else {
            (held, Vec::new())
        };
        self.calls += calls.len();
        self.give_text(left, &mut out);
        out.extend(calls.into_iter().map(Piece::Call));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<ToolSpec> {
        ["get_weather", "add"]
            .iter()
            .map(|n| ToolSpec {
                name: n.to_string(),
                description: String::new(),
                parameters: json!({"type": "object"}),
            })
            .collect()
    }

    fn names(calls: &[ToolCall]) -> Vec<(&str, Value)> {
        calls
            .iter()
            .map(|c| (c.name.as_str(), serde_json::from_str(&c.arguments).unwrap()))
            .collect()
    }

    #[test]
    fn calls_are_read_in_each_family_format() {
        let t = tools();
        let (rest, calls) = parse_calls(
            "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>",
            &t,
        );
        assert_eq!(rest, "Let me check.");
        assert_eq!(
            names(&calls),
            vec![("get_weather", json!({"city": "Oslo"}))]
        );
        // Llama 3: bare JSON with "parameters", two calls separated by ';'.
        let (rest, calls) = parse_calls(
            "<|python_tag|>{\"name\": \"add\", \"parameters\": {\"a\": 1}}; {\"name\": \"add\", \"parameters\": \"{\\\"a\\\": 2}\"}",
            &t,
        );
        assert_eq!(rest, "");
        assert_eq!(
            names(&calls),
            vec![("add", json!({"a": 1})), ("add", json!({"a": 2}))]
        );
        // Undeclared tools, broken JSON and JSON with text after it stay text.
        for text in [
            "{\"name\": \"rm_rf\", \"arguments\": {}}",
            "<tool_call>{\"name\": \"add\", \"arguments\": {</tool_call>",
            "{\"name\": \"add\", \"arguments\": {}} and then some",
            "The JSON {\"name\": \"add\", \"arguments\": {}} is a call.",
        ] {
            let (rest, calls) = parse_calls(text, &t);
            assert!(calls.is_empty(), "{text}");
            assert_eq!(rest, text);
        }
    }

    #[test]
    fn the_splitter_gives_text_at_once_and_calls_when_complete() {
        let t = tools();
        let text =
            "Sure. <tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call> done";
        // Every split of the stream into two pieces gives the same result.
        for cut in 1..text.len() {
            if !text.is_char_boundary(cut) {
                continue;
            }
            let mut s = CallSplitter::default();
            let mut got = s.push(&text[..cut], &t);
            got.extend(s.push(&text[cut..], &t));
            got.extend(s.finish(&t));
            let joined: String = got
                .iter()
                .filter_map(|p| match p {
                    Piece::Text(x) => Some(x.as_str()),
                    _ => None,
                })
                .collect();
            assert_eq!(joined, "Sure.  done", "cut at {cut}");
            let calls: Vec<&ToolCall> = got
                .iter()
                .filter_map(|p| match p {
                    Piece::Call(c) => Some(c),
                    _ => None,
                })
                .collect();
            assert_eq!(calls.len(), 1, "cut at {cut}");
            assert_eq!(calls[0].name, "add");
        }
        // The newlines between and after calls are not text.
        let two = "<tool_call>\n{\"name\": \"add\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": {}}\n</tool_call>\n";
        let mut s = CallSplitter::default();
        let mut got = s.push(two, &t);
        got.extend(s.finish(&t));
        assert!(got.iter().all(|p| matches!(p, Piece::Call(_))), "{got:?}");
        assert_eq!(got.len(), 2);
        // Text shows before the output ends; a bare call is held to the end.
        let mut s = CallSplitter::default();
        assert_eq!(
            s.push("Hello there", &t),
            vec![Piece::Text("Hello there".into())]
        );
        let mut s = CallSplitter::default();
        assert!(s.push(" {\"name\": \"add\", \"arg", &t).is_empty());
        assert!(s.push("uments\": {}}", &t).is_empty());
        let end = s.finish(&t);
        assert!(
            matches!(&end[..], [Piece::Call(c)] if c.name == "add"),
            "{end:?}"
        );
    }

    #[test]
    fn choices_and_names_are_checked() {
        let t = tools();
        assert!(check_choice(&t, &ToolChoice::Named("add".into()), "tools").is_ok());
        let e = check_choice(&t, &ToolChoice::Named("sub".into()), "tools").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        let e = check_choice(&[], &ToolChoice::Required, "tools").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        let mut bad = t.clone();
        bad[1].name = "no spaces".into();
        let e = check_choice(&bad, &ToolChoice::Auto, "tools").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[1].name"));
        bad[1].name = "get_weather".into();
        let e = check_choice(&bad, &ToolChoice::Auto, "tools").unwrap_err();
        assert!(e.message.contains("twice"), "{}", e.message);
    }

    #[test]
    fn the_call_grammar_names_every_tool() {
        let g = call_grammar(&tools());
        assert!(
            g.starts_with("start: \"<tool_call>\\n\" call \"\\n</tool_call>\""),
            "{g}"
        );
        assert!(
            g.contains("\"const\":\"get_weather\"") && g.contains("\"const\":\"add\""),
            "{g}"
        );
    }
}
