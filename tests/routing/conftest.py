"""The tiny model with SmolLM2's chat template: routers render chats through the worker."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_chat_dir(
    tiny_llama_dir: Path, embedded_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    directory = tmp_path_factory.mktemp("tiny-chat") / "tiny-chat"
    shutil.copytree(tiny_llama_dir, directory)
    shutil.copy(embedded_model_dir / "chat_template.jinja", directory)
    return directory
