"""The `rankcast` command: `serve` (HTTP API) and `chat` (one answer from the offline engine).

Every flag is one `Flag` in `FLAGS`: its name, the option it sets and its help. Its default and
its type come from that option's dataclass field (`EngineConfig`'s sections, `ServeConfig`,
`ChatArgs`), so a default is written in one place only. The argparse parsers, the keyword
arguments handed to `EngineConfig.from_kwargs` and the flag table of docs/flags.md
(`--markdown-flags`) are all generated from `FLAGS`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rankcast.config import (
    DEFAULT_KV_CACHE_SPACE_GIB,
    DTYPES,
    EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    RAY_PLACEMENTS,
    REASONING_PARSERS,
    ROUTING_POLICIES,
    TOOL_CALL_PARSERS,
    ConfigError,
    EngineConfig,
    KVEventsConfig,
    ServeConfig,
    SpeculativeConfig,
)
from rankcast.errors import ModelFormatError
from rankcast.logger import init_logging
from rankcast.process import TeardownSkip

Target = Literal["engine", "serve", "chat"]
Command = Literal["serve", "chat"]

# Which commands a flag belongs to when its entry does not say.
_COMMANDS_OF: dict[Target, tuple[Command, ...]] = {
    "engine": ("serve", "chat"),
    "serve": ("serve",),
    "chat": ("chat",),
}


@dataclass(frozen=True)
class ChatArgs:
    """What `rankcast chat` asks the engine: one message and how to sample the answer."""

    message: str
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int | None = None


def _lora_modules(specs: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """`NAME=PATH` specs as the (name, path) pairs `LoRAConfig.lora_modules` holds."""
    modules = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora-modules takes NAME=PATH, got {spec!r}")
        modules.append((name, path))
    return tuple(modules)


@dataclass(frozen=True)
class Flag:
    """One command-line flag.

    `field` names the option it sets in `target`: an `EngineConfig.from_kwargs` keyword, a
    `ServeConfig` field or a `ChatArgs` field. The default and the kind of value (a number, a
    switch with a `--no-` form, a list) are that field's. Help for a flag whose default is None
    says what unset means, in the form "(unset: ...)".
    """

    name: str
    field: str
    help: str
    target: Target = "engine"
    # The commands that take it; empty: those of its target.
    only: tuple[Command, ...] = ()
    # The commands in which it is positional (`rankcast serve MODEL`).
    positional_in: tuple[Command, ...] = ()
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    # Turns what argparse parsed into the option's value; lists become tuples without it.
    parse: Callable[[Any], Any] | None = None

    @property
    def commands(self) -> tuple[Command, ...]:
        return self.only or _COMMANDS_OF[self.target]


FLAGS: tuple[Flag, ...] = (
    # `rankcast serve` around the engines.
    Flag("--host", "host", "address the API servers listen on", target="serve"),
    Flag("--port", "port", "port the API servers share (SO_REUSEPORT)", target="serve"),
    Flag(
        "--api-server-count",
        "api_server_count",
        "Python API server processes behind the port, each with its own engine connection "
        "(0: Rust API servers alone)",
        target="serve",
    ),
    Flag(
        "--rust-api-server-count",
        "rust_api_server_count",
        "Rust API servers (rust/frontend) beside the Python ones, or alone, behind the same "
        "port; one engine core only (no data parallelism)",
        target="serve",
    ),
    Flag("--api-key", "api_key", "bearer token /v1 requires (unset: none)", target="serve"),
    Flag(
        "--routing-policy",
        "routing_policy",
        "how API servers pick a data-parallel engine for a request: by load, by cached prefix, "
        "by adapter residency, or all three (auto); docs/routers.md",
        target="serve",
        choices=ROUTING_POLICIES,
    ),
    Flag(
        "--allow-runtime-lora-updating",
        "allow_runtime_lora_updating",
        "enable /v1/load_lora_adapter, /v1/unload_lora_adapter and /v1/(un)pin_lora_adapter",
        target="serve",
    ),
    Flag(
        "--shutdown-timeout",
        "shutdown_timeout",
        "on SIGTERM/SIGINT, seconds requests in flight get to finish (new ones get 503 at once); "
        "then the rest end with an error",
        metavar="SECONDS",
        target="serve",
    ),
    Flag(
        "--reasoning-parser",
        "reasoning_parser",
        "chat answers give the model's reasoning as reasoning_content (and reasoning; streamed "
        "as delta.reasoning_content), the rest as content; qwen3: the text between `<think>` "
        "(written by the model, or left open by the chat template) and `</think>` (unset: all "
        "text is content)",
        target="serve",
        choices=REASONING_PARSERS,
    ),
    Flag(
        "--enable-auto-tool-choice",
        "enable_auto_tool_choice",
        "serve tool_choice auto (the default with tools): tool calls the model writes itself "
        "become tool_calls, read as --tool-call-parser says",
        target="serve",
    ),
    Flag(
        "--tool-call-parser",
        "tool_call_parser",
        "the format the model writes tool calls in, for --enable-auto-tool-choice; hermes: "
        '`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3, Hermes) '
        "(unset: none)",
        target="serve",
        choices=TOOL_CALL_PARSERS,
    ),
    # `rankcast chat`'s question and sampling.
    Flag("message", "message", "the user message to answer", target="chat"),
    Flag("--max-tokens", "max_tokens", "tokens to generate at most", target="chat"),
    Flag("--temperature", "temperature", "sampling temperature; 0 is greedy", target="chat"),
    Flag("--seed", "seed", "sampling seed, for reproducible draws (unset: none)", target="chat"),
    # The engine: model, batching, KV cache.
    Flag(
        "--model",
        "model",
        "GGUF file or HF directory (unset: the embedded SmolLM2-135M-Instruct)",
        positional_in=("serve",),
        metavar="MODEL",
    ),
    Flag(
        "--served-model-name",
        "served_model_name",
        "the model name /v1/models lists and requests use (unset: the model's own name)",
        only=("serve",),
    ),
    Flag(
        "--dtype",
        "dtype",
        "weight and activation precision; auto: bfloat16 where the CPU computes it natively, "
        "float32 elsewhere",
        choices=DTYPES,
    ),
    Flag(
        "--quantization",
        "quantization",
        "int8: linear weights stored as int8 with a scale per output channel (half of "
        "bfloat16's bytes per token); w8a8: activations quantized per token as well; q4_1: "
        "4-bit groups of 32 as llama.cpp's Q4_1 (the embedded model's own format); q4_0, q8_0: "
        "llama.cpp's Q4_0 and Q8_0; auto: "
        "a GGUF file's own format where rankcast multiplies it, 8-bit groups for other "
        "quantized files such as K-quant mixes (docs/quantization.md)",
        choices=QUANTIZATIONS,
    ),
    Flag(
        "--max-model-len",
        "max_model_len",
        "longest prompt plus output in tokens (unset: the model's context, capped by what the "
        "KV cache holds)",
    ),
    Flag("--max-num-seqs", "max_num_seqs", "requests that decode together in one step, at most"),
    Flag(
        "--max-num-batched-tokens",
        "max_num_batched_tokens",
        "tokens one step computes: running decodes, then prompt tokens",
    ),
    Flag(
        "--enable-chunked-prefill",
        "enable_chunked_prefill",
        "split prompts longer than what is left of a step's budget across steps",
    ),
    Flag(
        "--enable-prefix-caching",
        "enable_prefix_caching",
        "reuse the KV of prompt prefixes earlier requests computed",
    ),
    Flag(
        "--kv-events",
        "kv_events",
        "publish KV-cache block stored/removed/cleared events (notification channel)",
    ),
    Flag(
        "--kv-events-config",
        "kv_events_config",
        "KV-cache events in vLLM's wire format, as vLLM takes them: a JSON object with "
        "enable_kv_cache_events, publisher, endpoint, replay_endpoint, topic, buffer_steps, hwm; "
        "data-parallel engine i uses port + i (unset: none)",
        metavar="JSON",
        parse=KVEventsConfig.from_json,
    ),
    Flag(
        "--speculative-config",
        "speculative_config",
        "speculative decoding, as vLLM takes it: a JSON object with method (ngram: drafts from "
        "the request's own prompt and output; suffix: also from recent requests' outputs), "
        "num_speculative_tokens, prompt_lookup_min/max (ngram), suffix_decoding_max_tree_depth, "
        "suffix_decoding_max_cached_requests, suffix_decoding_max_spec_factor, "
        "suffix_decoding_min_token_prob (suffix); greedy output is unchanged, and a measured "
        "cost model drafts only where the wider step pays (unset: off)",
        metavar="JSON",
        parse=SpeculativeConfig.from_json,
    ),
    Flag("--block-size", "block_size", "tokens per KV cache block: 8..128, a power of 2"),
    Flag(
        "--kv-cache-dtype",
        "kv_cache_dtype",
        "what the KV cache holds: auto (the activations' dtype), or int8, fp8 (= fp8_e4m3), "
        "fp8_e5m2: one byte a value with a float32 scale per token and head, about half the "
        "memory and the reads of a bfloat16 cache",
        choices=KV_CACHE_DTYPES,
    ),
    Flag(
        "--kv-cache-space",
        "kv_cache_space_gib",
        "KV cache budget in GiB (unset: RANKCAST_KV_CACHE_SPACE, else "
        f"{DEFAULT_KV_CACHE_SPACE_GIB:g})",
        metavar="GIB",
    ),
    Flag(
        "--num-gpu-blocks-override",
        "num_blocks",
        "exact number of KV cache blocks, overriding the budget (unset: from the budget)",
    ),
    # The engine: ranks and executors.
    Flag("--tensor-parallel-size", "tensor_parallel_size", "ranks each layer is split across"),
    Flag("--pipeline-parallel-size", "pipeline_parallel_size", "stages the layers are split into"),
    Flag(
        "--enable-expert-parallel",
        "enable_expert_parallel",
        "mixtures of experts: each tensor-parallel rank holds whole experts (a contiguous share), "
        "not a slice of every expert",
    ),
    Flag(
        "--data-parallel-size",
        "data_parallel_size",
        "engine cores, each with its own ranks; API servers balance requests between them",
    ),
    Flag(
        "--distributed-executor-backend",
        "distributed_executor_backend",
        "uni: one rank in the engine process; mp: a process per rank; ray: ranks as Ray actors "
        "(pip install 'rankcast[ray]') (unset: uni for one rank, mp for several)",
        choices=EXECUTOR_BACKENDS,
    ),
    Flag(
        "--ray-placement",
        "ray_placement",
        "ray executor: one placement-group bundle (1 CPU) per pipeline stage; pack: on as few "
        "nodes as fit, spread: over nodes where possible, strict-spread: each stage on a node of "
        "its own (the engine waits until there are enough)",
        choices=RAY_PLACEMENTS,
    ),
    Flag(
        "--worker-extension-cls",
        "worker_extension_cls",
        "module:Class mixed into every worker; its methods run on every rank "
        "(POST /collective_rpc, LLM.collective_rpc) and may publish notifications (unset: none)",
    ),
    # The engine: the notification channel.
    Flag(
        "--worker-notification-poll-interval",
        "worker_notification_poll_interval",
        "also gather worker notifications every N seconds (unset: "
        "RANKCAST_WORKER_NOTIFICATION_POLL_INTERVAL, else no poll: the doorbell suffices)",
        metavar="SECONDS",
    ),
    Flag(
        "--worker-notification-doorbell",
        "worker_notification_doorbell",
        "an idle engine gathers when a rank rings its doorbell (a busy one gets events with "
        "each step); --no-worker-notification-doorbell leaves idle-time events to the poll "
        "(for measuring the two)",
    ),
    Flag(
        "--worker-notification-buffer-size",
        "worker_notification_buffer_size",
        "notifications each worker holds before dropping the oldest",
    ),
    Flag(
        "--engine-notification-buffer-size",
        "engine_notification_buffer_size",
        "gathered notifications the engine core holds before dropping the oldest",
    ),
    Flag(
        "--notification-events-endpoint",
        "notification_events_endpoint",
        "ZMQ PUB endpoint for the notification stream, e.g. tcp://*:5557; data-parallel engine "
        "i uses port + i (unset: no stream)",
    ),
    Flag(
        "--notification-events-replay-endpoint",
        "notification_events_replay_endpoint",
        "ZMQ ROUTER endpoint answering replay (8-byte start seq) and snapshot requests "
        "(unset: no replay)",
    ),
    # The engine: LoRA adapters.
    Flag("--enable-lora", "enable_lora", "serve LoRA adapters"),
    Flag("--max-loras", "max_loras", "adapter slots per rank"),
    Flag(
        "--max-cpu-loras",
        "max_cpu_loras",
        "adapters kept in each rank's host tier, >= --max-loras (unset: --max-loras)",
    ),
    Flag("--max-lora-rank", "max_lora_rank", "largest adapter rank served"),
    Flag(
        "--lora-turn-steps",
        "lora_turn_steps",
        "steps an adapter keeps its slot while a paused adapter waits (a new request waits "
        "for none: the holder pauses at once); then its requests pause, KV kept, until their "
        "turn (0: a slot is kept until its requests finish)",
    ),
    Flag(
        "--lora-modules",
        "lora_modules",
        "PEFT adapters every engine core loads at start (each keeps the first listed it has "
        "room for; with data parallel, its round-robin share first)",
        metavar="NAME=PATH",
        parse=_lora_modules,
    ),
    Flag(
        "--allowed-lora-paths",
        "allowed_lora_paths",
        "adapters load only from under these directories (unset: anywhere)",
        metavar="DIR",
    ),
)


@dataclass(frozen=True)
class _Option:
    """What a flag's field declares: where it lives (for docs/flags.md), its default, its type."""

    owner: str
    default: Any
    hint: Any


