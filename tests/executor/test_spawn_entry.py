"""The offline LLM with several ranks, started the ways people start Python: ranks are spawned
processes that re-import the caller's main module, so `python -c` works, and a script without a
`__main__` guard or code piped to stdin fails at once with one line saying what to change
(never a bare EOFError)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

CODE = """
from rankcast import LLM
llm = LLM({model!r}, dtype="float32", tensor_parallel_size=2, kv_cache_space_gib=0.05)
print("generated", len(llm.generate(["hi"])[0].outputs[0].token_ids))
llm.shutdown()
"""


def _ipc_dirs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("rankcast-*"))


def _run(
    args: list[str], tiny_llama_dir: Path, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, RANKCAST_DISABLE_PROGRESS="1"),
        cwd=tiny_llama_dir.parent,
    )


def test_python_dash_c_works(tiny_llama_dir: Path) -> None:
    done = _run(["-c", CODE.format(model=str(tiny_llama_dir))], tiny_llama_dir)
    assert done.returncode == 0, done.stderr
    assert "generated 16" in done.stdout


def test_a_script_without_a_main_guard_is_told_what_to_add(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(CODE.format(model=str(tiny_llama_dir)))
    before = _ipc_dirs()
    done = _run([str(script)], tiny_llama_dir)
    assert _ipc_dirs() <= before, "the failed start left socket directories behind"
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "EOFError" not in done.stderr
    assert str(script) in last and 'if __name__ == "__main__":' in last, last


def test_code_from_stdin_is_told_what_to_do(tiny_llama_dir: Path) -> None:
    before = _ipc_dirs()
    done = _run(["-"], tiny_llama_dir, stdin=CODE.format(model=str(tiny_llama_dir)))
    assert _ipc_dirs() <= before, "the failed start left socket directories behind"
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "EOFError" not in done.stderr
    assert "<stdin> cannot be" in last and "python -c" in last, last
