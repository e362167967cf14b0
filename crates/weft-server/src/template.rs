//! Chat templates: the GGUF's own `tokenizer.chat_template` rendered with minijinja (with
//! Python-style string methods, as Hugging Face templates expect), or, where the file has
//! none, the architecture's own turn format written as a template of the same kind.

use minijinja::{context, Environment, Error, ErrorKind};
use serde::Serialize;

/// Gemma's turn format (system text joins the first user turn, as Gemma's template does).
const GEMMA_TURNS: &str = r#"{{ bos_token -}}
{% if messages and messages[0].role == 'system' %}
{% set first = messages[0].content + '\n\n' %}
{% set rest = messages[1:] %}
{% else %}
{% set first = '' %}
{% set rest = messages %}
{% endif %}
{% for m in rest %}
{% if (m.role == 'user') != (loop.index0 is even) %}
{{ raise_exception('roles must alternate user/assistant/user/...') -}}
{% endif %}
{{ '<start_of_turn>' + ('model' if m.role == 'assistant' else m.role) + '\n' -}}
{{ (first if loop.first else '') + (m.content | trim) + '<end_of_turn>\n' -}}
{% endfor %}
{% if add_generation_prompt %}
{{ '<start_of_turn>model\n' -}}
{% endif %}
"#;

/// ChatML, for architectures whose files carry no template.
const CHATML: &str = r#"{% for m in messages %}
{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
{% endfor %}
{% if add_generation_prompt %}
{{ '<|im_start|>assistant\n' -}}
{% endif %}
"#;

/// One message as the template sees it.
#[derive(Clone, Debug, Serialize)]
pub struct TemplateMessage {
    pub role: String,
    pub content: String,
}

/// A compiled chat template and the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
    /// Where the template came from, for /v1/models and logs.
    pub source: &'static str,
}

impl ChatTemplate {
    /// `own`: the file's template, if any; `arch`: the GGUF architecture name.
    pub fn new(own: Option<&str>, arch: &str, bos: &str, eos: &str) -> Result<Self, String> {
        let (text, source) = match own {
            Some(t) => (t.to_string(), "gguf tokenizer.chat_template"),
            None if arch.starts_with("gemma") => (GEMMA_TURNS.to_string(), "gemma turn format"),
            None => (CHATML.to_string(), "chatml"),
        };
        let mut env = Environment::new();
        // As Hugging Face renders chat templates.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| e.to_string())?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned("chat", text)
            .map_err(|e| format!("chat template ({source}) does not parse: {e}"))?;
        Ok(ChatTemplate {
            env,
            bos: bos.to_string(),
            eos: eos.to_string(),
            source,
        })
    }

    /// The prompt text for `messages`, ending with the assistant's turn opening.
    pub fn render(&self, messages: &[TemplateMessage]) -> Result<String, String> {
        let t = self.env.get_template("chat").map_err(|e| e.to_string())?;
        t.render(context! {
            messages => minijinja::value::Serde(messages),
            add_generation_prompt => true,
            bos_token => &self.bos,
            eos_token => &self.eos,
        })
        .map_err(|e| {
            let mut msg = e.to_string();
            if let Some(d) = e.detail() {
                msg = format!("{msg}: {d}");
            }
            format!("chat template: {msg}")
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> TemplateMessage {
        TemplateMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    #[test]
    fn gemma_fallback_renders_turns() {
        let t = ChatTemplate::new(None, "gemma3", "<bos>", "<eos>").unwrap();
        let s = t
            .render(&[
                msg("system", "Be brief."),
                msg("user", " Hi "),
                msg("assistant", "Hello"),
                msg("user", "Bye"),
            ])
            .unwrap();
        assert_eq!(
            s,
            "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
        );
        let e = t.render(&[msg("assistant", "x")]).unwrap_err();
        assert!(e.contains("alternate"), "{e}");
    }

    #[test]
    fn file_templates_use_python_methods() {
        let own = "{% for m in messages %}[{{ m.role.upper() }}]{{ m.content.strip() }}{% endfor %}{% if add_generation_prompt %}[A]{% endif %}";
        let t = ChatTemplate::new(Some(own), "llama", "<s>", "</s>").unwrap();
        assert_eq!(t.render(&[msg("user", "  yo ")]).unwrap(), "[USER]yo[A]");
        assert!(ChatTemplate::new(Some("{% for %}"), "llama", "", "").is_err());
        let chatml = ChatTemplate::new(None, "qwen3", "", "").unwrap();
        assert_eq!(
            chatml.render(&[msg("user", "q")]).unwrap(),
            "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
        );
    }
}
