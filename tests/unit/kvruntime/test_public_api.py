"""kvruntime's public face: the names an engine imports from the package itself, each the class
its internal module defines, and a bare `import kvruntime` that stays cheap (no NIXL, no torch,
none of the runtime modules until a public name is read)."""

import subprocess
import sys

import pytest

import kvruntime

PUBLIC = {
    "PrefillServer": "kvruntime.prefill.server",
    "DecodeClient": "kvruntime.decode.client",
    "KVCache": "kvruntime.memory",
    "KVLayout": "kvruntime.layout",
    "TransferHandle": "kvruntime.decode.inflight",
    "TransferResult": "kvruntime.jobs",
}


@pytest.mark.parametrize("name, module", sorted(PUBLIC.items()))
def test_a_public_name_is_the_internal_class(name, module):
    value = getattr(kvruntime, name)
    assert value.__module__ == module
    assert name in kvruntime.__all__ and name in dir(kvruntime)


def test_errors_is_the_one_exception_tree():
    assert kvruntime.errors.KVRuntimeError is kvruntime.KVRuntimeError
    assert issubclass(kvruntime.errors.PeerError, kvruntime.KVRuntimeError)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'PrefilServer'"):
        kvruntime.PrefilServer  # noqa: B018


def test_a_bare_import_loads_no_runtime_module():
    code = (
        "import sys, kvruntime\n"
        "heavy = [m for m in ('torch', 'kvruntime.decode.client', 'kvruntime.prefill.server', "
        "'kvruntime.nixl.agent') if m in sys.modules]\n"
        "print(heavy)\n"
        "from kvruntime import DecodeClient\n"
        "print('kvruntime.decode.client' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "True"]
