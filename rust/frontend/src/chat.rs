//! Chat prompts: the model's chat template, rendered exactly as the Python side renders it, or
//! refused. There is no Jinja engine among Debian's packaged crates, so this frontend knows the
//! templates it can render natively (ChatML with SmolLM2's default system prompt) by their exact
//! text, and refuses any other at start-up naming the file: an approximate prompt would change
//! what the model answers.

use std::path::Path;

const SMOLLM2_CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

const SMOLLM2_DEFAULT_SYSTEM: &str =
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

pub struct ChatTemplate {
    default_system: Option<&'static str>,
}

impl ChatTemplate {
    /// The template of the model in `model_dir` (`chat_template.jinja`, else
    /// `tokenizer_config.json`'s `chat_template`), if this frontend can render it exactly.
    pub fn load(model_dir: &Path) -> Result<Option<ChatTemplate>, String> {
        let file = model_dir.join("chat_template.jinja");
        let (text, source) = if file.exists() {
            (
                std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?,
                file,
            )
        } else {
            let config = model_dir.join("tokenizer_config.json");
            let Ok(raw) = std::fs::read_to_string(&config) else {
                return Ok(None);
            };
            let json: serde_json::Value =
                serde_json::from_str(&raw).map_err(|e| format!("{}: {e}", config.display()))?;
            match json.get("chat_template").and_then(|t| t.as_str()) {
                Some(t) => (t.to_string(), config),
                None => return Ok(None),
            }
        };
        if text.trim_end() == SMOLLM2_CHATML {
            return Ok(Some(ChatTemplate {
                default_system: Some(SMOLLM2_DEFAULT_SYSTEM),
            }));
        }
        Err(format!(
            "{}: this chat template is not one the Rust frontend renders exactly (ChatML with \
             SmolLM2's default system prompt); serve this model with Python API servers",
            source.display()
        ))
    }

    /// The prompt for `messages` (role, content), with the assistant's turn opened when
    /// `add_generation_prompt` (as a chat completion always asks, `/tokenize` by default). The
    /// templates this frontend knows read neither a request's `tools` nor its
    /// `chat_template_kwargs` (Jinja would render them the same with any), so both are taken
    /// and do not change the prompt; a template added here that reads them must take them.
    pub fn render(&self, messages: &[(String, String)], add_generation_prompt: bool) -> String {
        let mut out = String::new();
        for (i, (role, content)) in messages.iter().enumerate() {
            if i == 0 && role != "system" {
                if let Some(system) = self.default_system {
                    out.push_str(&format!("<|im_start|>system\n{system}<|im_end|>\n"));
                }
            }
            out.push_str(&format!("<|im_start|>{role}\n{content}<|im_end|>\n"));
        }
        if add_generation_prompt {
            out.push_str("<|im_start|>assistant\n");
        }
        out
    }
}
