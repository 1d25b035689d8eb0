"""Every query of every dashboard filters by the namespace variable, selector by selector.

No PromQL parser is installed, so :func:`selectors` scans the expression: it skips strings, range
and subquery brackets, the label lists of ``by``/``without``/``on``/``ignoring``/``group_*`` and
function or aggregation names (an identifier before ``(``, or an aggregation before its ``by``),
and returns every remaining metric selector with its matchers.  An unfiltered selector anywhere in
a query (inside a function, either side of a binary operation, a subquery) fails the test.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((REPO / "dashboards").glob("*.json"))
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
KEYWORDS |= {"and", "or", "unless", "atan2", "inf", "nan"}
LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
OPERATOR_ROW = "Operator"
"""The operator dashboard's row of the process's own series, filtered by ``$operator_namespace``."""


def _matcher(variable: str) -> re.Pattern[str]:
    return re.compile(rf'(^|,)\s*namespace\s*=~?\s*"\${variable}"\s*(,|$)')


NAMESPACE = _matcher("namespace")
TOKEN = re.compile(
    r'(?P<string>"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`)'
    r"|(?P<duration>[0-9]+(?:ms|[smhdwy])(?:[0-9]+(?:ms|[smhdwy]))*(?![A-Za-z0-9_]))"
    r"|(?P<number>(?:0x[0-9a-fA-F]+|[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?))"
    r"|(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)"
    r"|(?P<brace>\{)|(?P<bracket>\[)|(?P<paren>\()|(?P<other>\S)"
)


def _closing(expr: str, start: int, opening: str, closing: str) -> int:
    """Index just past the bracket that closes the one at ``start`` (strings skipped)."""
    depth, i = 0, start
    while i < len(expr):
        if expr[i] in "\"'`":
            i = TOKEN.match(expr, i).end()  # type: ignore[union-attr]
            continue
        depth += (expr[i] == opening) - (expr[i] == closing)
        i += 1
        if depth == 0:
            return i
    raise AssertionError(f"unbalanced {opening} in {expr}")


def selectors(expr: str) -> list[tuple[str, str]]:
    """(metric name or '', matchers text) of every vector selector in ``expr``."""
    found: list[tuple[str, str]] = []
    i, previous = 0, ""
    while i < len(expr):
        if expr[i].isspace():
            i += 1
            continue
        token = TOKEN.match(expr, i)
        assert token, expr[i:]
        kind, text, i = token.lastgroup, token.group(), token.end()
        if kind == "bracket":  # range, subquery step: durations and $__rate_interval
            i = _closing(expr, token.start(), "[", "]")
        elif kind == "paren" and previous in LABEL_LISTS:
            i = _closing(expr, token.start(), "(", ")")
        elif kind == "brace":  # a selector without a metric name: {__name__=~"..."}
            end = _closing(expr, token.start(), "{", "}")
            found.append(("", expr[i : end - 1]))
            i = end
        elif kind == "ident" and text not in KEYWORDS:
            rest = expr[i:].lstrip()
            if rest.startswith("(") or re.match(r"(by|without)\b", rest):
                pass  # a function or an aggregation
            elif rest.startswith("{"):
                start = expr.index("{", i)
                end = _closing(expr, start, "{", "}")
                found.append((text, expr[start + 1 : end - 1]))
                i = end
            else:
                found.append((text, ""))
        previous = text if kind == "ident" else ""
    return found


def unfiltered(expr: str, variable: str = "namespace") -> list[str]:
    """The selectors of ``expr`` without a ``namespace="$<variable>"`` (or ``=~``) matcher."""
    matcher = _matcher(variable)
    return [f"{name}{{{m}}}" for name, m in selectors(expr) if not matcher.search(m)]


def rows(board: dict) -> dict[str, str]:
    """Panel title -> title of the row it is under ("" above the first row)."""
    row, out = "", {}
    for panel in board["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
        out[panel["title"]] = row
    return out


def queries(board: dict) -> list[tuple[str, str, str]]:
    """(where, PromQL, the namespace variable it must filter by) of every panel target, annotation
    and template variable but the namespace ones: the operator dashboard's "Operator" row by
    ``operator_namespace``, everything else by ``namespace``."""
    row_of = rows(board)
    out = [
        (
            f"panel {p['title']!r} {t['refId']}",
            t["expr"],
            "operator_namespace" if row_of[p["title"]] == OPERATOR_ROW else "namespace",
        )
        for p in board["panels"]
        if p.get("meshtrainOptional") != "dcgm"
        for t in p["targets"]
    ]
    out += [
        (f"annotation {a['name']!r}", a["expr"], "namespace") for a in board["annotations"]["list"]
    ]
    for var in board["templating"]["list"]:
        if var["type"] == "query" and var["name"] not in ("namespace", "operator_namespace"):
            inner = re.fullmatch(r"label_values\((.*), \w+\)", var["definition"])
            assert inner, var["definition"]
            out.append((f"variable {var['name']}", inner.group(1), "namespace"))
    return out


def test_the_scan_finds_every_selector_and_only_selectors():
    expr = (
        'histogram_quantile(0.5, sum by (le, namespace) (rate(a_bucket{namespace="$namespace"}'
        "[$__rate_interval]))) / on (namespace) group_left () b + max_over_time(c[5m:1m]) "
        'or label_replace(d{x="y"}, "pod", "$1", "exported_pod", "(.+)") > bool 1e3 and '
        '{__name__=~"e|f", namespace=~"$namespace"} unless count(g offset 5m) or vector(0) * time()'
    )
    assert [name for name, _ in selectors(expr)] == ["a_bucket", "b", "c", "d", "", "g"]
    assert unfiltered(expr) == ["b{}", "c{}", 'd{x="y"}', "g{}"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_query_filters_by_namespace(path):
    board = json.loads(path.read_text())
    missing = [
        f"{where}: {bad} (wants ${variable})"
        for where, expr, variable in queries(board)
        for bad in unfiltered(expr, variable)
    ]
    assert not missing, "selectors without their namespace variable:\n" + "\n".join(missing)


def test_the_operator_row_holds_exactly_the_operators_own_series():
    """Process-wide series (up, the API's requests and errors, the re-plan counts and assumed
    pods, which carry no job label) carry the operator's namespace, the per-job ones the job's:
    each sits on the side of its own variable, and no per-job panel is filtered by the
    operator's namespace (a tenant's namespace would empty it)."""
    board = json.loads((REPO / "dashboards" / "meshtrain-operator.json").read_text())
    row_of = rows(board)
    own = re.compile(
        r"\b(up|meshtrain_operator_api_\w+|meshtrain_operator_replans_per_admission\w*"
        r"|meshtrain_operator_replan_admissions_total|meshtrain_operator_assumed_pods_expired_total)\{"
    )
    for panel in board["panels"]:
        for target in panel["targets"]:
            process_wide = bool(own.search(target["expr"]))
            assert process_wide == (row_of[panel["title"]] == OPERATOR_ROW), panel["title"]
    variables = {
        v["name"]: v["definition"] for v in board["templating"]["list"] if "definition" in v
    }
    assert (
        variables["operator_namespace"] == 'label_values(up{job="meshtrain-operator"}, namespace)'
    )
    assert "meshtrain_operator_jobs" not in variables["namespace"]


def test_dcgm_panels_keep_only_the_selected_namespace_through_the_join():
    """DCGM's own namespace is its exporter's: its series are joined on the job's filtered ones."""
    board = json.loads((REPO / "dashboards" / "meshtrain-training.json").read_text())
    dcgm = [p for p in board["panels"] if p.get("meshtrainOptional") == "dcgm"]
    assert dcgm
    for panel in dcgm:
        for target in panel["targets"]:
            expr = target["expr"]
            head, _, join = expr.partition(" and on (namespace, pod) ")
            assert join and not unfiltered(join), expr
            assert [name for name, _ in selectors(head)] == [
                re.search(r"DCGM_\w+", head).group()  # type: ignore[union-attr]
            ]
