"""CEL device selectors (DeviceClass and request selectors) evaluated as kube-scheduler does.

The DRA environment (``resource.k8s.io/v1``): one variable ``device`` with ``driver``,
``attributes[domain].name`` and ``capacity[domain].name`` (a quantity), where an unknown
domain is an empty map; Kubernetes' ``quantity()`` and ``semver()`` libraries as far as
selectors use them.  Evaluation is ``cel-python``'s, synchronous on the operator's event loop, so
only expressions of bounded cost are compiled: not too long, no comprehension macro and no
``matches`` (``UNBOUNDED``); the rest are left to kube-scheduler, which evaluates them under the
API server's cost limit; a placement pass spends at most a :class:`Budget` of time on them.  An expression that does not parse, names what the environment lacks, is
refused by its cost, or fails on a device (a missing attribute, as in Kubernetes) gives
:class:`Unknown` with the reason: the caller reports it, never crashes on it.  Pure.
"""

from __future__ import annotations

import dataclasses
import decimal
import functools
import re
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import celpy
from celpy import celtypes
from kubernetes.utils import quantity as k8s_quantity

from meshtrain.api import limits

_T = TypeVar("_T")

MAX_EXPRESSION_LENGTH = limits.MAX_EVALUATED_SELECTOR_LENGTH
"""Longest selector evaluated here (the API server allows ten times as long)."""
UNBOUNDED = re.compile(r"\b(all|exists|exists_one|map|filter|matches)\s*\(")
"""Calls whose cost the expression's length does not bound: the comprehension macros (nested,
they cost the product of their lists' sizes) and ``matches`` (Python's backtracking regular
expressions, where Kubernetes uses RE2).  Refused at compile time, so that evaluation costs at
most linear time in the expression's length."""
LEFT_TO_SCHEDULER = "left to kube-scheduler"
"""How an expression this evaluator refuses by its cost is described."""
MAX_REASON = 200
"""Characters of a library error kept in a reason."""


@dataclasses.dataclass(frozen=True)
class Unknown:
    """A selector whose value on a device cannot be known here."""

    expression: str
    """The selector, as written."""
    reason: str
    """Why: a parse error, an unsupported function, a runtime error (shortened)."""

    def describe(self) -> str:
        """``selector <expression>: <reason>`` (the expression shortened)."""
        shown = self.expression if len(self.expression) <= 80 else self.expression[:77] + "..."
        return f"selector {shown!r}: {self.reason}"


Verdict = bool | Unknown
"""A selector's value on one device."""


@functools.total_ordering
class _Ordered:
    """A value compared, ordered and hashed by its ``key``."""

    key: Any

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.key == other.key

    def __lt__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return bool(self.key < other.key)

    def __hash__(self) -> int:
        return hash(self.key)


class Quantity(_Ordered):
    """Kubernetes' CEL quantity: compared by value (``1Gi == 1024Mi``)."""

    def __init__(self, value: decimal.Decimal) -> None:
        self.key = value


class Semver(_Ordered):
    """Kubernetes' CEL semver (``version`` attributes): major, minor, patch; a pre-release is lower."""

    PATTERN = re.compile(
        r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-([0-9A-Za-z.-]+))?(?:\+[0-9A-Za-z.-]+)?$"
    )

    def __init__(self, text: str) -> None:
        found = self.PATTERN.match(text)
        if found is None:
            raise ValueError(f"not a semantic version: {text!r}")
        major, minor, patch, pre = found.groups()
        self.key = (int(major), int(minor), int(patch), pre is None, pre or "")


class _Domains(celtypes.MapType):
    """``device.attributes`` / ``device.capacity``: an unknown domain is an empty map (Kubernetes)."""

    def __getitem__(self, key: Any) -> Any:
        if key in self.keys():
            return super().__getitem__(key)
        return celtypes.MapType({})


def _quantity(text: Any) -> Quantity:
    return Quantity(k8s_quantity.parse_quantity(str(text)))


def _compare(left: Any, right: Any) -> celtypes.IntType:
    if type(left) is not type(right) or not isinstance(left, _Ordered):
        raise TypeError(f"cannot compare {type(left).__name__} with {type(right).__name__}")
    return celtypes.IntType(0 if left == right else (-1 if left < right else 1))


def _is_quantity(text: Any) -> celtypes.BoolType:
    try:
        _quantity(text)
    except (ValueError, decimal.InvalidOperation):
        return celtypes.BoolType(False)
    return celtypes.BoolType(True)


