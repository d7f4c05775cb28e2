//! What a chat's output text holds beside its answer: the model's reasoning, and the tool calls
//! it writes itself (`--reasoning-parser qwen3`, `--tool-call-parser hermes`). This is
//! `rankcast/api_server/output_parsers.py` line for line, so that a fleet of Python and Rust
//! API servers gives one answer whichever server a request reaches: the same states, the same
//! text held back, the same arguments JSON (`pyjson`, which writes it as `json.dumps` does).
//! `tests/frontend_rust/test_output_parsers_rust.py` feeds both the same outputs, cut the same
//! ways (`parse_replay`), and compares what each piece gives.
//!
//! Text is sliced by byte here and by character there; every cut falls next to a tag or a
//! newline, which are ASCII, so the pieces are the same. Python's `str.strip()` strips what
//! `str.isspace` calls whitespace, which is `char::is_whitespace` and four separator controls:
//! `py_space` is that set.

use crate::pyjson::Json;

pub const THINK_START: &str = "<think>";
pub const THINK_END: &str = "</think>";
pub const CALL_START: &str = "<tool_call>";
pub const CALL_END: &str = "</tool_call>";

/// Python's `str.isspace`.
fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

fn lstrip(s: &str) -> &str {
    s.trim_start_matches(py_space)
}

fn rstrip(s: &str) -> &str {
    s.trim_end_matches(py_space)
}

fn lstrip_newlines(s: &str) -> &str {
    s.trim_start_matches('\n')
}

fn rstrip_newlines(s: &str) -> &str {
    s.trim_end_matches('\n')
}

/// The length of the longest end of `text` that is a proper prefix of `tag`: what could still
/// become the tag when more text comes.
fn partial_tag(text: &str, tag: &str) -> usize {
    let (text, tag) = (text.as_bytes(), tag.as_bytes());
    (1..=(tag.len() - 1).min(text.len()))
        .rev()
        .find(|&size| text.ends_with(&tag[..size]))
        .unwrap_or(0)
}

