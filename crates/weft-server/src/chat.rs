//! A chat turn made into the prompt's tokens (through the model's template, with a
//! fallback for templates that know no tools) and the rule sampling must follow.

use std::sync::Arc;

use serde_json::{json, Value};
use weft_grammar::Grammars;
use weft_model::TokenConstraint;

use crate::error::ApiError;
use crate::state::{AppState, Prepared};
use crate::template::TemplateMessage;
use crate::tools::{call_grammar, check_choice, fallback_prompt, ToolCall, ToolChoice, ToolSpec};
use crate::turn::{ChatInput, ChatTurn, OutputFormat};

/// Renders `input` through the model's template and builds its rule.
pub async fn prepare(st: &Arc<AppState>, input: &ChatInput) -> Result<Prepared, ApiError> {
    let (msgs_field, tools_field, _) = input.fields;
    if input.messages.is_empty() {
        return Err(ApiError::bad_request(
            msgs_field,
            format!("{msgs_field} is empty"),
        ));
    }
    check_choice(&input.tools, &input.choice, tools_field)?;
    let offered = input.offered();
    let native = st.template.supports_tools;
    let msgs = if native {
        native_turns(&input.messages)
    } else {
        text_turns(&input.messages, offered)
    };
    let tools: Vec<Value> = if native {
        offered.iter().map(ToolSpec::as_openai).collect()
    } else {
        Vec::new()
    };
    let (text, texts_at) = st
        .template
        .render_protected(&msgs, &tools)
        .map_err(|e| ApiError::bad_request(msgs_field, e))?;
    let prompt = encode(st, &text, texts_at, &msgs, &tools, msgs_field)?;
    let rule = rule_for(st, input).await?;
    Ok(Prepared { prompt, rule })
}

/// The messages as a template that reads tools sees them: calls with their arguments as
/// objects, tool results as `tool` turns.
fn native_turns(turns: &[ChatTurn]) -> Vec<TemplateMessage> {
    turns
        .iter()
        .map(|t| TemplateMessage {
            role: t.role.clone(),
            content: t.text.clone(),
            tool_calls: (!t.calls.is_empty()).then(|| {
                t.calls
                    .iter()
                    .map(|c| {
                        let args: Value = serde_json::from_str(&c.arguments)
                            .unwrap_or(Value::String(c.arguments.clone()));
                        json!({"id": c.id, "type": "function",
                               "function": {"name": c.name, "arguments": args}})
                    })
                    .collect()
            }),
            tool_call_id: t.call_id.clone(),
            name: t.tool_name.clone(),
        })
        .collect()
}

/// The messages for a template that knows no tools: the tools described in the system
/// message, calls written as `<tool_call>` text, results as user turns (merged when
/// several follow each other, so turns still alternate).
fn text_turns(turns: &[ChatTurn], offered: &[ToolSpec]) -> Vec<TemplateMessage> {
    let mut out: Vec<TemplateMessage> = Vec::new();
    if !offered.is_empty() {
        let mut system = fallback_prompt(offered);
        if let Some(first) = turns.first().filter(|t| t.role == "system") {
            system = format!("{}\n\n{system}", first.text);
        }
        out.push(TemplateMessage {
            role: "system".into(),
            content: system,
            ..Default::default()
        });
    }
    for (i, t) in turns.iter().enumerate() {
        if i == 0 && t.role == "system" && !offered.is_empty() {
            continue;
        }
        let (role, content) = match t.role.as_str() {
            "tool" => (
                "user",
                format!("<tool_response>\n{}\n</tool_response>", t.text),
            ),
            "assistant" if !t.calls.is_empty() => {
                let calls: Vec<String> = t.calls.iter().map(ToolCall::as_text).collect();
                let lead = if t.text.is_empty() {
                    String::new()
                } else {
                    format!("{}\n", t.text)
                };
                ("assistant", format!("{lead}{}", calls.join("\n")))
            }
            r => (r, t.text.clone()),
        };
        // Results, and a user's words after them, share one user turn: turns alternate.
        let after_results = i > 0 && turns[i - 1].role == "tool";
        match out.last_mut() {
            Some(last) if role == "user" && last.role == "user" && after_results => {
                last.content.push('\n');
                last.content.push_str(&content);
            }
            _ => out.push(TemplateMessage {
                role: role.into(),
                content,
                ..Default::default()
            }),
        }
    }
    out
}

