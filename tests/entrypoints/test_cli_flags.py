"""Each flag is declared once (`FLAGS`): its default is the configuration's, it lands in the
option it names, and docs/flags.md's table is the one `FLAGS` produces."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rankcast.config import ConfigError, EngineConfig, ServeConfig
from rankcast.launcher import cli

FLAGS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "flags.md"
ENGINE_DEFAULTS = {name: f.default for name, (_, f) in EngineConfig.options().items()}


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defaults are compared without whatever RANKCAST_* the shell running pytest has set."""
    for name in list(os.environ):
        if name.startswith("RANKCAST_"):
            monkeypatch.delenv(name)


def _parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(list(argv))


COMMAND_LINES = {"serve": ("serve",), "chat": ("chat", "hello")}


@pytest.mark.parametrize("command", COMMAND_LINES)
def test_every_engine_flag_defaults_to_the_config_default(command: str) -> None:
    args = _parse(*COMMAND_LINES[command])
    given = cli.options_from_args(args, "engine")
    assert given, "the command has engine flags"
    for name, value in given.items():
        assert value == ENGINE_DEFAULTS[name], f"--{name}: CLI {value!r} != config"
    assert EngineConfig.from_kwargs(**given) == EngineConfig()


def test_serve_flags_default_to_serve_config_defaults() -> None:
    given = cli.options_from_args(_parse("serve"), "serve")
    assert given.keys() == {f.name for f in dataclasses.fields(ServeConfig)}
    assert ServeConfig(**given) == ServeConfig()


def test_every_engine_option_has_a_flag_but_the_seed() -> None:
    """A new configuration field needs a flag (or a line here saying why it has none)."""
    flagged = {flag.field for flag in cli.FLAGS if flag.target == "engine"}
    assert set(ENGINE_DEFAULTS) - flagged == {"seed"}  # offline only: LLM(seed=...)


def test_unset_defaults_say_what_unset_means() -> None:
    """A None default means "decided elsewhere"; the help says where."""
    for flag in cli.FLAGS:
        if cli.option_of(flag).default is None:
            assert "(unset: " in flag.help, flag.name
    helps = {flag.field: flag.help for flag in cli.FLAGS}
    assert "RANKCAST_KV_CACHE_SPACE" in helps["kv_cache_space_gib"]
    poll = helps["worker_notification_poll_interval"]
    assert "RANKCAST_WORKER_NOTIFICATION_POLL_INTERVAL" in poll


SERVE_EVERYTHING = (
    "serve",
    "/models/m",
    "--host=0.0.0.0",
    "--port=9000",
    "--api-server-count=3",
    "--rust-api-server-count=2",
    "--api-key=k",
    "--allow-runtime-lora-updating",
    "--served-model-name=named",
    "--dtype=float32",
    "--quantization=int8",
    "--max-model-len=100",
    "--max-num-seqs=3",
    "--max-num-batched-tokens=40",
    "--no-enable-chunked-prefill",
    "--kv-events",
    '--kv-events-config={"enable_kv_cache_events": true, "topic": "kv"}',
    '--speculative-config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}',
    "--block-size=32",
    "--kv-cache-dtype=int8",
    "--kv-cache-space=0.5",
    "--num-gpu-blocks-override=7",
    "--tensor-parallel-size=2",
    "--pipeline-parallel-size=2",
    "--enable-expert-parallel",
    "--data-parallel-size=2",
    "--distributed-executor-backend=mp",
    "--ray-placement=strict-spread",
    "--worker-extension-cls=pkg.mod:Cls",
    "--worker-notification-poll-interval=0.5",
    "--no-worker-notification-doorbell",
    "--worker-notification-buffer-size=8",
    "--engine-notification-buffer-size=9",
    "--notification-events-endpoint=tcp://*:5557",
    "--notification-events-replay-endpoint=tcp://*:5558",
    "--enable-lora",
    "--max-loras=2",
    "--max-cpu-loras=3",
    "--max-lora-rank=8",
    "--lora-turn-steps=3",
    "--lora-modules",
    "a=/adapters/a",
    "b=/adapters/b",
    "--allowed-lora-paths",
    "/adapters",
    "/more",
)