/// Whether the chat template left `<think>` open at the end of the prompt, so the output starts
/// inside the reasoning.
pub fn prompt_opens_think(prompt: &str) -> bool {
    rstrip(prompt).ends_with(THINK_START)
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum State {
    Lead,
    Reasoning,
    Tentative,
    AfterEnd,
    Content,
}

/// What a stretch of output turned into.
#[derive(Default, Debug)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

/// Qwen3's `<think>` block, read incrementally (`feed` each delta, then `finish`).
///
/// `opened`: the prompt left `<think>` open. `constrained`: the request's output follows a
/// grammar from its first token, so with `opened` it is reasoning only if the grammar put a
/// `</think>` in it: held until `</think>` or the end. `call_ends`: a `<tool_call>` also ends
/// the reasoning (tool calls are parsed after it).
pub struct ThinkParser {
    call_ends: bool,
    state: State,
    held: String,
    /// Reasoning text given out yet (its leading newlines go).
    reasoning_started: bool,
    /// The template opened the block, and a model may still write `<think>` first.
    repeated_start: bool,
}

impl ThinkParser {
    pub fn new(opened: bool, constrained: bool, call_ends: bool) -> ThinkParser {
        let state = match (opened, constrained) {
            (false, _) => State::Lead,
            (true, true) => State::Tentative,
            (true, false) => State::Reasoning,
        };
        ThinkParser {
            call_ends,
            state,
            held: String::new(),
            reasoning_started: false,
            repeated_start: opened,
        }
    }

    pub fn feed(&mut self, text: &str) -> Split {
        if self.state == State::Content {
            return Split {
                reasoning: String::new(),
                content: text.to_string(),
            };
        }
        self.held.push_str(text);
        self.advance(false)
    }

    pub fn finish(&mut self) -> Split {
        self.advance(true)
    }

    fn reasoning(&mut self, text: &str) -> String {
        let mut text = text;
        if !self.reasoning_started {
            text = lstrip_newlines(text);
            self.reasoning_started = !text.is_empty();
        }
        text.to_string()
    }

    fn advance(&mut self, last: bool) -> Split {
        let mut out = Split::default();
        loop {
            let held = std::mem::take(&mut self.held);
            match self.state {
                State::Lead => {
                    // The model may open the block: `<think>` first, after any whitespace.
                    let rest = lstrip(&held);
                    if let Some(after) = rest.strip_prefix(THINK_START) {
                        (self.state, self.held) = (State::Reasoning, after.to_string());
                        continue;
                    }
                    if !last && THINK_START.starts_with(rest) {
                        self.held = held; // nothing yet, or the start of a `<think>`
                        return out;
                    }
                    self.state = State::Content;
                    out.content.push_str(&held);
                    return out;
                }
                State::Tentative => {
                    if !held.contains(THINK_END) {
                        if last {
                            // The grammar wrote no `</think>`: its output is the answer.
                            self.state = State::Content;
                            out.content.push_str(&held);
                        } else {
                            self.held = held;
                        }
                        return out;
                    }
                    (self.state, self.repeated_start) = (State::Reasoning, false);
                    let rest = lstrip(&held);
                    self.held = match rest.strip_prefix(THINK_START) {
                        Some(after) => after.to_string(),
                        None => held,
                    };
                    continue;
                }
                State::Reasoning => {
                    let mut held = held;
                    if self.repeated_start {
                        let rest = lstrip(&held);
                        if !last && THINK_START.starts_with(rest) && rest != THINK_START {
                            self.held = held; // nothing yet, or the start of a `<think>`
                            return out;
                        }
                        self.repeated_start = false;
                        if let Some(after) = rest.strip_prefix(THINK_START) {
                            held = after.to_string();
                        }
                    }
                    let end = held.find(THINK_END);
                    let call = if self.call_ends {
                        held.find(CALL_START)
                    } else {
                        None
                    };
                    if let Some(call) = call.filter(|&c| end.is_none_or(|e| c < e)) {
                        // A tool call ends the reasoning it was written in (as vLLM reads
                        // Qwen3.5).
                        let reasoning = self.reasoning(rstrip_newlines(&held[..call]));
                        out.reasoning.push_str(&reasoning);
                        self.state = State::Content;
                        out.content.push_str(&held[call..]);
                        return out;
                    }
                    if let Some(end) = end {
                        let reasoning = self.reasoning(rstrip_newlines(&held[..end]));
                        out.reasoning.push_str(&reasoning);
                        self.state = State::AfterEnd;
                        self.held = held[end + THINK_END.len()..].to_string();
                        continue;
                    }
                    if last {
                        let reasoning = self.reasoning(&held);
                        out.reasoning.push_str(&reasoning);
                        return out;
                    }
                    // Keep what could still be `</think>` (or `<tool_call>`), and the newlines
                    // before it.
                    let mut partial = partial_tag(&held, THINK_END);
                    if self.call_ends {
                        partial = partial.max(partial_tag(&held, CALL_START));
                    }
                    let keep = rstrip_newlines(&held[..held.len() - partial]).len();
                    let reasoning = self.reasoning(&held[..keep]);
                    out.reasoning.push_str(&reasoning);
                    self.held = held[keep..].to_string();
                    return out;
                }
                State::AfterEnd => {
                    let rest = lstrip_newlines(&held);
                    if rest.is_empty() {
                        self.held = held;
                    } else {
                        self.state = State::Content;
                        out.content.push_str(rest);
                    }
                    return out;
                }
                State::Content => {
                    // Only reached with text held from before.
                    out.content.push_str(&held);
                    return out;
                }
            }
        }
    }
}

/// A call the model wrote: its name and its arguments object as a JSON string, as OpenAI gives
/// them, with an id of the Python servers' shape (`call_` and 24 hex digits).
#[derive(Clone, Debug)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// `call_` and 24 random hex digits, as the Python servers' `uuid4().hex[:24]`.
fn call_id() -> String {
    let mut bytes = [0u8; 12];
    random_bytes(&mut bytes);
    format!("call_{}", hex(&bytes))
}

/// `uuid.uuid4().hex`, as the Python servers make response and item ids (`resp_...`).
pub fn uuid4_hex() -> String {
    let mut bytes = [0u8; 16];
    random_bytes(&mut bytes);
    bytes[6] = (bytes[6] & 0x0f) | 0x40; // version 4
    bytes[8] = (bytes[8] & 0x3f) | 0x80; // RFC 4122 variant
    hex(&bytes)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn random_bytes(bytes: &mut [u8]) {
    // SAFETY: getrandom writes at most `bytes.len()` bytes into the buffer it is given.
    let got = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if got != bytes.len() as isize {
        // No entropy to be had (never on Linux after boot): unique within this process still.
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let seed = (nanos ^ n.rotate_left(32)).to_le_bytes();
        let pid = std::process::id().to_le_bytes();
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = seed[i % 8] ^ pid[i % 4].rotate_left(i as u32);
        }
    }
}

/// The call a `<tool_call>` block's text holds: a JSON object with a string `name` and an
/// object `arguments` (absent: no arguments); None for anything else.
fn hermes_call(body: &str) -> Option<ToolCall> {
    let value = Json::parse(body)?;
    let Json::Object(_) = value else {
        return None;
    };
    let name = match value.get("name") {
        Some(Json::Str(name)) if !name.is_empty() => name.clone(),
        _ => return None,
    };
    let arguments = match value.get("arguments") {
        None => Json::Object(Vec::new()),
        Some(arguments @ Json::Object(_)) => arguments.clone(),
        Some(_) => return None,
    };
    Some(ToolCall {
        id: call_id(),
        name,
        arguments: arguments.dumps(),
    })
}

/// Content and the tool calls found in it, from one `feed` or `finish`.
#[derive(Default, Debug)]
pub struct Parsed {
    pub content: String,
    pub calls: Vec<ToolCall>,
}

/// `<tool_call>` blocks in a chat's content, read incrementally (`feed`, then `finish`).
#[derive(Default)]
pub struct HermesToolParser {
    in_call: bool,
    /// Whitespace after a call's `</tool_call>` goes with it.
    after_call: bool,
    held: String,
    /// Whitespace before a `<tool_call>`: dropped if the call is one.
    space: String,
}

impl HermesToolParser {
    pub fn feed(&mut self, text: &str) -> Parsed {
        self.held.push_str(text);
        self.advance(false)
    }

    pub fn finish(&mut self) -> Parsed {
        self.advance(true)
    }

    fn advance(&mut self, last: bool) -> Parsed {
        let mut out = Parsed::default();
        loop {
            let mut held = std::mem::take(&mut self.held);
            if self.in_call {
                let end = held.find(CALL_END);
                if end.is_none() && !last {
                    self.held = held;
                    return out;
                }
                let body = &held[..end.unwrap_or(held.len())];
                // A block the output ends inside is a call if its JSON is whole (the model
                // stopped before `</tool_call>`), text otherwise (max_tokens cut it).
                let call = hermes_call(body);
                self.in_call = false;
                let space = std::mem::take(&mut self.space);
                match call {
                    Some(call) => {
                        out.calls.push(call);
                        self.after_call = true;
                    }
                    None => {
                        out.content.push_str(&space);
                        out.content.push_str(CALL_START);
                        out.content.push_str(body);
                        if end.is_some() {
                            out.content.push_str(CALL_END);
                        }
                    }
                }
                match end {
                    None => return out,
                    Some(end) => {
                        self.held = held[end + CALL_END.len()..].to_string();
                        continue;
                    }
                }
            }
            if self.after_call {
                let rest = lstrip(&held);
                if rest.is_empty() && !last {
                    return out;
                }
                self.after_call = false;
                held = rest.to_string();
            }
            if let Some(start) = held.find(CALL_START) {
                let before = &held[..start];
                let text = rstrip(before);
                out.content.push_str(text);
                self.space = before[text.len()..].to_string();
                self.in_call = true;
                self.held = held[start + CALL_START.len()..].to_string();
                continue;
            }
            if last {
                out.content.push_str(&held);
                return out;
            }
            // Keep what could still be `<tool_call>`, and the whitespace before it.
            let keep = held.len() - partial_tag(&held, CALL_START);
            let keep = rstrip(&held[..keep]).len();
            out.content.push_str(&held[..keep]);
            self.held = held[keep..].to_string();
            return out;
        }
    }
}

/// A whole answer, parsed.
#[derive(Debug)]
pub struct ChatOutput {
    pub content: String,
    /// None: no reasoning (or an empty `<think></think>`).
    pub reasoning: Option<String>,
    pub calls: Vec<ToolCall>,
}

/// The parsers a request's answer goes through: reasoning first, then tool calls in what is
/// left (a call written inside `<think>` is reasoning, not a call).
pub struct OutputParser {
    pub think: Option<ThinkParser>,
    pub tools: Option<HermesToolParser>,
}

impl OutputParser {
    /// (reasoning, parsed content) for one delta of output text.
    pub fn feed(&mut self, text: &str) -> (String, Parsed) {
        let split = match &mut self.think {
            Some(think) => think.feed(text),
            None => Split {
                reasoning: String::new(),
                content: text.to_string(),
            },
        };
        self.tools(split, false)
    }

    pub fn finish(&mut self) -> (String, Parsed) {
        let split = match &mut self.think {
            Some(think) => think.finish(),
            None => Split::default(),
        };
        self.tools(split, true)
    }

    fn tools(&mut self, split: Split, last: bool) -> (String, Parsed) {
        let Some(tools) = &mut self.tools else {
            return (
                split.reasoning,
                Parsed {
                    content: split.content,
                    calls: Vec::new(),
                },
            );
        };
        let mut parsed = if split.content.is_empty() {
            Parsed::default()
        } else {
            tools.feed(&split.content)
        };
        if last {
            let rest = tools.finish();
            parsed.content.push_str(&rest.content);
            parsed.calls.extend(rest.calls);
        }
        (split.reasoning, parsed)
    }

    /// A whole answer at once: the same parsers, fed once.
    pub fn whole(&mut self, text: &str) -> ChatOutput {
        let (mut reasoning, mut parsed) = self.feed(text);
        let (last_reasoning, last) = self.finish();
        reasoning.push_str(&last_reasoning);
        parsed.content.push_str(&last.content);
        parsed.calls.extend(last.calls);
        ChatOutput {
            content: parsed.content,
            reasoning: (!reasoning.is_empty()).then_some(reasoning),
            calls: parsed.calls,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{prompt_opens_think, HermesToolParser, OutputParser, ThinkParser};

    const CALL: &str = r#"{"name": "get_weather", "arguments": {"city": "Paris"}}"#;

    fn parser(opened: bool, constrained: bool, tools: bool) -> OutputParser {
        OutputParser {
            think: Some(ThinkParser::new(opened, constrained, tools)),
            tools: tools.then(HermesToolParser::default),
        }
    }

    /// (content, reasoning, calls) of `text`, whole and cut at every place into two pieces
    /// and into single characters: the same every time.
    fn parse(
        text: &str,
        opened: bool,
        constrained: bool,
        tools: bool,
    ) -> (String, Option<String>, Vec<(String, String)>) {
        let whole = parser(opened, constrained, tools).whole(text);
        let expected = (
            whole.content,
            whole.reasoning,
            whole
                .calls
                .iter()
                .map(|c| (c.name.clone(), c.arguments.clone()))
                .collect::<Vec<_>>(),
        );
        let bounds: Vec<usize> = (0..=text.len())
            .filter(|&i| text.is_char_boundary(i))
            .collect();
        let mut cuts: Vec<Vec<usize>> = bounds.iter().map(|&i| vec![i]).collect();
        cuts.push(bounds.clone());
        for cut in cuts {
            let mut p = parser(opened, constrained, tools);
            let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), vec![]);
            let mut start = 0;
            for &end in cut.iter().chain(std::iter::once(&text.len())) {
                let (r, parsed) = p.feed(&text[start..end]);
                reasoning.push_str(&r);
                content.push_str(&parsed.content);
                calls.extend(parsed.calls.into_iter().map(|c| (c.name, c.arguments)));
                start = end;
            }
            let (r, parsed) = p.finish();
            reasoning.push_str(&r);
            content.push_str(&parsed.content);
            calls.extend(parsed.calls.into_iter().map(|c| (c.name, c.arguments)));
            let got = (content, (!reasoning.is_empty()).then_some(reasoning), calls);
            assert_eq!(got, expected, "{text:?} cut at {cut:?}");
        }
        expected
    }

    fn owned(
        content: &str,
        reasoning: Option<&str>,
        calls: &[(&str, &str)],
    ) -> (String, Option<String>, Vec<(String, String)>) {
        (
            content.into(),
            reasoning.map(Into::into),
            calls
                .iter()
                .map(|(n, a)| (n.to_string(), a.to_string()))
                .collect(),
        )
    }

    #[test]
    fn reasoning_and_content_split_as_qwen3_writes_them() {
        let cases = [
            (
                "<think>\nwhy\n\n</think>\n\nParis\n",
                false,
                false,
                "Paris\n",
                Some("why"),
            ),
            ("why</think>Paris", true, false, "Paris", Some("why")),
            ("<think>why</think>Paris", true, false, "Paris", Some("why")),
            ("<think>why", false, false, "", Some("why")),
            ("why</think>Paris", false, false, "why</think>Paris", None),
            ("<think></think>Paris", false, false, "Paris", None),
            ("{\"a\": 1}", true, true, "{\"a\": 1}", None),
            (
                "why</think>{\"a\": 1}",
                true,
                true,
                "{\"a\": 1}",
                Some("why"),
            ),
            ("\u{1c}<think>é</think>ü", false, false, "ü", Some("é")),
        ];
        for (text, opened, constrained, content, reasoning) in cases {
            assert_eq!(
                parse(text, opened, constrained, false),
                owned(content, reasoning, &[]),
                "{text:?}"
            );
        }
    }

    #[test]
    fn tool_calls_are_taken_out_of_the_content() {
        let weather = [("get_weather", r#"{"city": "Paris"}"#)];
        let text = format!("Let me check.\n<tool_call>\n{CALL}\n</tool_call>\nDone.");
        assert_eq!(
            parse(&text, false, false, true),
            owned("Let me check.Done.", None, &weather)
        );
        let inside = format!("<think>hmm\n<tool_call>{CALL}</tool_call>");
        assert_eq!(
            parse(&inside, false, false, true),
            owned("", Some("hmm"), &weather)
        );
        let broken = r#"<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>"#;
        assert_eq!(parse(broken, false, false, true), owned(broken, None, &[]));
        let unclosed = format!("<tool_call>{CALL}");
        assert_eq!(
            parse(&unclosed, false, false, true),
            owned("", None, &weather)
        );
        let bare = r#"<tool_call>{"name": "t"}</tool_call>"#;
        assert_eq!(
            parse(bare, false, false, true),
            owned("", None, &[("t", "{}")])
        );
    }

    #[test]
    fn the_template_opened_think_when_the_prompt_ends_inside_it() {
        assert!(prompt_opens_think("<|im_start|>assistant\n<think>\n"));
        assert!(!prompt_opens_think(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        ));
        assert!(!prompt_opens_think("<|im_start|>assistant\n"));
    }
}