/// The prompt's tokens: control tokens come from the template only, never from a
/// message's text or a tool's declaration.
fn encode(
    st: &AppState,
    text: &str,
    texts_at: Option<crate::template::TextRanges>,
    msgs: &[TemplateMessage],
    tools: &[Value],
    msgs_field: &str,
) -> Result<Vec<u32>, ApiError> {
    let t = &st.tokenizer;
    let forges = |s: &str| t.encode(s, false, true) != t.encode(s, false, false);
    // Tool declarations a template prints itself are not located as texts: refuse any
    // that would read as control tokens.
    if let Some(i) = tools.iter().position(|v| forges(&v.to_string())) {
        return Err(ApiError::bad_request(
            format!("tools[{i}]"),
            "the tool's declaration holds the model's control-token text",
        ));
    }
    // A template that writes BOS itself must not get a second one from the tokenizer.
    let bos = t.bos_id().map(|b| t.token_text(b));
    let add_bos = t.add_bos() && !bos.is_some_and(|b| text.starts_with(b));
    match texts_at {
        Some(ranges) => Ok(t.encode_protected(text, add_bos, &ranges)),
        None => {
            // The template rewrote the texts past locating them: refuse a text that would
            // read as control tokens rather than let it forge turns.
            if let Some(i) = msgs.iter().position(|m| forges(&m.content)) {
                return Err(ApiError::bad_request(
                    format!("{msgs_field}[{i}].content"),
                    "the text holds the model's control-token text, which this model's chat \
                     template does not let weft keep as plain text",
                ));
            }
            Ok(t.encode(text, add_bos, true))
        }
    }
}

/// The rule for a forced call or a structured output, if `input` asks for one; compiled
/// off the async threads (a large schema takes a while).
pub async fn rule_for(
    st: &Arc<AppState>,
    input: &ChatInput,
) -> Result<Option<Box<dyn TokenConstraint>>, ApiError> {
    let forced: Vec<ToolSpec> = match &input.choice {
        ToolChoice::Required => input.tools.clone(),
        ToolChoice::Named(n) => input
            .tools
            .iter()
            .filter(|t| &t.name == n)
            .cloned()
            .collect(),
        _ => Vec::new(),
    };
    if forced.is_empty() && matches!(input.format, OutputFormat::Text) {
        return Ok(None);
    }
    let grammars = grammars(st).await?;
    let format = input.format.clone();
    let (_, tools_field, format_field) = input.fields;
    let compiled = tokio::task::spawn_blocking(move || {
        if !forced.is_empty() {
            return grammars.lark(&call_grammar(&forced)).map_err(|e| {
                ApiError::bad_request(
                    tools_field,
                    format!("a tool's parameters schema cannot be held while sampling: {e}"),
                )
            });
        }
        match &format {
            OutputFormat::JsonSchema(schema) => grammars.json_schema(schema).map_err(|e| {
                ApiError::bad_request(
                    format_field,
                    format!("the JSON Schema cannot be held while sampling: {e}"),
                )
            }),
            _ => grammars
                .json_object()
                .map_err(|e| ApiError::internal(format!("the JSON grammar: {e}"))),
        }
    })
    .await
    .map_err(|e| ApiError::internal(format!("compiling the grammar: {e}")))?;
    Ok(Some(Box::new(compiled?)))
}

