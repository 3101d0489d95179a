"""What kvstack's NIXL wheel takes from outside itself (wheeldeps.toml): the accelerator drivers
and rdma-core left to the host, and the libraries another wheel on PyPI provides (the cuda
build's libcudart from nvidia-cuda-runtime). auditwheel is told to graft none of them; the wheel
requires the last."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import tomllib

TABLE = Path(__file__).with_name("wheeldeps.toml")


@dataclass(frozen=True)
class FromPip:
    """A library the wheel takes from another wheel it requires."""
    library: str
    requirement: str   # PEP 508: nvidia-cuda-runtime==13.*
    directory: str     # where that wheel installs it, relative to site-packages

    @property
    def path(self) -> str:
        return f"{self.directory}/{self.library}"


@dataclass(frozen=True)
class Outside:
    drivers: list[str]
    pip: dict[str, FromPip]
    rdma_core: list[str]

    def from_pip(self, needed: set[str]) -> list[FromPip]:
        """The libraries among `needed` (NEEDED entries of the wheel's files) that come from pip."""
        return [row for lib, row in sorted(self.pip.items()) if lib in needed]

    def excluded(self, from_pip: list[FromPip]) -> list[str]:
        """What auditwheel must not graft."""
        return [*self.drivers, *self.rdma_core, *(d.library for d in from_pip)]


def load(path: Path = TABLE) -> Outside:
    table = tomllib.loads(path.read_text())
    return Outside(
        list(table.get("drivers", [])),
        pip={
            lib: FromPip(lib, row["requirement"], row["directory"])
            for lib, row in table.get("pip", {}).items()
        },
        rdma_core=list(table.get("rdma_core", [])),
    )
