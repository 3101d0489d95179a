"""--recipe-overlay given something that is not a TOML file: one line, the recipe exit code,
no traceback (before: IsADirectoryError and UnicodeDecodeError escaped)."""

import os
import subprocess
import sys

import pytest

from installer import recipe
from installer.errors import RecipeError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))


def _binary(tmp_path):
    p = tmp_path / "overlay.toml"
    p.write_bytes(bytes(range(256)) * 4)
    return p


@pytest.mark.parametrize("make,says", [(lambda t: t, "is a directory"),
                                       (_binary, "not a UTF-8 text file")])
def test_an_overlay_that_is_not_a_toml_file_is_one_recipe_error(tmp_path, make, says):
    with pytest.raises(RecipeError, match=says):
        recipe.load("cpu", [make(tmp_path)])
    r = subprocess.run([sys.executable, "-m", "installer", "--platform", "cpu", "--dry-run",
                        "--recipe-overlay", str(make(tmp_path))], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
    assert says in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