/// The grammar engine over this model's vocabulary, built on first use (off the async
/// threads: a large vocabulary takes a moment).
async fn grammars(st: &Arc<AppState>) -> Result<Arc<Grammars>, ApiError> {
    if let Some(g) = st.grammars.get() {
        return g.clone().map_err(ApiError::internal);
    }
    let state = st.clone();
    let built = tokio::task::spawn_blocking(move || {
        state
            .grammars
            .get_or_init(|| Grammars::new(&state.tokenizer).map(Arc::new))
            .clone()
    })
    .await
    .map_err(|e| ApiError::internal(format!("building the grammar engine: {e}")))?;
    built.map_err(ApiError::internal)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::template::ChatTemplate;

    fn turn(role: &str, text: &str) -> ChatTurn {
        ChatTurn {
            role: role.into(),
            text: text.into(),
            ..Default::default()
        }
    }

    fn conversation() -> (Vec<ChatTurn>, Vec<ToolSpec>) {
        let tool = ToolSpec {
            name: "get_weather".into(),
            description: "Weather now.".into(),
            parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
        };
        let mut call = ToolCall::new("get_weather".into(), &json!({"city": "Oslo"}));
        call.id = "call_1".into();
        let mut asked = turn("assistant", "");
        asked.calls = vec![call];
        let mut result = turn("tool", "{\"c\": 3}");
        result.call_id = Some("call_1".into());
        result.tool_name = Some("get_weather".into());
        let mut second = turn("tool", "{\"c\": 4}");
        second.call_id = Some("call_1".into());
        let turns = vec![
            turn("system", "Be brief."),
            turn("user", "Weather?"),
            asked,
            result,
            second,
            turn("user", "And tomorrow?"),
        ];
        (turns, vec![tool])
    }

    #[test]
    fn a_template_without_tools_gets_them_as_text_and_turns_still_alternate() {
        let (turns, tools) = conversation();
        let msgs = text_turns(&turns, &tools);
        let roles: Vec<&str> = msgs.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        assert!(msgs[0]
            .content
            .starts_with("Be brief.\n\nYou can call functions."));
        assert!(msgs[0].content.contains("\"name\":\"get_weather\""));
        assert_eq!(
            msgs[2].content,
            "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Oslo\"}}\n</tool_call>"
        );
        // Both results in one user turn, in order.
        assert_eq!(
            msgs[3].content,
            "<tool_response>\n{\"c\": 3}\n</tool_response>\n<tool_response>\n{\"c\": 4}\n</tool_response>\nAnd tomorrow?"
        );
        // Gemma's turn format accepts the result (it refuses turns that do not alternate).
        let gemma = ChatTemplate::new(None, "gemma3", "<bos>", "<eos>").unwrap();
        assert!(gemma.render(&msgs).is_ok());
        // Without tools offered, nothing is added.
        let plain = text_turns(&turns[..2], &[]);
        assert_eq!(plain[0].content, "Be brief.");
    }

    #[test]
    fn a_template_with_tools_reads_them_and_the_calls_itself() {
        let (turns, tools) = conversation();
        let own = "{% if tools %}[TOOLS {% for t in tools %}{{ t.function.name }}{% endfor %}]{% endif %}\
                   {% for m in messages %}[{{ m.role }}]{{ m.content }}\
                   {% for c in m.tool_calls or [] %}<call {{ c.function.name }} {{ c.function.arguments.city }}>{% endfor %}\
                   {% if m.tool_call_id %}<for {{ m.tool_call_id }}>{% endif %}{% endfor %}";
        let t = ChatTemplate::new(Some(own), "qwen3", "", "").unwrap();
        assert!(t.supports_tools);
        let decl: Vec<Value> = tools.iter().map(ToolSpec::as_openai).collect();
        let (text, ranges) = t.render_protected(&native_turns(&turns), &decl).unwrap();
        assert_eq!(
            text,
            "[TOOLS get_weather][system]Be brief.[user]Weather?[assistant]<call get_weather Oslo>\
             [tool]{\"c\": 3}<for call_1>[tool]{\"c\": 4}<for call_1>[user]And tomorrow?"
        );
        assert!(ranges.is_some(), "the texts are still located");
    }
}
