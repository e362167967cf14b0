//! The bodies of weft's fuzz targets, one function per input path that takes bytes from a
//! file, a peer or a client. `fuzz/` runs each under cargo-fuzz (libFuzzer, nightly);
//! `tests/corpora.rs` replays every corpus file through the same function on stable, so
//! what the fuzzers found stays fixed. A target's only check is that nothing panics,
//! hangs or allocates without bound: every error must come back as a value.

use std::sync::OnceLock;

use weft_gguf::GgufFile;
use weft_model::ModelConfig;
use weft_server::api::{parse_body, ChatRequest, CompletionRequest};
use weft_server::template::{ChatTemplate, TemplateMessage};
use weft_server::tools::{parse_calls, CallSplitter, Piece, ToolSpec};

/// A GGUF file: header, metadata, tensor index; then what loading reads from them (the
/// model's configuration, its tokenizer, the planner's profile).
pub fn gguf(data: &[u8]) {
    let Ok(f) = GgufFile::from_bytes("fuzz.gguf", data.to_vec()) else {
        return;
    };
    for t in f.tensors() {
        let _ = t.ty.bytes_for(t.n_elements());
    }
    let _ = weft_model::vocab::tokenizer_from_gguf(&f);
    if let Ok(cfg) = ModelConfig::from_gguf(&f) {
        let _ = weft_cluster::model_profile(&f, &cfg, weft_model::CacheType::F32);
    }
}

/// A data-plane frame header and a handshake hello, as a peer sends them.
pub fn frame(data: &[u8]) {
    use weft_comm::frame::{Header, HEADER_LEN};
    use weft_comm::handshake::{Hello, HELLO_LEN};
    if let Some(h) = data.get(..HEADER_LEN) {
        let _ = Header::decode(h.try_into().expect("HEADER_LEN bytes"), 1 << 20);
    }
    if let Some(h) = data.get(..HELLO_LEN) {
        let _ = Hello::decode(h.try_into().expect("HELLO_LEN bytes"));
    }
}

/// The whole authenticated handshake over a real loopback socket, against a peer that
/// sends these bytes and then closes its side: the first byte picks whether weft accepts
/// (as a node does) or dials (as a coordinator does); the rest is what the peer says.
/// Covers the hello checks, the key exchange on garbage, the proofs and the verdicts.
pub fn handshake(data: &[u8]) {
    use std::io::Write;
    use std::net::{Shutdown, TcpListener, TcpStream};
    use std::time::Duration;
    use weft_comm::handshake::{handshake, Hello};
    let Some((&side, said)) = data.split_first() else {
        return;
    };
    static LISTENER: OnceLock<Option<TcpListener>> = OnceLock::new();
    let Some(l) = LISTENER
        .get_or_init(|| TcpListener::bind("127.0.0.1:0").ok())
        .as_ref()
    else {
        return;
    };
    let Ok(addr) = l.local_addr() else { return };
    let Ok(mut peer) = TcpStream::connect(addr) else {
        return;
    };
    let Ok((mut ours, _)) = l.accept() else {
        return;
    };
    // Whatever weft sends fits the socket buffers (a handshake is under 300 bytes), so
    // the peer can say everything first and close.
    let _ = peer.write_all(said);
    let _ = peer.shutdown(Shutdown::Write);
    let secret = b"fuzz-secret-0123456789-abcdefghijklmnop";
    let timeout = Duration::from_secs(2);
    let _ = if side & 1 == 0 {
        handshake(&mut ours, &Hello::new(1, 2), secret, None, timeout)
    } else {
        handshake(&mut ours, &Hello::new(0, 2), secret, Some(1), timeout)
    };
}

/// A control message from a coordinator or a node, and a membership message.
pub fn control(data: &[u8]) {
    let _ = serde_json::from_slice::<weft_cluster::control::ToNode>(data);
    let _ = serde_json::from_slice::<weft_cluster::control::FromNode>(data);
    let _ = serde_json::from_slice::<weft_cluster::members::Gossip>(data);
}

