//! A completion or chat request driven to its answer, as the Python servers' `serving.py`
//! drives one: its samples (`n` choices of one prompt, or `best_of` of which the likeliest `n`
//! are answered) each a child request of the engine (`sampling`), the first submitted alone
//! and the rest once its first output came, so they find the prompt's blocks in the prefix
//! cache. Each sample's tokens are detokenized, cut at stop strings and read by the chat's
//! parsers; streamed, each of its outputs is a write of that choice's chunks as it comes (the
//! samples' chunks interleaved, each with its choice's index), whole, the choices are written
//! once all have finished. `echo` puts a completion's prompt text (and, with logprobs, the
//! prompt's scored tokens) before each choice's own. Usage counts every sample drawn.

use std::sync::Arc;
use std::task::Poll;
use std::time::Instant;

use hyper::body::{Bytes, Sender};
use hyper::{Body, Response, StatusCode};
use rankcast_client::wire::protocol::{EngineCoreOutput, EngineCoreRequest, TokenLogprobs};
use rankcast_client::wire::sampling::SamplingParams;
use rankcast_frontend::object;
use rankcast_frontend::output_parsers::{OutputParser, Parsed};
use rankcast_frontend::pyjson::Json;
use rankcast_text::IncrementalDetokenizer;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::engine::{Engine, Event};
use crate::logprobs::{self, Legacy};
use crate::openai::{
    chat_message, error, error_body, now, now_f64, sse, text_reply, Parsing, Prepared, Reply,
    Server,
};
use crate::sampling;

/// Why a request ended without every sample's finish reason.
enum Failure {
    ClientGone,
    Engine(String),
    Shutdown(String),
}

/// Stop strings over the growing text: what may be shown so far, and where the output ends.
struct StopStrings {
    stops: Vec<String>,
    include: bool,
    longest: usize,
}

impl StopStrings {
    /// The request's stop strings; a stop string found ends the text when its parameters
    /// say so (`include_stop_str_in_output`).
    fn new(params: &SamplingParams) -> StopStrings {
        StopStrings {
            longest: params.stop.iter().map(String::len).max().unwrap_or(0),
            include: params.include_stop_str_in_output,
            stops: params.stop.clone(),
        }
    }

    /// (byte length of text safe to show, stopped) for `text` as it stands.
    fn check(&self, text: &str) -> (usize, bool) {
        let first = self
            .stops
            .iter()
            .filter_map(|s| text.find(s.as_str()).map(|at| (at, s.len())))
            .min();
        if let Some((at, len)) = first {
            return (if self.include { at + len } else { at }, true);
        }
        // Hold back what could be the start of a stop string, on a character boundary.
        let mut safe = text.len().saturating_sub(self.longest.saturating_sub(1));
        while !text.is_char_boundary(safe) {
            safe -= 1;
        }
        (
            if self.stops.is_empty() {
                text.len()
            } else {
                safe
            },
            false,
        )
    }
}

/// What every chunk of one response repeats, and the shapes of its chunks.
struct Generation {
    request_id: String,
    prompt_tokens: usize,
    object: &'static str,
    chat: bool,
    model: String,
    created: u64,
}

impl Generation {
    /// A completion's chunk: choice `index`'s text, its logprobs and, at its end, its finish.
    fn text_chunk(&self, index: usize, text: String, finish: Option<&str>, logprobs: Json) -> Json {
        let choice = object![
            ("index", index),
            ("text", text),
            ("logprobs", logprobs),
            ("finish_reason", finish),
        ];
        self.with_choices(vec![choice])
    }

    fn chat_chunk(&self, index: usize, delta: Json, finish: Option<&str>, logprobs: Json) -> Json {
        let choice = object![
            ("index", index),
            ("delta", delta),
            ("logprobs", logprobs),
            ("finish_reason", finish),
        ];
        self.with_choices(vec![choice])
    }

    /// The fields every chunk of a response repeats, then `choices`.
    fn with_choices(&self, choices: Vec<Json>) -> Json {
        object![
            ("id", self.request_id.as_str()),
            ("object", self.object),
            ("created", self.created),
            ("model", self.model.as_str()),
            ("choices", choices),
        ]
    }

    /// The chunk a cut stream ends with: every choice's finish reason "abort".
    fn cut_chunk(&self, choices: usize) -> Json {
        let cut = (0..choices)
            .map(|index| {
                let (key, empty) = if self.chat {
                    ("delta", object![])
                } else {
                    ("text", Json::from(""))
                };
                object![
                    ("index", index),
                    (key, empty),
                    ("logprobs", Json::Null),
                    ("finish_reason", "abort"),
                ]
            })
            .collect();
        self.with_choices(cut)
    }

