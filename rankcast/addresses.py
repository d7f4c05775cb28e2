"""Where an engine core and its frontends meet: one input and one output socket per API server."""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from rankcast.process import private_ipc_dir


@dataclass(frozen=True)
class ClientAddresses:
    """One frontend's pair: it pushes requests to `input` and pulls outputs from `output`."""

    input: str
    output: str


@dataclass(frozen=True)
class EngineAddresses:
    clients: tuple[ClientAddresses, ...]
    directory: str | None = None

    def cleanup(self) -> None:
        """Remove the IPC socket files once every process using them has stopped."""
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    @classmethod
    def ipc(cls, num_clients: int, engine_index: int = 0) -> EngineAddresses:
        """Fresh IPC endpoints in a private temporary directory."""
        base = private_ipc_dir("rankcast")
        return cls(
            tuple(
                ClientAddresses(
                    f"ipc://{base}/engine{engine_index}-in{i}",
                    f"ipc://{base}/engine{engine_index}-out{i}",
                )
                for i in range(num_clients)
            ),
            directory=str(base),
        )