/// What a shard holder answers: a manifest (checked against the root its first 64 bytes
/// name, as a node checks it against its plan's) and a holding list.
pub fn share(data: &[u8]) {
    let (root, rest) = data.split_at(data.len().min(64));
    let root = String::from_utf8_lossy(root);
    let _ = weft_share::Manifest::parse_checked(rest, &root);
    let _ = weft_cluster::share::parse_holding(data);
}

/// An OpenAI request body, parsed and checked as the server checks it.
pub fn request(data: &[u8]) {
    if let Ok(r) = parse_body::<ChatRequest>(data) {
        for (i, m) in r.messages.iter().enumerate() {
            let _ = m.text(i);
        }
        if let Ok(input) = r.input() {
            tool_output(&input.tools, data);
        }
        let _ = r.common.check("m", 4096, None, None);
    }
    if let Ok(r) = parse_body::<CompletionRequest>(data) {
        let _ = r.common.check("m", 4096, Some(16), None);
    }
    // The other APIs' bodies, as their handlers check them.
    let _ = weft_server::anthropic::parse(data);
    let _ = weft_server::openai_responses::parse(data);
    let _ = weft_server::ollama::parse_chat(data);
    // The bytes as model output, against two declared tools.
    static TOOLS: OnceLock<Vec<ToolSpec>> = OnceLock::new();
    let tools = TOOLS.get_or_init(|| {
        ["get_weather", "add"]
            .iter()
            .map(|n| ToolSpec {
                name: n.to_string(),
                description: String::new(),
                parameters: serde_json::json!({"type": "object"}),
            })
            .collect()
    });
    tool_output(tools, data);
}

/// Model output read for tool calls, whole and streamed in pieces: a model writes
/// anything, and the reader must not panic or lose text.
pub fn tool_output(tools: &[ToolSpec], data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let _ = parse_calls(&text, tools);
    let mut split = CallSplitter::default();
    let mut shown = 0;
    let mut at = 0;
    while at < text.len() {
        let mut end = (at + 7).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        for p in split.push(&text[at..end], tools) {
            if let Piece::Text(t) = p {
                shown += t.len();
            }
        }
        at = end;
    }
    for p in split.finish(tools) {
        if let Piece::Text(t) = p {
            shown += t.len();
        }
    }
    assert!(shown <= text.len(), "the splitter made up text");
}

/// Messages as a client writes them, through the built-in templates (Gemma's turns and
/// ChatML): the first byte picks roles, the rest splits into message texts at 0xFF.
pub fn template(data: &[u8]) {
    let Some((&roles, rest)) = data.split_first() else {
        return;
    };
    const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];
    let msgs: Vec<TemplateMessage> = rest
        .split(|&b| b == 0xFF)
        .enumerate()
        .map(|(i, text)| TemplateMessage {
            role: ROLES[((roles as usize) >> (2 * (i % 4))) & 3].to_string(),
            content: String::from_utf8_lossy(text).into_owned(),
            ..Default::default()
        })
        .collect();
    // Compiled once: the input is the messages, not the template.
    static TEMPLATES: OnceLock<Vec<ChatTemplate>> = OnceLock::new();
    let templates = TEMPLATES.get_or_init(|| {
        ["gemma3", "qwen3"]
            .iter()
            .filter_map(|arch| ChatTemplate::new(None, arch, "<bos>", "<eos>").ok())
            .collect()
    });
    for t in templates {
        if let Ok((text, Some(ranges))) = t.render_protected(&msgs, &[]) {
            for r in ranges {
                assert!(
                    text.get(r).is_some(),
                    "a located text is not a slice of the prompt"
                );
            }
        }
    }
}

/// A fuzz target's body.
pub type Target = fn(&[u8]);

/// The targets by name, as `fuzz/` and the corpus tests call them.
pub const TARGETS: [(&str, Target); 7] = [
    ("gguf", gguf),
    ("frame", frame),
    ("handshake", handshake),
    ("control", control),
    ("request", request),
    ("template", template),
    ("share", share),
];