    /// The usage chunk that ends a stream when the request asked for it.
    fn usage_chunk(&self, completion: usize) -> Json {
        let Json::Object(mut fields) = self.with_choices(Vec::new()) else {
            unreachable!("a chunk is an object")
        };
        fields.push(("usage".into(), self.usage(completion)));
        Json::Object(fields)
    }

    fn usage(&self, completion: usize) -> Json {
        object![
            ("prompt_tokens", self.prompt_tokens),
            ("completion_tokens", completion),
            ("total_tokens", self.prompt_tokens + completion),
        ]
    }

    /// One output's text through choice `index`'s parsers, as the Python servers stream it:
    /// its reasoning, its content and each tool call in chunks of their own (clients read one
    /// kind per delta), a call as OpenAI streams one (its index, id and name, then its
    /// arguments), the output's logprobs on the first chunk (on an empty delta when all of its
    /// text is held back). `finished`: the parsers give what they held.
    fn parsed_chunks(
        &self,
        index: usize,
        parser: &mut OutputParser,
        text: &str,
        finished: bool,
        logprobs: Json,
        calls_sent: &mut usize,
    ) -> Vec<Json> {
        let (mut reasoning, mut parsed) = if text.is_empty() {
            (String::new(), Parsed::default())
        } else {
            parser.feed(text)
        };
        if finished {
            let (last_reasoning, last) = parser.finish();
            reasoning.push_str(&last_reasoning);
            parsed.content.push_str(&last.content);
            parsed.calls.extend(last.calls);
        }
        let mut deltas = Vec::new();
        if !reasoning.is_empty() {
            deltas.push(object![
                ("reasoning", reasoning.as_str()),
                ("reasoning_content", reasoning.as_str()),
            ]);
        }
        if !parsed.content.is_empty() {
            deltas.push(object![("content", parsed.content)]);
        }
        for call in parsed.calls {
            let position = *calls_sent;
            *calls_sent += 1;
            let named = object![("name", call.name), ("arguments", "")];
            let head = object![
                ("index", position),
                ("id", call.id),
                ("type", "function"),
                ("function", named),
            ];
            deltas.push(object![("tool_calls", vec![head])]);
            let arguments = object![
                ("index", position),
                ("function", object![("arguments", call.arguments)]),
            ];
            deltas.push(object![("tool_calls", vec![arguments])]);
        }
        if !logprobs.is_null() && deltas.is_empty() {
            deltas.push(object![]); // the tokens' logprobs, their text held back for now
        }
        let mut logprobs = Some(logprobs);
        deltas
            .into_iter()
            .map(|delta| {
                let logprobs = logprobs.take().unwrap_or(Json::Null);
                self.chat_chunk(index, delta, None, logprobs)
            })
            .collect()
    }
}

/// One sample's progress: its text as shown so far, its tokens and logprobs, its parsers.
struct Sample<'a> {
    index: usize,
    request_id: String,
    /// When it was submitted: its time to first token and end-to-end latency start here.
    arrival: Instant,
    last_token_at: Option<Instant>,
    detokenizer: IncrementalDetokenizer<'a>,
    text: String,
    /// How much of `text` has been streamed (bytes).
    shown: usize,
    tokens: usize,
    logprobs: Vec<TokenLogprobs>,
    /// Where the next streamed token's text starts in the choice's text (characters).
    offset: usize,
    /// A streamed chat's parsers (a whole answer is parsed once it is complete).
    parser: Option<OutputParser>,
    calls_sent: usize,
    /// A streamed completion's echoed prompt is still to lead the choice's first chunk.
    echo_pending: bool,
    /// The prompt's scores, as the engine sent them with the sample's first output.
    prompt_logprobs: Option<Vec<TokenLogprobs>>,
    /// Its finish reason, once it has one.
    finished: Option<String>,
}

/// What every sample of one request reads: the request, its shape, the echoed prompt and,
/// once rendered, the prompt's scored tokens (the first sample's, the same for every choice).
struct Shared<'a> {
    server: &'a Server,
    generation: &'a Generation,
    prepared: &'a Prepared,
    stop: StopStrings,
    /// The prompt's text a completion's choices start with (empty: none).
    echo: String,
    echo_scores: Option<Legacy>,
}

