"""``python -m kvruntime demo`` as a user runs it: a real transformer (Hugging Face's Llama code,
weights from a seed) prefills in one process, its KV crosses real NIXL agents (or the same-node
engine, or the host-staged pools) into another process's pages at other block ids, and the
decode's tokens and logits are compared with one process's generation. Skipped where
transformers is not installed (CI installs it: pyproject's test extra)."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

pytestmark = pytest.mark.integration


def demo(*args):
    r = subprocess.run([sys.executable, "-m", "kvruntime", "demo", "--json", "--compact", *args],
                       capture_output=True, text=True, timeout=900)
    try:
        return r.returncode, json.loads(r.stdout)
    except ValueError:
        raise AssertionError(f"exit {r.returncode}, no report: {r.stderr[-2000:]}") from None


def test_every_engine_continues_the_prompt_exactly_as_one_process_does():
    """Both layouts x NIXL, same-node, host-staged, coalesced x pull, push x TP 1->1, 2->1,
    1->2: every case that can run here passes with the reference's tokens and bit-identical
    logits; the ones that cannot say why (on host memory: a host-staged prefill pushes
    nothing, the same-node engine copies no head slices)."""
    rc, report = demo()
    assert rc == 0 and report["ok"], report
    ref = report["reference"]["tokens"]
    assert len(ref) == 1 + report["steps"] and len(set(ref)) > 4  # the tokens follow the KV
    ran = {(c["layout"], c["engine"], c["op"], c["prefill_tp"], c["decode_tp"])
           for c in report["cases"] if c.get("ok")}
    skipped = {(c["layout"], c["engine"], c["op"], c["prefill_tp"], c["decode_tp"])
               for c in report["skipped"]}
    every = {(k, e, o, p, d) for k in ("cross_layer", "per_layer")
             for e in ("nixl", "samenode", "host_staged", "coalesced") for o in ("pull", "push")
             for p, d in ((1, 1), (2, 1), (1, 2))}
    assert ran | skipped == every and not ran & skipped
    assert {c for c in skipped if c[1] != "host_staged"} == {
        c for c in every if c[1] == "samenode" and c[3] != c[4]}
    assert {c for c in skipped if c[1] == "host_staged"} == {
        c for c in every if c[1] == "host_staged" and c[2] == "push"}
    for case in report["cases"]:
        assert case["tokens"] == ref and case["logits_bit_identical"], case
        assert set(case["src"]).isdisjoint(case["dst"]), case  # two allocators, other ids
        assert set(case["seconds"]) == {"connect", "transfer", "decode"}
    engines = {c["engine"]: c["engines"] for c in report["cases"] if c["prefill_tp"] == 1 ==
               c["decode_tp"] and c["op"] == "pull"}
    assert engines["samenode"][0].startswith("samenode") and engines["nixl"] == ["nixl"]
    assert engines["host_staged"] == ["host_staged"]
    assert engines["coalesced"] == ["nixl coalesced"]
    assert [p["rank"] for p in report["prefills"]] == [0, 0, 1]


def test_a_decode_with_another_model_is_refused_at_the_handshake():
    """The decode's weights from another seed: every connection is refused, naming both
    sides' weight digests; nothing is generated."""
    rc, report = demo("--decode-seed", "1", "--engines", "nixl", "host_staged", "--ops", "pull",
                      "--tp", "2x1", "--layouts", "cross_layer")
    assert rc == 1 and not report["ok"]
    ours = report["reference"]["app"]["weights_sha256"]
    assert len(report["cases"]) == 2
    for case in report["cases"]:
        assert "tokens" not in case
        assert (f"app.weights_sha256: prefill='{ours}' decode='" in case["error"]
                and "IncompatiblePeerError" in case["error"]), case


def test_a_decode_with_another_block_size_is_refused_at_the_handshake():
    rc, report = demo("--decode-tokens-per-block", "8", "--engines", "samenode", "--ops", "push",
                      "--tp", "1x1", "--layouts", "per_layer")
    assert rc == 1 and len(report["cases"]) == 1
    assert report["cases"][0]["error"] == (
        "IncompatiblePeerError: the prefill refused the connection: peer KV layout is "
        "incompatible: tokens_per_block: ours=16 peer=8 (ours: the prefill's, peer: this "
        "decode's)")


def test_cuda_on_a_host_without_those_gpus_is_one_line_before_any_process_starts():
    torch = pytest.importorskip("torch")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    r = subprocess.run([sys.executable, "-m", "kvruntime", "demo", "--device", "cuda",
                        "--device-ids", "0", str(count)], capture_output=True, text=True,
                       timeout=120)
    fix = f"give ids below {count}" if count else "run it with --device cpu"
    assert r.returncode == 3 and r.stdout == ""
    assert r.stderr == (f"demo: --device cuda --device-ids 0 {count}: this host has {count} CUDA "
                        f"device(s); {fix}\n")
