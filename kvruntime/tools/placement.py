"""Where the ranks of a mixed tensor-parallel group run: which device each rank's process gets.

Pure. A group is one prefill instance of TP p read at once by ``instances`` decode instances of
TP d (``"2x1x2"``: prefill TP 2, two decode instances of TP 1). Deployments give each rank a
GPU of its own: ranks are laid on the given device ids in order — prefill ranks first, then
each decode instance's ranks — one device a rank, round robin when ranks outnumber devices (so
2x4 on four GPUs doubles decode ranks 2 and 3 up with the prefill's). An explicit placement
(one id a rank, in that same order) overrides it.
"""

from __future__ import annotations

from dataclasses import dataclass

# Named scenarios (``--scenario``): the groups to run, one after another, and the devices they
# are laid on. Sizes are the bench's (per decode rank, its own heads of the blocks); a scenario's
# are chosen so that the whole of it runs in about four minutes on its host.
SCENARIOS = {
    "tp-4gpu": {
        "about": "4 GPUs: prefill TP2 -> decode TP2 (GPUs 0,1 -> 2,3); TP2 -> two TP1 decode "
                 "instances at once (2 and 3); TP1 -> TP2; 2x4 and 4x2 with ranks doubled up",
        "groups": ["2x2", "2x1x2", "1x2", "2x4", "4x2"],
        "device_ids": [0, 1, 2, 3], "sizes_mib": [64], "iters": 3,
    },
    "tp-2gpu": {
        "about": "2 GPUs: prefill TP2 -> decode TP1 and TP1 -> TP2",
        "groups": ["2x1", "1x2"],
        "device_ids": [0, 1], "sizes_mib": [64], "iters": 3,
    },
}


@dataclass(frozen=True)
class Group:
    """Prefill TP ``p`` read by ``instances`` decode instances of TP ``d`` at once."""

    p: int
    d: int
    instances: int = 1

    @property
    def label(self) -> str:
        return f"{self.p}x{self.d}" + (f"x{self.instances}" if self.instances > 1 else "")

    @property
    def ranks(self) -> int:
        return self.p + self.d * self.instances


@dataclass(frozen=True)
class Placement:
    """The device id of each prefill rank, and of each rank of each decode instance."""

    prefill: tuple[int, ...]
    decode: tuple[tuple[int, ...], ...]

    def as_dict(self) -> dict:
        return {"prefill": list(self.prefill), "decode": [list(i) for i in self.decode]}


def parse_group(text: str, heads: int) -> Group:
    """``"PxD"`` or ``"PxDxN"`` -> Group; ValueError with the reason (each TP size must split
    the model's ``heads`` KV heads evenly)."""
    try:
        numbers = [int(n) for n in text.split("x")]
    except ValueError:
        numbers = []
    if len(numbers) not in (2, 3) or min(numbers) < 1:
        raise ValueError(f"{text!r} is not PxD or PxDxN (prefill TP x decode TP [x decode "
                         f"instances], e.g. 2x1 or 2x1x2)")
    bad = next((n for n in numbers[:2] if heads % n), None)
    if bad is not None:
        sizes = ", ".join(str(n) for n in range(1, heads + 1) if heads % n == 0)
        raise ValueError(f"TP size {bad} in {text!r} does not split the model's {heads} KV "
                         f"heads (TP sizes here: {sizes})")
    return Group(*numbers)


def parse_ids(text: str) -> tuple[int, ...]:
    """``"0,1,2,3"`` -> (0, 1, 2, 3); ValueError naming what is wrong."""
    try:
        ids = tuple(int(n) for n in text.split(","))
    except ValueError:
        ids = (-1,)
    if min(ids) < 0:
        raise ValueError(f"{text!r} is not a list of device ids like 0,1,2,3")
    return ids


def place(group: Group, device_ids, explicit=None) -> Placement:
    """One device a rank in order (prefill ranks, then each decode instance's), round robin
    over ``device_ids``; ``explicit``: one id a rank in that order instead."""
    if explicit is not None:
        if len(explicit) != group.ranks:
            raise ValueError(f"placement {','.join(map(str, explicit))} names {len(explicit)} "
                             f"device(s); group {group.label} has {group.ranks} ranks (prefill "
                             f"ranks first, then each decode instance's)")
        ids = list(explicit)
    else:
        ids = [device_ids[k % len(device_ids)] for k in range(group.ranks)]
    decode = ids[group.p:]
    return Placement(tuple(ids[:group.p]),
                     tuple(tuple(decode[k * group.d:(k + 1) * group.d])
                           for k in range(group.instances)))
