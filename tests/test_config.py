"""Configuration is validated once, with messages that name the flag."""

from __future__ import annotations

import pytest

from rankcast.config import CacheConfig, ConfigError, EngineConfig, KVEventsConfig


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dtype="float8"), "--dtype"),
        (dict(max_model_len=0), "--max-model-len"),
        (dict(block_size=3), "--block-size"),
        (dict(num_blocks=0), "--num-gpu-blocks-override"),
        (dict(max_num_seqs=0), "--max-num-seqs"),
        (dict(tensor_parallel_size=0), "--tensor-parallel-size"),
        (dict(distributed_executor_backend="mpi"), "--distributed-executor-backend"),
        (dict(no_such_option=1), "unknown engine option 'no_such_option'"),
    ],
)
def test_bad_options_are_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_kwargs(**kwargs)


def test_kwargs_land_in_their_sections() -> None:
    config = EngineConfig.from_kwargs(
        model="m", block_size=32, max_num_seqs=3, tensor_parallel_size=2
    )
    assert config.model.model == "m"
    assert config.cache.block_size == 32
    assert config.scheduler.max_num_seqs == 3
    assert config.parallel.world_size == 2 and config.parallel.backend == "mp"


def test_too_long_max_model_len_for_the_model(tiny_llama_dir) -> None:
    from rankcast import LLM

    with pytest.raises(ConfigError, match="exceeds the model's context"):
        LLM(str(tiny_llama_dir), max_model_len=100_000, kv_cache_space_gib=0.05)


def test_kv_events_config_reads_vllms_json_and_names_what_is_wrong() -> None:
    config = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "topic": "kv@p@m"}')
    assert (config.publisher, config.endpoint, config.topic) == ("zmq", "tcp://*:5557", "kv@p@m")
    assert config.publishes
    assert not KVEventsConfig.from_json("{}").publishes, "vLLM's default: off, publisher null"
    for text, named in (
        ("[1]", "JSON object"),
        ("{nope", "not JSON"),
        ('{"bogus": 1}', "'bogus'"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
        ('{"hwm": true}', "hwm"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"endpoint": "localhost:5557"}', "endpoint"),
        ('{"buffer_steps": 0}', "buffer_steps"),
    ):
        with pytest.raises(ConfigError, match=named):
            KVEventsConfig.from_json(text)
    with pytest.raises(ConfigError, match="--enable-prefix-caching"):
        CacheConfig(enable_prefix_caching=False, kv_events_config=config)
    CacheConfig(enable_prefix_caching=False, kv_events_config=KVEventsConfig())
