"""scripts/chart-docs.py: the chart README's values table comes from values.yaml and stays fresh."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "meshtrain"


def _script() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("chart_docs", ROOT / "scripts" / "chart-docs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


docs = _script()


def test_the_readme_table_is_what_values_yaml_generates() -> None:
    assert docs.main(["--check"]) == 0, "run make chart-docs"


def test_every_value_is_a_row_or_inside_a_documented_map() -> None:
    rows = {row.path for row in docs.documented_keys((CHART / "values.yaml").read_text())}

    def leaves(node: object, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
        if isinstance(node, dict) and node:
            return [leaf for key, sub in node.items() for leaf in leaves(sub, (*path, key))]
        return [path]

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for leaf in leaves(values):
        assert any(leaf[:i] in rows for i in range(1, len(leaf) + 1)), leaf
    readme = (CHART / "README.md").read_text()
    assert '| `image.tag` | string | `""` |' in readme
    assert "| `replicaCount` | int | `1` |" in readme


def test_a_key_without_a_description_is_refused_naming_its_line() -> None:
    text = "# -- Documented.\na: 1\n# -- Image.\nimage:\n  # -- The tag.\n  tag: x\n  pullPolicy: Always\n"
    with pytest.raises(docs.DocsError, match=r"values.yaml:7: image.pullPolicy has no `# --`"):
        docs.documented_keys(text)


def test_a_documented_map_shows_its_whole_default_and_continuation_lines_join() -> None:
    text = (
        "# -- Selector of the pods,\n# on two lines.\nselector:\n  app.kubernetes.io/name: x\n"
        "# -- Parent.\nparent:\n  # -- Child | with a pipe.\n  child: [1, 2]\n"
    )
    table = docs.table(text)
    assert (
        '| `selector` | object | `{"app.kubernetes.io/name": "x"}` | Selector of the pods, on two lines. |'
        in table
    )
    assert "| `parent` | object |  | Parent. |" in table
    assert "| `parent.child` | list | `[1, 2]` | Child \\| with a pipe. |" in table


def test_a_stale_table_fails_the_check(tmp_path: pathlib.Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# chart\n\n{docs.BEGIN}\n| old |\n{docs.END}\nafter\n")
    values = tmp_path / "values.yaml"
    values.write_text("# -- Replicas.\nreplicaCount: 1\n")
    assert docs.main(["--check", "--readme", str(readme), "--values", str(values)]) == 1
    assert docs.main(["--readme", str(readme), "--values", str(values)]) == 0
    assert docs.main(["--check", "--readme", str(readme), "--values", str(values)]) == 0
    assert readme.read_text().endswith(
        f"| `replicaCount` | int | `1` | Replicas. |\n{docs.END}\nafter\n"
    )
