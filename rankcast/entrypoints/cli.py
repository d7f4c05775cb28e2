"""The `rankcast` command: `serve` (HTTP API) and `chat` (one answer from the offline engine)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from rankcast.config import ConfigError, EngineConfig
from rankcast.logger import init_logging
from rankcast.model.arch import ModelFormatError


def _add_engine_args(parser: argparse.ArgumentParser, model_flag: bool) -> None:
    help_model = "GGUF file or HF directory (default: the embedded SmolLM2-135M-Instruct)"
    if model_flag:
        parser.add_argument("--model", default=None, help=help_model)
    else:
        parser.add_argument("model", nargs="?", default=None, help=help_model)
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens one step computes: running decodes, then prompt tokens (default: 512)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of prompt prefixes earlier requests computed",
    )
    parser.add_argument(
        "--kv-events",
        action="store_true",
        help="publish KV-cache block stored/removed/cleared events (notification channel)",
    )
    parser.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split prompts longer than what is left of a step's budget across steps",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--kv-cache-space",
        dest="kv_cache_space_gib",
        type=float,
        default=None,
        help="KV cache budget in GiB (default 2, or RANKCAST_KV_CACHE_SPACE)",
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--data-parallel-size", type=int, default=1)
    parser.add_argument(
        "--distributed-executor-backend",
        default=None,
        choices=["uni", "mp", "ray"],
        help="uni: one rank in the engine process; mp: a process per rank (default for "
        "several ranks); ray: ranks as Ray actors (pip install 'rankcast[ray]')",
    )
    parser.add_argument(
        "--worker-extension-cls",
        default=None,
        help="module:Class mixed into every worker; its methods run on every rank "
        "(POST /collective_rpc, LLM.collective_rpc) and may publish notifications",
    )
    parser.add_argument(
        "--worker-notification-poll-interval",
        type=float,
        default=None,
        help="also gather worker notifications every N seconds (default: off, the doorbell "
        "suffices; or RANKCAST_WORKER_NOTIFICATION_POLL_INTERVAL)",
    )
    parser.add_argument(
        "--no-worker-notification-doorbell",
        dest="worker_notification_doorbell",
        action="store_false",
        help="ignore the doorbell, so events wait for the poll (for measuring the two)",
    )
    parser.add_argument(
        "--worker-notification-buffer-size",
        type=int,
        default=1024,
        help="notifications each worker holds before dropping the oldest",
    )
    parser.add_argument(
        "--engine-notification-buffer-size",
        type=int,
        default=65536,
        help="gathered notifications the engine core holds before dropping the oldest",
    )
    parser.add_argument(
        "--notification-events-endpoint",
        default=None,
        help="ZMQ PUB endpoint for the notification stream, e.g. tcp://*:5557 "
        "(data-parallel engine i uses port + i)",
    )
    parser.add_argument(
        "--notification-events-replay-endpoint",
        default=None,
        help="ZMQ ROUTER endpoint answering replay (8-byte start seq) and snapshot requests",
    )
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    parser.add_argument("--max-loras", type=int, default=1, help="adapter slots per rank")
    parser.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept in each rank's host tier (>= --max-loras; default: --max-loras)",
    )
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="PEFT adapters every engine core loads at start",
    )
    parser.add_argument(
        "--allowed-lora-paths",
        nargs="+",
        default=None,
        metavar="DIR",
        help="adapters load only from under these directories (default: anywhere)",
    )
    parser.add_argument(
        "--num-gpu-blocks-override",
        dest="num_blocks",
        type=int,
        default=None,
        help="exact number of KV cache blocks, overriding the budget",
    )


def _lora_modules(specs: list[str]) -> tuple[tuple[str, str], ...]:
    modules = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora-modules takes NAME=PATH, got {spec!r}")
        modules.append((name, path))
    return tuple(modules)


def _engine_config(args: argparse.Namespace, **extra: Any) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_events=args.kv_events,
        **(
            {"max_num_batched_tokens": args.max_num_batched_tokens}
            if args.max_num_batched_tokens is not None
            else {}
        ),
        block_size=args.block_size,
        kv_cache_space_gib=args.kv_cache_space_gib,
        num_blocks=args.num_blocks,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        worker_extension_cls=args.worker_extension_cls,
        worker_notification_poll_interval=args.worker_notification_poll_interval,
        worker_notification_doorbell=args.worker_notification_doorbell,
        worker_notification_buffer_size=args.worker_notification_buffer_size,
        engine_notification_buffer_size=args.engine_notification_buffer_size,
        notification_events_endpoint=args.notification_events_endpoint,
        notification_events_replay_endpoint=args.notification_events_replay_endpoint,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
        max_lora_rank=args.max_lora_rank,
        lora_modules=_lora_modules(args.lora_modules),
        allowed_lora_paths=tuple(args.allowed_lora_paths) if args.allowed_lora_paths else None,
        **extra,
    )


def _chat(args: argparse.Namespace) -> int:
    from rankcast import SamplingParams
    from rankcast.engine.llm_engine import LLMEngine
    from rankcast.entrypoints.llm import LLM

    started = time.perf_counter()
    llm = LLM.from_engine(LLMEngine(_engine_config(args)))
    loaded = time.perf_counter()
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    output = llm.chat([{"role": "user", "content": args.message}], params)[0]
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
    from rankcast.entrypoints.launcher import LaunchError, ServeArgs, serve

    if args.api_server_count < 1:
        raise ConfigError("--api-server-count must be >= 1")
    config = _engine_config(args, served_model_name=args.served_model_name)
    try:
        serve_args = ServeArgs(
            args.host,
            args.port,
            args.api_server_count,
            args.api_key,
            args.allow_runtime_lora_updating,
        )
        return serve(config, serve_args)
    except LaunchError as exc:
        print(f"rankcast: error: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rankcast", description="rankcast LLM serving engine")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _add_engine_args(serve, model_flag=False)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-server-count", type=int, default=1)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--api-key", default=None, help="require this bearer token on /v1")
    serve.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="enable /v1/load_lora_adapter, /v1/unload_lora_adapter and /v1/(un)pin_lora_adapter",
    )

    chat = commands.add_parser("chat", help="answer one chat message with the offline engine")
    chat.add_argument("message")
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--seed", type=int, default=None)
    _add_engine_args(chat, model_flag=True)

    args = parser.parse_args(argv)
    init_logging("launcher" if args.command == "serve" else "cli")
    try:
        if args.command == "serve":
            return _serve(args)
        return _chat(args)
    except (ConfigError, ModelFormatError, ValueError) as exc:
        print(f"rankcast: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