impl<'a> Shared<'a> {
    fn new(server: &'a Server, generation: &'a Generation, prepared: &'a Prepared) -> Self {
        let echo = match (&prepared.prompt_text, prepared.samples.echo) {
            (_, false) => String::new(),
            (Some(text), true) => text.clone(),
            (None, true) => server.tokenizer.decode(&prepared.prompt_ids, false),
        };
        Shared {
            server,
            generation,
            prepared,
            stop: StopStrings::new(&prepared.params),
            echo,
            echo_scores: None,
        }
    }

    /// The echoed prompt's positions, rendered from the first output that needs them (the
    /// first sample's first, which carries the scores) and kept for every other choice.
    fn echo_scores(&mut self, scored: Option<&[TokenLogprobs]>, top: usize) -> Legacy {
        let Shared {
            server,
            prepared,
            echo_scores,
            ..
        } = self;
        echo_scores
            .get_or_insert_with(|| {
                logprobs::echoed(&server.tokenizer, &prepared.prompt_ids, scored, top)
            })
            .clone()
    }
}

impl<'a> Sample<'a> {
    fn new(shared: &Shared<'a>, index: usize, streamed: bool) -> Sample<'a> {
        let prepared = shared.prepared;
        let drawn = prepared.samples.drawn;
        Sample {
            index,
            request_id: sampling::child_id(&shared.generation.request_id, index, drawn),
            arrival: Instant::now(),
            last_token_at: None,
            detokenizer: IncrementalDetokenizer::new(
                &shared.server.tokenizer,
                prepared.skip_special,
            ),
            text: String::new(),
            shown: 0,
            tokens: 0,
            logprobs: Vec::new(),
            offset: 0,
            parser: if streamed {
                prepared.parsing.map(Parsing::parser)
            } else {
                None
            },
            calls_sent: 0,
            echo_pending: streamed && !shared.echo.is_empty(),
            prompt_logprobs: None,
            finished: None,
        }
    }

    /// Take one engine output; streamed, returns the chunks it makes.
    fn advance(
        &mut self,
        shared: &mut Shared,
        output: &mut EngineCoreOutput,
        streamed: bool,
    ) -> Vec<Json> {
        let server = shared.server;
        for &id in &output.new_token_ids {
            self.tokens += 1;
            self.text.push_str(&self.detokenizer.push(id as u32));
        }
        self.last_token_at = server.record_timing(self.arrival, output, self.last_token_at);
        if let Some(scored) = output.prompt_logprobs.take() {
            self.prompt_logprobs = Some(scored);
        }
        let start = self.logprobs.len();
        self.logprobs
            .extend(output.new_logprobs.take().unwrap_or_default());
        let mut finish = output.finish_reason.clone();
        if finish.is_some() {
            self.text.push_str(&self.detokenizer.finish());
        }
        let (safe, stopped) = shared.stop.check(&self.text);
        if stopped {
            self.text.truncate(safe);
            if finish.is_none() {
                server.engine.abort(&self.request_id);
            }
            finish = Some("stop".into());
        }
        let visible = if finish.is_some() {
            self.text.len()
        } else {
            safe
        };
        let chunks = if streamed {
            let piece = self.text[self.shown..visible].to_string();
            self.shown = visible;
            if shared.generation.chat {
                self.chat_chunks(shared, piece, start, finish.as_deref())
            } else {
                self.text_chunks(shared, piece, start, finish.as_deref())
            }
        } else {
            Vec::new()
        };
        self.finished = finish;
        chunks
    }

    /// A chat output's chunks: its text (through the parsers, if any) with its tokens'
    /// logprobs, and at the end a chunk of the finish reason alone (`tool_calls` when the
    /// model's calls were sent).
    fn chat_chunks(
        &mut self,
        shared: &Shared,
        piece: String,
        start: usize,
        finish: Option<&str>,
    ) -> Vec<Json> {
        let generation = shared.generation;
        let tokenizer = &shared.server.tokenizer;
        let logprobs = match shared.prepared.top_logprobs {
            Some(top) if self.logprobs.len() > start => {
                logprobs::chat(tokenizer, &self.logprobs[start..], top)
            }
            _ => Json::Null,
        };
        let index = self.index;
        let mut chunks = match self.parser.as_mut() {
            Some(parser) => generation.parsed_chunks(
                index,
                parser,
                &piece,
                finish.is_some(),
                logprobs,
                &mut self.calls_sent,
            ),
            None if !piece.is_empty() || !logprobs.is_null() => {
                let delta = object![("content", piece)];
                vec![generation.chat_chunk(index, delta, None, logprobs)]
            }
            None => Vec::new(),
        };
        if let Some(reason) = finish {
            let reason = if self.calls_sent > 0 {
                "tool_calls"
            } else {
                reason
            };
            chunks.push(generation.chat_chunk(index, object![], Some(reason), Json::Null));
        }
        chunks
    }

    /// A completion output's chunk, when it has text, logprobs or the finish reason: the
    /// echoed prompt (and its scored tokens) before the choice's first text.
    fn text_chunks(
        &mut self,
        shared: &mut Shared,
        piece: String,
        start: usize,
        finish: Option<&str>,
    ) -> Vec<Json> {
        let mut rendered = None;
        if let Some(top) = shared.prepared.top_logprobs {
            if self.echo_pending {
                rendered = Some(shared.echo_scores(self.prompt_logprobs.as_deref(), top));
            }
            if self.logprobs.len() > start {
                let legacy = rendered.get_or_insert_with(|| Legacy::starting_at(self.offset));
                for item in &self.logprobs[start..] {
                    legacy.push(&shared.server.tokenizer, item, top);
                }
            }
        }
        if let Some(legacy) = &rendered {
            self.offset = legacy.end;
        }
        if piece.is_empty() && rendered.is_none() && finish.is_none() {
            return Vec::new();
        }
        let text = if std::mem::take(&mut self.echo_pending) {
            format!("{}{piece}", shared.echo)
        } else {
            piece
        };
        let logprobs = rendered.map_or(Json::Null, Legacy::json);
        vec![shared
            .generation
            .text_chunk(self.index, text, finish, logprobs)]
    }
}

/// The next output (or the engine's death) of any sample, with the sample's index; None once
/// every sample's receiver has closed.
async fn next_event(receivers: &mut [UnboundedReceiver<Event>]) -> Option<(usize, Event)> {
    std::future::poll_fn(|context| {
        let mut open = false;
        for (index, receiver) in receivers.iter_mut().enumerate() {
            match receiver.poll_recv(context) {
                Poll::Ready(Some(event)) => return Poll::Ready(Some((index, event))),
                Poll::Ready(None) => {}
                Poll::Pending => open = true,
            }
        }
        if open {
            Poll::Pending
        } else {
            Poll::Ready(None)
        }
    })
    .await
}

/// The engine requests of one HTTP request still running: whatever is left when the request
/// ends early (an error, a client gone, a stopping server) is aborted.
struct Running {
    engine: Engine,
    ids: Vec<String>,
}

impl Running {
    fn finished(&mut self, id: &str) {
        self.ids.retain(|running| running != id);
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        for id in &self.ids {
            self.engine.abort(id);
        }
    }
}

impl Server {
    /// The sampling parameters every sample starts from: logprobs for `best_of`'s ranking
    /// whether or not the client asked for them, and the prompt scored for an echo with
    /// logprobs (by the first sample only: `sampling::child_params`).
    fn drawn_params(prepared: &Prepared) -> SamplingParams {
        let mut params = prepared.params.clone();
        if prepared.samples.ranked() {
            params.logprobs = Some(params.logprobs.unwrap_or(0));
        }
        if let (true, Some(top)) = (prepared.samples.echo, prepared.top_logprobs) {
            params.prompt_logprobs = Some(top as i64);
        }
        params
    }

