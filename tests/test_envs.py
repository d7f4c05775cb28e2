"""Environment variables that shape an engine are read and checked when its configuration is
built: a bad value stops the start with the variable's name, and the engine keeps the value it
started with."""

from __future__ import annotations

import pickle

import pytest

from rankcast import envs
from rankcast.config import DEFAULT_KV_CACHE_SPACE_GIB, ConfigError, EngineConfig

ENGINE_VARIABLES = (
    "RANKCAST_KV_CACHE_SPACE",
    "RANKCAST_WORKER_NOTIFICATION_POLL_INTERVAL",
    "RANKCAST_KERNELS",
    "RANKCAST_CPU_BIND",
    "RANKCAST_NUM_THREADS",
    "RANKCAST_KV_CACHE_COMMIT",
)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from no engine variable, whatever the shell running pytest has set."""
    for name in ENGINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    "name, value",
    [
        ("RANKCAST_KV_CACHE_SPACE", "abc"),
        ("RANKCAST_KV_CACHE_SPACE", "-1"),
        ("RANKCAST_KV_CACHE_SPACE", "inf"),
        ("RANKCAST_WORKER_NOTIFICATION_POLL_INTERVAL", "-1"),
        ("RANKCAST_WORKER_NOTIFICATION_POLL_INTERVAL", "soon"),
        ("RANKCAST_KERNELS", "bogus"),
        ("RANKCAST_CPU_BIND", "garbage"),
        ("RANKCAST_CPU_BIND", "0-3|4-x"),
        ("RANKCAST_NUM_THREADS", "many"),
        ("RANKCAST_NUM_THREADS", "-2"),
        ("RANKCAST_NUM_THREADS", "1.5"),
        ("RANKCAST_KV_CACHE_COMMIT", "maybe"),
    ],
)
def test_a_bad_value_fails_the_config_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name) as raised:
        EngineConfig.from_kwargs()
    assert repr(value) in str(raised.value), "the message shows the value that was refused"


def test_cpu_bind_needs_a_list_for_every_rank_on_the_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANKCAST_CPU_BIND", "0-1|2-3")
    EngineConfig.from_kwargs(tensor_parallel_size=2)
    with pytest.raises(ConfigError, match=r"RANKCAST_CPU_BIND gives 2 CPU list\(s\) for 4 ranks"):
        EngineConfig.from_kwargs(tensor_parallel_size=2, data_parallel_size=2)


@pytest.mark.parametrize("value", ["auto", "off", "2-3|0,1", " 0-1 , 3 |4"])
def test_good_cpu_bind_values_pass(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("RANKCAST_CPU_BIND", value)
    assert envs.cpu_bind() == value.strip()
    EngineConfig.from_kwargs()


def test_kv_cache_space_is_the_flag_then_the_variable_then_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert EngineConfig.from_kwargs().cache.space_gib == DEFAULT_KV_CACHE_SPACE_GIB
    monkeypatch.setenv("RANKCAST_KV_CACHE_SPACE", "0.5")
    assert EngineConfig.from_kwargs().cache.space_gib == 0.5
    assert EngineConfig.from_kwargs(kv_cache_space_gib=1.5).cache.space_gib == 1.5
    monkeypatch.setenv("RANKCAST_KV_CACHE_SPACE", "0")
    assert EngineConfig.from_kwargs().cache.space_gib == DEFAULT_KV_CACHE_SPACE_GIB
    # With the flag given the variable is not consulted, so even a bad one does not matter.
    monkeypatch.setenv("RANKCAST_KV_CACHE_SPACE", "abc")
    assert EngineConfig.from_kwargs(kv_cache_space_gib=1.5).cache.space_gib == 1.5


def test_poll_interval_is_the_flag_then_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert EngineConfig.from_kwargs().notifications.poll_interval is None
    monkeypatch.setenv("RANKCAST_WORKER_NOTIFICATION_POLL_INTERVAL", "0.25")
    assert EngineConfig.from_kwargs().notifications.poll_interval == 0.25
    config = EngineConfig.from_kwargs(worker_notification_poll_interval=2.0)
    assert config.notifications.poll_interval == 2.0
    monkeypatch.setenv("RANKCAST_WORKER_NOTIFICATION_POLL_INTERVAL", "0")
    assert EngineConfig.from_kwargs().notifications.poll_interval is None


def test_the_engine_keeps_the_values_it_was_built_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers get the configuration, not the environment: a later change (or a bad value in a
    process that inherits another environment) cannot reach a running engine."""
    monkeypatch.setenv("RANKCAST_KV_CACHE_SPACE", "0.5")
    monkeypatch.setenv("RANKCAST_WORKER_NOTIFICATION_POLL_INTERVAL", "3")
    monkeypatch.setenv("RANKCAST_KERNELS", "off")
    monkeypatch.setenv("RANKCAST_NUM_THREADS", "3")
    monkeypatch.setenv("RANKCAST_CPU_BIND", "0|1")
    config = EngineConfig.from_kwargs()
    for name in ENGINE_VARIABLES:
        monkeypatch.setenv(name, "garbage")
    for seen in (config, pickle.loads(pickle.dumps(config))):
        assert seen.cache.space_gib == 0.5
        assert seen.notifications.poll_interval == 3.0
        assert seen.parallel.kernels == "off"
        assert seen.parallel.num_threads == 3
        assert seen.parallel.cpu_bind == "0|1"


def test_rank_settings_default_to_rankcasts_choice() -> None:
    parallel = EngineConfig.from_kwargs().parallel
    assert (parallel.kernels, parallel.num_threads, parallel.cpu_bind) == ("auto", None, "auto")


def test_settled_values_are_not_options() -> None:
    """Values settled from the environment are derived; passing one is an unknown option."""
    for name in ("space_gib", "poll_interval", "kernels", "num_threads", "cpu_bind"):
        with pytest.raises(ConfigError, match=f"unknown engine option {name!r}"):
            EngineConfig.from_kwargs(**{name: 1.0})


def test_unset_empty_and_zero_mean_rankcasts_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    for value in ("", "0"):
        monkeypatch.setenv("RANKCAST_NUM_THREADS", value)
        monkeypatch.setenv("RANKCAST_KV_CACHE_SPACE", value)
        assert envs.num_threads() is None
        assert envs.kv_cache_space_gib() is None
    monkeypatch.setenv("RANKCAST_NUM_THREADS", "3")
    assert envs.num_threads() == 3