def _dataclass_options(cls: type[Any], owner: str) -> dict[str, _Option]:
    """The fields of `cls` a caller may set (settled fields, `init=False`, are not options)."""
    hints = typing.get_type_hints(cls)
    options = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        factory = f.default_factory
        default = f.default if factory is dataclasses.MISSING else factory()
        options[f.name] = _Option(owner, default, hints[f.name])
    return options


@functools.cache
def _options() -> dict[Target, dict[str, _Option]]:
    """Every option a flag may set, by target; computed once, on the first parser built."""
    engine: dict[str, _Option] = {}
    for section, owner in EngineConfig.sections().items():
        engine.update(_dataclass_options(owner, section))
    return {
        "engine": engine,
        "serve": _dataclass_options(ServeConfig, "ServeConfig"),
        "chat": _dataclass_options(ChatArgs, "ChatArgs"),
    }


def option_of(flag: Flag) -> _Option:
    """The field `flag` sets; a flag naming no field is a bug in `FLAGS`."""
    try:
        return _options()[flag.target][flag.field]
    except KeyError:
        raise LookupError(f"{flag.name} sets {flag.field!r}, which {flag.target} lacks") from None


def _value_type(hint: Any) -> Any:
    """The type a field holds when it is set: `int | None` -> int."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = (arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


def _is_list(flag: Flag) -> bool:
    return typing.get_origin(_value_type(option_of(flag).hint)) is tuple


def _argparse_options(flag: Flag, command: Command) -> tuple[list[str], dict[str, Any]]:
    """`add_argument`'s positional and keyword arguments for `flag` in `command`."""
    option = option_of(flag)
    kind = _value_type(option.hint)
    kwargs: dict[str, Any] = {"help": _help(flag).replace("%", "%%"), "metavar": flag.metavar}
    if flag.choices is not None:
        kwargs["choices"] = flag.choices
    if kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(kind) is tuple:
        kwargs["nargs"] = "+"
    elif kind in (int, float):
        kwargs["type"] = kind
    if command in flag.positional_in or not flag.name.startswith("-"):
        if option.default is not dataclasses.MISSING:
            kwargs["nargs"] = "?"
            kwargs["default"] = option.default
        kwargs["metavar"] = flag.metavar or flag.field
        return [flag.field], kwargs
    kwargs["dest"] = flag.field
    kwargs["default"] = option.default
    return [flag.name], kwargs


