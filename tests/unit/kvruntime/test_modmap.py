"""docs/kvruntime-modules.md is the module map the code makes (kvruntime/tools/modmap.py): a
module added, moved or re-described without regenerating it fails here, so the map a newcomer
reads cannot go stale."""

from pathlib import Path

from kvruntime.tools import modmap

ROOT = Path(__file__).resolve().parents[3]


def test_the_committed_module_map_is_the_one_the_code_makes():
    committed = (ROOT / "docs" / "kvruntime-modules.md").read_text()
    assert committed == modmap.module_map(), (
        "docs/kvruntime-modules.md is stale: run "
        "`python -m kvruntime.tools.modmap > docs/kvruntime-modules.md`")


def test_every_module_says_what_it_holds():
    silent = [str(p.relative_to(ROOT)) for p in (ROOT / "kvruntime").rglob("*.py")
              if "__pycache__" not in p.parts and not modmap._docstring(p)]
    assert silent == []


def test_a_sentence_ends_at_its_full_stop_not_at_an_abbreviation():
    assert modmap.first_sentence("Pools, e.g. host ones. More.") == "Pools, e.g. host ones."
    assert modmap.first_sentence("No stop") == "No stop"
    assert modmap.first_sentence("a|b. c") == "a\\|b."