    /// Time to first token and inter-token latency, as the Python servers count them: tokens
    /// that arrive together share the gap since the previous ones (after the first token, the
    /// rest of its batch count 0). Returns when the latest token arrived.
    fn record_timing(
        &self,
        arrival: Instant,
        output: &EngineCoreOutput,
        last: Option<Instant>,
    ) -> Option<Instant> {
        let new = output.new_token_ids.len() as u32;
        if new == 0 {
            return last;
        }
        let now = Instant::now();
        let requests = &self.metrics.requests;
        match last {
            None => {
                requests.record_first_token((now - arrival).as_secs_f64());
                if new > 1 {
                    requests.record_inter_token(0.0, new - 1);
                }
            }
            Some(last) => {
                let gap = (now - last).as_secs_f64() / f64::from(new);
                requests.record_inter_token(gap, new);
            }
        }
        Some(now)
    }

    /// Submit one sample of the request; its outputs arrive on the receiver returned.
    fn submit(
        &self,
        prepared: &Prepared,
        params: &SamplingParams,
        sample: &Sample,
    ) -> UnboundedReceiver<Event> {
        let request = EngineCoreRequest {
            request_id: sample.request_id.clone(),
            prompt_token_ids: prepared.prompt_ids.iter().map(|&t| i64::from(t)).collect(),
            sampling_params: sampling::child_params(params, sample.index),
            arrival_time: now_f64(),
            client_index: self.client_index,
            lora_name: prepared.lora_name.clone(),
            // One engine core behind a Rust API server: no choice was made.
            routing_reason: String::new(),
            routing_expected_prefix_tokens: 0,
        };
        self.engine.generate(request)
    }

