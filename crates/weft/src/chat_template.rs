//! The chat template `weft serve` renders prompts with: the GGUF file's own, else its
//! architecture's turn format.

use anyhow::{anyhow, Result};
use weft_gguf::GgufFile;
use weft_server::ChatTemplate;
use weft_tokenizer::Tokenizer;

/// The file's chat template, or its architecture's turn format.
pub fn chat_template(file: &GgufFile, tok: &Tokenizer) -> Result<ChatTemplate> {
    let own = file.get_str("tokenizer.chat_template").ok();
    let arch = file.get_str("general.architecture").unwrap_or("");
    let text = |id: Option<u32>| {
        id.map(|i| tok.token_text(i).to_string())
            .unwrap_or_default()
    };
    ChatTemplate::new(own, arch, &text(tok.bos_id()), &text(tok.eos_id()))
        .map_err(|e| anyhow!("{}: {e}", file.path().display()))
}
