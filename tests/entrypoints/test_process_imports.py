"""What the processes that never run the model import: the launcher (`rankcast serve`) and the
API servers start without torch (its import is ~2 s of CPU on a 2-core machine, paid before a
server is ready) and no process imports transformers to serve."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _imported_after(statements: str) -> set[str]:
    script = f"""
import sys
{statements}
print(" ".join(sorted({{m.split(".")[0] for m in sys.modules}})))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return set(done.stdout.split())


def test_the_launcher_and_api_server_modules_do_not_import_torch() -> None:
    imported = _imported_after(
        "import rankcast.launcher.serve\n"
        "import rankcast.api_server.app\n"
        "import rankcast.launcher.cli\n"
        "from rankcast.model_files.source import resolve_model\n"
        "from rankcast.tokenizer import load_tokenizer\n"
        "tokenizer = load_tokenizer(resolve_model(None).model_dir)\n"
        "tokenizer.render_chat([{'role': 'user', 'content': 'hi'}])"
    )
    assert "rankcast" in imported and "fastapi" in imported
    assert "torch" not in imported and "transformers" not in imported


def test_the_public_names_still_import_on_first_use() -> None:
    imported = _imported_after(
        "import rankcast\n"
        "assert 'torch' not in sys.modules\n"
        "from rankcast import LLM, SamplingParams, LoRARequest, RequestOutput, CompletionOutput\n"
        "assert LLM.__module__ == 'rankcast.offline.llm'\n"
        "assert set(rankcast.__all__) <= set(dir(rankcast))\n"
        "try:\n"
        "    rankcast.Nope\n"
        "except AttributeError as exc:\n"
        "    assert 'Nope' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('no error for an unknown name')\n"
    )
    assert "rankcast" in imported
