//! Constrained decoding: a JSON Schema, "any JSON object" or a Lark grammar held while
//! sampling, so the output always parses. llguidance computes each step's token mask over
//! the model's own vocabulary; `Rule` hands it to the sampler as a `TokenConstraint`.

mod rule;
mod vocab;

pub use rule::Rule;

use llguidance::api::TopLevelGrammar;
use llguidance::ParserFactory;
use serde_json::Value;
use weft_tokenizer::Tokenizer;

/// Compiles grammars against one tokenizer's vocabulary. Built once per served model:
/// the vocabulary trie takes a moment for a large vocabulary.
pub struct Grammars {
    factory: ParserFactory,
    eog: Vec<u32>,
    eos: u32,
}

impl Grammars {
    pub fn new(tok: &Tokenizer) -> Result<Self, String> {
        let env = vocab::token_env(tok)?;
        let mut factory = ParserFactory::new_simple(&env.env)
            .map_err(|e| format!("building the grammar engine over the vocabulary: {e}"))?;
        factory.quiet();
        Ok(Grammars {
            factory,
            eog: tok.eog_ids().to_vec(),
            eos: env.eos,
        })
    }

    /// Output that is one JSON value valid against `schema`.
    pub fn json_schema(&self, schema: &Value) -> Result<Rule, String> {
        self.rule(TopLevelGrammar::from_json_schema(compact(schema)))
    }

    /// Output that is one JSON object (any keys and values).
    pub fn json_object(&self) -> Result<Rule, String> {
        self.json_schema(&serde_json::json!({"type": "object"}))
    }

    /// Output that matches a Lark grammar (llguidance's dialect: `%json { schema }` embeds
    /// a JSON Schema as a rule).
    pub fn lark(&self, grammar: &str) -> Result<Rule, String> {
        self.rule(TopLevelGrammar::from_lark(grammar.to_string()))
    }

    fn rule(&self, grammar: TopLevelGrammar) -> Result<Rule, String> {
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| e.to_string())?;
        Rule::new(parser, self.eos, self.eog.clone())
    }
}

#[cfg(test)]
mod tests;

/// `schema` with llguidance's output options set, unless the schema sets its own: JSON on
/// one line with the usual separators (a small model let loose on whitespace can spend
/// its whole budget on it), `oneOf` read as `anyOf`, and keywords the engine does not
/// know ignored rather than refused, as clients' generated schemas carry many.
pub fn compact(schema: &Value) -> Value {
    let mut s = schema.clone();
    if let Value::Object(m) = &mut s {
        m.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
                "coerce_one_of": true,
                "lenient": true,
            })
        });
    }
    s
}