FUNCTIONS: Mapping[str, Any] = {
    "quantity": _quantity,
    "isQuantity": _is_quantity,
    "semver": lambda text: Semver(str(text)),
    "compareTo": _compare,
    "isGreaterThan": lambda a, b: celtypes.BoolType(_compare(a, b) > 0),
    "isLessThan": lambda a, b: celtypes.BoolType(_compare(a, b) < 0),
    "asInteger": lambda q: celtypes.IntType(int(q.key)),
    "asApproximateFloat": lambda q: celtypes.DoubleType(float(q.key)),
    "isInteger": lambda q: celtypes.BoolType(q.key == q.key.to_integral_value()),
    "sign": lambda q: celtypes.IntType((q.key > 0) - (q.key < 0)),
    "major": lambda v: celtypes.IntType(v.key[0]),
    "minor": lambda v: celtypes.IntType(v.key[1]),
    "patch": lambda v: celtypes.IntType(v.key[2]),
}
"""What the Kubernetes CEL libraries add that DRA selectors use (quantity, semver)."""


def _attribute(value: Mapping[str, Any]) -> Any:
    """A ResourceSlice attribute (``{"string": ...}``, ``int``, ``bool``, ``version``) as CEL."""
    if "bool" in value:
        return celtypes.BoolType(bool(value["bool"]))
    if "int" in value:
        return celtypes.IntType(int(value["int"]))
    if "version" in value:
        return Semver(str(value["version"]))
    return celtypes.StringType(str(value.get("string", "")))


def activation(
    driver: str,
    attributes: Mapping[str, Mapping[str, Mapping[str, Any]]],
    capacity: Mapping[str, Mapping[str, str]],
) -> dict[str, Any]:
    """The ``device`` variable of one device: attributes and capacity by domain, then name."""
    attrs = {
        celtypes.StringType(domain): celtypes.MapType(
            {celtypes.StringType(n): _attribute(v) for n, v in names.items()}
        )
        for domain, names in attributes.items()
    }
    caps = {
        celtypes.StringType(domain): celtypes.MapType(
            {celtypes.StringType(n): _quantity(v) for n, v in names.items()}
        )
        for domain, names in capacity.items()
    }
    return {
        "device": celtypes.MapType(
            {
                celtypes.StringType("driver"): celtypes.StringType(driver),
                celtypes.StringType("attributes"): _Domains(attrs),
                celtypes.StringType("capacity"): _Domains(caps),
            }
        )
    }


def _short(err: BaseException) -> str:
    text = str(err.args[0]) if err.args else type(err).__name__
    text = text.splitlines()[0] if text else type(err).__name__
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


@functools.lru_cache(maxsize=1024)
def compile_selector(expression: str) -> Any:
    """The program of ``expression``, or an :class:`Unknown` when it cannot be compiled here."""
    if len(expression) > MAX_EXPRESSION_LENGTH:
        return Unknown(
            expression, f"longer than {MAX_EXPRESSION_LENGTH} characters: {LEFT_TO_SCHEDULER}"
        )
    found = UNBOUNDED.search(expression)
    if found is not None:
        return Unknown(
            expression, f"calls {found.group(1)}(), of unbounded cost: {LEFT_TO_SCHEDULER}"
        )
    environment = celpy.Environment()
    try:
        return environment.program(environment.compile(expression), functions=dict(FUNCTIONS))
    except Exception as err:  # noqa: BLE001 - the library raises many kinds; each is an answer
        return Unknown(expression, f"does not compile: {_short(err)}")


class Budget:
    """The CEL evaluation time one placement pass may still spend (:data:`limits.MAX_CEL_SECONDS_PER_PASS`).

    A pass judges every node's devices synchronously on the operator's event loop; the compile-time
    bounds cap one selector's cost and the per-node character budget one node's, but not the sum
    over thousands of nodes whose devices differ in what the selectors read.  Evaluations are timed
    (the process's own clock: no I/O) and, once the budget is spent, the nodes not judged yet are
    left to kube-scheduler.
    """

    def __init__(self, seconds: float = limits.MAX_CEL_SECONDS_PER_PASS) -> None:
        self.seconds = seconds
        """What the pass may spend."""
        self.used = 0.0
        """What it spent so far."""

    @property
    def spent(self) -> bool:
        """Whether no more evaluation may start."""
        return self.used >= self.seconds

    def timed(self, call: Callable[[], _T]) -> _T:
        """``call()``, its time charged to the budget."""
        started = time.perf_counter()
        try:
            return call()
        finally:
            self.used += time.perf_counter() - started


def evaluate(expression: str, device: Mapping[str, Any]) -> Verdict:
    """The selector's value on the device (an :func:`activation`); a non-boolean is an error."""
    program = compile_selector(expression)
    if isinstance(program, Unknown):
        return program
    try:
        value = program.evaluate(device)
    except Exception as err:  # noqa: BLE001 - CELEvalError and anything a function raised
        return Unknown(expression, f"cannot be evaluated: {_short(err)}")
    if isinstance(value, Exception):  # celpy may return its error value instead of raising it
        return Unknown(expression, f"cannot be evaluated: {_short(value)}")
    if not isinstance(value, celtypes.BoolType | bool):
        return Unknown(expression, f"is not a boolean ({type(value).__name__})")
    return bool(value)
