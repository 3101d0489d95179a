"""README's kvruntime example runs as written (real agents, one process)."""

import pathlib
import re

import pytest

pytestmark = pytest.mark.integration


def test_readme_example_runs():
    readme = pathlib.Path(__file__).resolve().parents[3] / "README.md"
    code = re.search(r"```python\n(.*?)```", readme.read_text(), re.S).group(1)
    exec(compile(code, str(readme), "exec"), {})