def _is_unset(default: Any) -> bool:
    """No default value to show: required, None (the help says what unset means) or empty."""
    return default is dataclasses.MISSING or default is None or default == ()


def _help(flag: Flag) -> str:
    """The flag's help with its default appended, unless there is none to show."""
    if _is_unset(option_of(flag).default):
        return flag.help
    return f"{flag.help} (default: {render_default(flag)})"


def render_default(flag: Flag) -> str:
    """The default as a user would type it: `on`/`off` for switches, `unset` for None."""
    default = option_of(flag).default
    if default is dataclasses.MISSING:
        return "required"
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return "on" if default else "off"
    if default == ():
        return "none"
    return str(default)


def flags_for(command: Command) -> list[Flag]:
    """The flags `command` takes, in `FLAGS` order (the order of --help and of docs/flags.md)."""
    return [flag for flag in FLAGS if command in flag.commands]


def build_parser() -> argparse.ArgumentParser:
    """The `rankcast` parser, every flag generated from `FLAGS`."""
    parser = argparse.ArgumentParser(prog="rankcast", description="rankcast LLM serving engine")
    parser.add_argument(
        "--markdown-flags",
        action=_PrintFlagTable,
        help="print docs/flags.md's table of flags (Markdown) and exit",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    helps: dict[Command, str] = {
        "serve": "serve the OpenAI-compatible HTTP API",
        "chat": "answer one chat message with the offline engine",
    }
    for command, text in helps.items():
        sub = commands.add_parser(command, help=text)
        for flag in flags_for(command):
            names, kwargs = _argparse_options(flag, command)
            sub.add_argument(*names, **kwargs)
    return parser


def _config_value(flag: Flag, parsed: Any) -> Any:
    """What argparse parsed for `flag`, as its option holds it (lists become tuples)."""
    if parsed is None:
        return None
    if flag.parse is not None:
        return flag.parse(parsed)
    return tuple(parsed) if _is_list(flag) else parsed


def options_from_args(args: argparse.Namespace, target: Target) -> dict[str, Any]:
    """The keyword arguments for `target` (`EngineConfig.from_kwargs`, `ServeConfig`,
    `ChatArgs`) that the parsed command line gives: one per flag of the command."""
    return {
        flag.field: _config_value(flag, getattr(args, flag.field))
        for flag in flags_for(args.command)
        if flag.target == target
    }


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine configuration the parsed command line asks for, validated."""
    return EngineConfig.from_kwargs(**options_from_args(args, "engine"))


def flag_table_markdown() -> str:
    """The flag table of docs/flags.md (tests/entrypoints/test_cli_flags.py keeps the two equal)."""
    rows = [
        "| flag | commands | default | sets | what it does |",
        "| --- | --- | --- | --- | --- |",
    ]
    for flag in FLAGS:
        value, default = option_of(flag).default, render_default(flag)
        if not isinstance(value, bool) and not _is_unset(value):
            default = f"`{default}`"  # a value to type, not a word about one
        what = flag.help.replace("|", "\\|")
        rows.append(
            f"| {_markdown_names(flag)} | {', '.join(flag.commands)} | {default} | "
            f"`{option_of(flag).owner}.{flag.field}` | {what} |"
        )
    return "\n".join(rows)


def _markdown_names(flag: Flag) -> str:
    """Every spelling of the flag: `--x` and `--no-x` for switches, the positional form."""
    if not flag.name.startswith("-"):
        return f"`{flag.field.upper()}`"
    names = [f"`{flag.name}`"]
    if _value_type(option_of(flag).hint) is bool:
        names.append(f"`--no-{flag.name[2:]}`")
    for command in flag.positional_in:
        names.append(f"`{flag.metavar or flag.field}` ({command})")
    return ", ".join(names)


class _PrintFlagTable(argparse.Action):
    """`--markdown-flags`: print the table and exit, like `--version`, whatever else is given."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(flag_table_markdown())
        parser.exit()


def _chat(args: argparse.Namespace) -> int:
    from rankcast.engine_core.core import EngineCore
    from rankcast.offline.llm import LLM
    from rankcast.offline.llm_engine import LLMEngine
    from rankcast.sampling_params import SamplingParams

    chat = ChatArgs(**options_from_args(args, "chat"))
    started = time.perf_counter()
    llm = LLM.from_engine(LLMEngine(engine_config(args), EngineCore))
    loaded = time.perf_counter()
    params = SamplingParams(
        temperature=chat.temperature, max_tokens=chat.max_tokens, seed=chat.seed
    )
    output = llm.chat([{"role": "user", "content": chat.message}], params)[0]
    done = time.perf_counter()
    print(output.outputs[0].text.strip(), flush=True)
    print(
        f"[{len(output.outputs[0].token_ids)} tokens; load {loaded - started:.1f} s, "
        f"generate {done - loaded:.2f} s]",
        file=sys.stderr,
    )
    llm.shutdown()
    return 0


def _serve(args: argparse.Namespace) -> int:
    from rankcast.launcher.serve import LaunchError, serve

    server = ServeConfig(**options_from_args(args, "serve"))
    config = engine_config(args)
    try:
        return serve(config, server)
    except LaunchError as exc:
        print(f"rankcast: error: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        init_logging("launcher" if args.command == "serve" else "cli")
        if args.command == "serve":
            teardown = TeardownSkip()
            code = _serve(args)
            if code == 0:
                teardown.finished()  # every child is stopped: ~0.3 s less for every stop
            return code
        return _chat(args)
    except (ConfigError, ModelFormatError, ValueError) as exc:
        print(f"rankcast: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
