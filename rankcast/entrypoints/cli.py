"""The `rankcast` command."""

from __future__ import annotations

import argparse
import sys
import time

from rankcast.config import ConfigError
from rankcast.logger import init_logging
from rankcast.model.arch import ModelFormatError


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="GGUF file or HF directory (default: embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument(
        "--kv-cache-space",
        dest="kv_cache_space_gib",
        type=float,
        default=None,
        help="KV cache budget in GiB",
    )


def _chat(args: argparse.Namespace) -> int:
    from rankcast import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_cache_space_gib=args.kv_cache_space_gib,
    )
    loaded = time.perf_counter()
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    output = llm.chat([{"role": "user", "content": args.message}], params)[0]
    done = time.perf_counter()
    print(output.outputs[0].text.strip())
    print(
        f"[{len(output.outputs[0].token_ids)} tokens; load {loaded - started:.1f} s, "
        f"generate {done - loaded:.2f} s]",
        file=sys.stderr,
    )
    llm.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rankcast", description="rankcast LLM serving engine")
    commands = parser.add_subparsers(dest="command", required=True)
    chat = commands.add_parser("chat", help="answer one chat message with the offline engine")
    chat.add_argument("message")
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--seed", type=int, default=None)
    _add_engine_args(chat)
    args = parser.parse_args(argv)
    init_logging("cli")
    try:
        if args.command == "chat":
            return _chat(args)
    except (ConfigError, ModelFormatError, ValueError) as exc:
        print(f"rankcast: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