    /// Drive every sample to its finish reason, in index order. With `sender`, each output's
    /// chunks are streamed as they come (a chat's opening chunks first, one per choice).
    async fn drive<'a>(
        &'a self,
        shared: &mut Shared<'a>,
        mut sender: Option<&mut Sender>,
    ) -> Result<Vec<Sample<'a>>, Failure> {
        let prepared = shared.prepared;
        let generation = shared.generation;
        let drawn = prepared.samples.drawn;
        let streamed = sender.is_some();
        if let (Some(sender), true) = (sender.as_deref_mut(), generation.chat) {
            let opening = (0..drawn)
                .map(|index| {
                    let delta = object![("role", "assistant"), ("content", "")];
                    sse(&generation.chat_chunk(index, delta, None, Json::Null))
                })
                .collect::<Vec<Bytes>>()
                .concat();
            if sender.send_data(opening.into()).await.is_err() {
                return Err(Failure::ClientGone);
            }
        }
        let params = Server::drawn_params(prepared);
        let mut samples: Vec<Sample<'a>> = (0..drawn)
            .map(|index| Sample::new(shared, index, streamed))
            .collect();
        // The first sample goes alone; the others once its first output came, when the
        // prompt's full blocks are in the prefix cache.
        let mut receivers = vec![self.submit(prepared, &params, &samples[0])];
        let mut running = Running {
            engine: self.engine.clone(),
            ids: vec![samples[0].request_id.clone()],
        };
        let mut cut = self.drain.cut_signal();
        let mut left = drawn;
        while left > 0 {
            let event = tokio::select! {
                event = next_event(&mut receivers) => event,
                _ = cut.changed() => return Err(Failure::Shutdown(self.drain.message())),
            };
            let Some((index, event)) = event else {
                return Err(Failure::Engine("the engine core stopped answering".into()));
            };
            let mut output = match event {
                Event::Output(output) => output,
                Event::EngineDead(why) => return Err(Failure::Engine(why)),
            };
            if samples[index].finished.is_some() {
                continue; // outputs that came after a stop string ended it
            }
            if let Some(error) = &output.error {
                return Err(Failure::Engine(error.clone()));
            }
            if receivers.len() < drawn {
                for sample in &samples[1..] {
                    receivers.push(self.submit(prepared, &params, sample));
                    running.ids.push(sample.request_id.clone());
                }
            }
            let sample = &mut samples[index];
            let chunks = sample.advance(shared, &mut output, streamed);
            if let (Some(sender), false) = (sender.as_deref_mut(), chunks.is_empty()) {
                let write: Vec<Bytes> = chunks.iter().map(sse).collect();
                if sender.send_data(write.concat().into()).await.is_err() {
                    return Err(Failure::ClientGone);
                }
            }
            if let Some(reason) = &sample.finished {
                running.finished(&sample.request_id);
                left -= 1;
                self.metrics.requests.record_finished(
                    self.engine_index,
                    sample.arrival.elapsed().as_secs_f64(),
                    prepared.prompt_ids.len(),
                    sample.tokens,
                    reason,
                );
            }
        }
        Ok(samples)
    }

    /// Answer a completion (`chat` false) or chat request checked by `prepare`: streamed as
    /// server-sent events, or whole.
    pub(crate) async fn run(self: Arc<Self>, prepared: Prepared, chat: bool) -> Reply {
        let in_flight = self.drain.enter();
        let generation = Generation {
            request_id: self.request_id(chat),
            prompt_tokens: prepared.prompt_ids.len(),
            object: if chat {
                "chat.completion.chunk"
            } else {
                "text_completion"
            },
            chat,
            model: prepared.model.clone(),
            created: now(),
        };
        if prepared.stream {
            let (sender, body) = Body::channel();
            tokio::spawn(self.clone().stream(generation, prepared, sender, in_flight));
            return Response::builder()
                .header("content-type", "text/event-stream")
                .header("cache-control", "no-cache")
                .body(body)
                .expect("a response");
        }
        let mut shared = Shared::new(&self, &generation, &prepared);
        let samples = match self.drive(&mut shared, None).await {
            Ok(samples) => samples,
            Err(Failure::Engine(why) | Failure::Shutdown(why)) => {
                return error(StatusCode::SERVICE_UNAVAILABLE, &why, None)
            }
            Err(Failure::ClientGone) => return error(StatusCode::BAD_REQUEST, "client gone", None),
        };
        drop(in_flight);
        let body = self.whole(&mut shared, samples);
        text_reply(StatusCode::OK, body.response())
    }

    /// A whole answer: a choice per sample answered (the likeliest, for `best_of`), usage of
    /// every sample drawn.
    fn whole(&self, shared: &mut Shared, samples: Vec<Sample>) -> Json {
        let generation = shared.generation;
        let prepared = shared.prepared;
        let generated: usize = samples.iter().map(|sample| sample.tokens).sum();
        let order: Vec<usize> = if prepared.samples.ranked() {
            let logprobs = samples.iter().map(|sample| sample.logprobs.as_slice());
            sampling::likeliest(logprobs, prepared.samples.n)
        } else {
            (0..samples.len()).collect()
        };
        // An echo's scored prompt is the first sample's (it alone scores it).
        let scored = samples[0].prompt_logprobs.clone();
        let mut taken: Vec<Option<Sample>> = samples.into_iter().map(Some).collect();
        let choices: Vec<Json> = order
            .into_iter()
            .enumerate()
            .map(|(index, drawn)| {
                let sample = taken[drawn].take().expect("each sample answered once");
                let finish = sample.finished.unwrap_or_default();
                if generation.chat {
                    let parser = prepared.parsing.map(Parsing::parser);
                    let (message, finish) =
                        chat_message(sample.text, finish, parser, prepared.reasoning_fields);
                    let logprobs = match prepared.top_logprobs {
                        Some(top) => logprobs::chat(&self.tokenizer, &sample.logprobs, top),
                        None => Json::Null,
                    };
                    return object![
                        ("index", index),
                        ("message", message),
                        ("logprobs", logprobs),
                        ("finish_reason", finish),
                    ];
                }
                let logprobs = match prepared.top_logprobs {
                    Some(top) => {
                        let mut legacy = if shared.echo.is_empty() {
                            Legacy::starting_at(0)
                        } else {
                            shared.echo_scores(scored.as_deref(), top)
                        };
                        for item in &sample.logprobs {
                            legacy.push(&self.tokenizer, item, top);
                        }
                        legacy.json()
                    }
                    None => Json::Null,
                };
                object![
                    ("index", index),
                    ("text", format!("{}{}", shared.echo, sample.text)),
                    ("logprobs", logprobs),
                    ("finish_reason", finish),
                ]
            })
            .collect();
        let object = if generation.chat {
            "chat.completion"
        } else {
            "text_completion"
        };
        object![
            ("id", generation.request_id.as_str()),
            ("object", object),
            ("created", generation.created),
            ("model", generation.model.as_str()),
            ("choices", choices),
            ("usage", generation.usage(generated)),
        ]
    }

    /// A streamed answer: every sample's chunks as they come, then the usage chunk when asked
    /// for and `[DONE]`; a stream cut short (the engine gone, the server stopping) ends with
    /// every choice's finish reason "abort" and the error, as the Python servers end one.
    async fn stream(
        self: Arc<Self>,
        generation: Generation,
        prepared: Prepared,
        mut sender: Sender,
        _in_flight: crate::drain::InFlight,
    ) {
        let mut shared = Shared::new(&self, &generation, &prepared);
        let tail = match self.drive(&mut shared, Some(&mut sender)).await {
            Ok(samples) if prepared.include_usage => {
                let generated = samples.iter().map(|sample| sample.tokens).sum();
                vec![sse(&generation.usage_chunk(generated))]
            }
            Ok(_) => Vec::new(),
            Err(Failure::ClientGone) => return,
            Err(Failure::Engine(why) | Failure::Shutdown(why)) => {
                let body = error_body(StatusCode::SERVICE_UNAVAILABLE, &why, None);
                let cut = generation.cut_chunk(prepared.samples.drawn);
                vec![sse(&cut), sse(&body)]
            }
        };
        for piece in tail {
            if sender.send_data(piece).await.is_err() {
                return;
            }
        }
        let _ = sender
            .send_data(Bytes::from_static(b"data: [DONE]\n\n"))
            .await;
    }
}
