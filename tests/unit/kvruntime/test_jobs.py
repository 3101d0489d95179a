"""Every copy a TransferHandle polls implements the declared ``jobs.Job`` protocol: each method
with the protocol's parameters, each attribute set on the class, as a property, or in an
``__init__`` of the class or a base. Read from the classes (inspect, ast): making one needs a
NIXL agent, a peer or a GPU, which the integration tests use; here the shape is checked."""

import ast
import inspect
import textwrap

import pytest

from kvruntime.engines.samenode import SharedJob, _CudaJob, _HostJob
from kvruntime.engines.staged import StagedPull
from kvruntime.jobs import Blocking, Job
from kvruntime.nixl.transfer import PostedTransfer

# the concrete ones: CopyJob is the same-node jobs' (and StagedPull's) base, each says how its
# copy is polled
JOBS = [PostedTransfer, SharedJob, StagedPull, _HostJob, _CudaJob]


def _protocol_methods(protocol) -> dict:
    return {name: inspect.signature(fn) for name, fn in vars(protocol).items()
            if inspect.isfunction(fn) and not name.startswith("_")}


def _assigned_in_init(cls) -> set[str]:
    names = set()
    for base in cls.__mro__:
        init = vars(base).get("__init__")
        if init is None or not inspect.isfunction(init):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, ast.AnnAssign) else [])
            for target in targets:
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id == "self"):
                    names.add(target.attr)
    return names


def test_the_protocol_declares_what_the_handle_calls():
    assert set(_protocol_methods(Job)) == {"poll", "finish", "result", "abort", "release",
                                           "give_back", "drop"}
    assert set(Job.__annotations__) == {"engine", "start", "error", "waiting"}
    assert set(_protocol_methods(Blocking)) == {"block"}


@pytest.mark.parametrize("cls", JOBS, ids=lambda c: c.__name__)
def test_each_job_implements_it(cls):
    for name, signature in _protocol_methods(Job).items():
        method = getattr(cls, name, None)
        assert callable(method), f"{cls.__name__} has no {name}()"
        ours = list(inspect.signature(method).parameters)
        assert len(ours) == len(signature.parameters), f"{cls.__name__}.{name}: other arguments"
    init = _assigned_in_init(cls)
    for name in Job.__annotations__:
        assert hasattr(cls, name) or name in init, f"{cls.__name__} has no {name}"


@pytest.mark.parametrize("cls", [_HostJob, _CudaJob], ids=lambda c: c.__name__)
def test_the_jobs_a_thread_runs_can_be_waited_on(cls):
    assert callable(getattr(cls, "block", None))
