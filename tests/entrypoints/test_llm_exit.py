"""A script that starts an offline `LLM` ends with status 0 whether or not it calls `shutdown`
(many do not): the engine stops at interpreter exit (LLMEngine's exit hook), and stopping it
stops the KV cache's commit (`Worker.close`). Before, a tensor-parallel engine's rank processes
waited for calls while multiprocessing's exit hook waited for them, so the script never ended;
and an in-process rank's commit, still running at exit (4 GiB: seconds of page faults), was
killed inside torch and aborted the process (status 134, "terminate called without an active
exception"), with or without `shutdown`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = """
import sys
from rankcast import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float32", tensor_parallel_size=int(sys.argv[2]),
              kv_cache_space_gib=float(sys.argv[3]))
    if sys.argv[4] == "generate":
        print(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids)
    elif sys.argv[4] == "shutdown":
        llm.shutdown()
    print("end of script", flush=True)
"""


@pytest.mark.parametrize(
    ("tp", "cache_gib", "work"),
    [
        (1, 4.0, "none"),  # the 4 GiB commit is still under way at exit
        (1, 4.0, "shutdown"),  # ... and at `shutdown`
        (2, 0.05, "none"),  # two rank processes
        (2, 0.05, "generate"),
    ],
    ids=[
        "in-process-commit-under-way",
        "shutdown-while-the-commit-runs",
        "tp2-rank-processes",
        "tp2-after-a-request",
    ],
)
def test_a_script_exits_cleanly_with_or_without_shutdown(
    tiny_llama_dir: Path, tmp_path: Path, tp: int, cache_gib: float, work: str
) -> None:
    script = tmp_path / "start_llm.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, RANKCAST_KV_CACHE_COMMIT="1", RANKCAST_LOG_LEVEL="WARNING")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tiny_llama_dir), str(tp), str(cache_gib), work],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its rank processes too, for the kill below
    )
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the script did not end within 180 s of starting")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    assert out.strip().endswith("end of script")
    assert "terminate called" not in err