def test_every_flag_lands_in_its_option() -> None:
    args = _parse(*SERVE_EVERYTHING)
    config = EngineConfig.from_kwargs(**cli.options_from_args(args, "engine"))
    changed = {
        name
        for name, (section, f) in EngineConfig.options().items()
        if getattr(getattr(config, section), name) != f.default
    }
    # KV-cache events need the prefix cache: its switch is checked off on its own below.
    every = {flag.field for flag in cli.flags_for("serve") if flag.target == "engine"}
    assert changed == every - {"enable_prefix_caching"}
    assert config.cache.kv_events_config is not None
    assert config.cache.kv_events_config.topic == "kv"
    spec = config.scheduler.speculative_config
    assert spec is not None and spec.method == "ngram"
    # vLLM's rule: one lookup bound given sets the other.
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (
        3,
        4,
        4,
    )
    assert config.cache.kv_events_config.publisher == "zmq"
    off = _parse("serve", "/models/m", "--no-enable-prefix-caching")
    no_cache = EngineConfig.from_kwargs(**cli.options_from_args(off, "engine")).cache
    assert no_cache.enable_prefix_caching is False
    assert config.model.model == "/models/m"
    assert config.scheduler.max_num_seqs == 3
    assert config.cache.space_gib == 0.5
    assert config.cache.num_blocks == 7
    assert config.cache.kv_cache_dtype == "int8"
    assert config.notifications.worker_notification_doorbell is False
    assert config.notifications.poll_interval == 0.5
    assert config.lora.lora_modules == (("a", "/adapters/a"), ("b", "/adapters/b"))
    assert config.lora.allowed_lora_paths == ("/adapters", "/more")
    server = ServeConfig(**cli.options_from_args(args, "serve"))
    assert server == ServeConfig("0.0.0.0", 9000, 3, "k", True, rust_api_server_count=2)


def test_chat_takes_the_model_as_a_flag_and_its_sampling_options() -> None:
    args = _parse("chat", "hi", "--model", "/m", "--max-tokens=5", "--temperature=0.5", "--seed=7")
    assert cli.ChatArgs(**cli.options_from_args(args, "chat")) == cli.ChatArgs("hi", 5, 0.5, 7)
    assert cli.engine_config(args).model.model == "/m"
    with pytest.raises(SystemExit):
        _parse("chat", "hi", "--served-model-name", "x")  # a serve-only flag


def test_a_malformed_lora_module_is_a_config_error() -> None:
    args = _parse("serve", "--lora-modules", "nopath")
    with pytest.raises(ConfigError, match="--lora-modules takes NAME=PATH, got 'nopath'"):
        cli.engine_config(args)


def test_the_documented_flag_table_is_the_generated_one() -> None:
    text = FLAGS_PAGE.read_text()
    start = text.index("<!-- flags:begin -->\n") + len("<!-- flags:begin -->\n")
    end = text.index("<!-- flags:end -->")
    assert text[start:end].rstrip("\n") == cli.flag_table_markdown(), (
        "docs/flags.md's flag table is stale: paste the output of "
        "`python -m rankcast.launcher.cli --markdown-flags` between its markers"
    )


def test_the_table_has_a_row_per_flag_with_its_default() -> None:
    rows = cli.flag_table_markdown().splitlines()[2:]
    assert len(rows) == len(cli.FLAGS)
    row = next(r for r in rows if r.startswith("| `--max-num-batched-tokens` |"))
    assert f"| `{ENGINE_DEFAULTS['max_num_batched_tokens']}` |" in row
    assert "`scheduler.max_num_batched_tokens`" in row


def _rankcast(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rankcast.launcher.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def test_markdown_flags_prints_the_table() -> None:
    result = _rankcast("--markdown-flags")
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n") == cli.flag_table_markdown()


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (("serve", "--api-server-count", "-1"), {}, "--api-server-count must be >= 0"),
        (
            ("serve", "--api-server-count", "0"),
            {},
            "--api-server-count 0 needs --rust-api-server-count >= 1",
        ),
        (
            (
                "serve",
                "--api-server-count",
                "0",
                "--rust-api-server-count",
                "1",
                "--allow-runtime-lora-updating",
            ),
            {},
            "--allow-runtime-lora-updating needs a Python API server",
        ),
        (("serve", "--port", "70000"), {}, "--port must be 1..65535"),
        (("serve",), {"RANKCAST_KV_CACHE_SPACE": "abc"}, "RANKCAST_KV_CACHE_SPACE must be"),
        (("serve",), {"RANKCAST_KERNELS": "bogus"}, "RANKCAST_KERNELS must be"),
        (("chat", "hi"), {"RANKCAST_LOG_LEVEL": "chatty"}, "RANKCAST_LOG_LEVEL must be"),
    ],
)
def test_bad_settings_stop_the_command_before_anything_starts(
    argv: tuple[str, ...], env: dict[str, str], message: str
) -> None:
    result = _rankcast(*argv, **env)
    assert result.returncode == 2
    assert f"rankcast: error: {message}" in result.stderr
    assert "Traceback" not in result.stderr
