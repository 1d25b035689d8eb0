"""The files a TrainingJob names on this machine, checked as ``meshtrain validate`` checks them.

A spec serves two places: ``meshtrain run`` reads its paths on this machine, a cluster's pods read
them inside the pod (a volume mounted at ``/data``), so a path missing here may be fine there.
The rule (docs/cli.md): a relative path or one starting with ``~`` can only mean this machine
and is always checked (relative to the working directory, as ``meshtrain run`` reads it); an
absolute path is checked with ``--local`` (the spec is for ``meshtrain run``), and otherwise only
where it exists here; an ``s3://`` URL is never read.  A ``model.init.fromHF`` directory that is
checked gets the same torch-free checks ``meshtrain run`` makes (:mod:`.hf_directory`).
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
from pathlib import Path

from meshtrain.api import hf_config, hf_directory, limits, rules
from meshtrain.api import spec as api_spec
from meshtrain.api.spec import urls

STDLIB = "stdlib"
"""``training.dataset``'s built-in corpus: no file."""


@dataclasses.dataclass(frozen=True)
class Named:
    """A path the spec names."""

    field: str
    """Its YAML field, e.g. ``spec.training.datasets[1].path``."""
    path: str
    """The path (or glob) as written."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the check found."""

    job: api_spec.TrainingJobSpec
    """The job, completed from its ``fromHF`` directory's ``config.json`` where that was checked."""
    problems: list[rules.Problem]
    """Missing files, and a ``fromHF`` directory that does not fit the spec."""
    unchecked: list[Named]
    """Absolute paths that are not on this machine and were not checked (no ``--local``)."""


def dataset_paths(job: api_spec.TrainingJobSpec) -> list[Named]:
    """Every token file or glob ``job`` trains or evaluates on (the built-in corpus left out)."""
    training = job.training
    named = [
        Named(f"spec.training.datasets[{i}].path", source.path)
        for i, source in enumerate(training.datasets)
        if source.path != STDLIB
    ]
    if not training.datasets and training.dataset != STDLIB:
        named.append(Named("spec.training.dataset", training.dataset))
    if training.eval.dataset:
        named.append(Named("spec.training.eval.dataset", training.eval.dataset))
    return named


def is_this_machines(path: str, local: bool) -> bool:
    """Whether ``path`` names this machine's file: relative or ``~`` always, absolute with ``local``
    or where it exists here; an ``s3://`` URL never."""
    if urls.is_url(path):
        return False
    if local or path.startswith("~") or not Path(path).is_absolute():
        return True
    return Path(path).exists() if not glob.has_magic(path) else _first_match(path) is not None


def _first_match(pattern: str) -> Path | None:
    """The first file a glob matches, walking at most MAX_PATH_MATCHES names."""
    for name in itertools.islice(glob.iglob(pattern), limits.MAX_PATH_MATCHES):
        if Path(name).is_file():
            return Path(name)
    return None


def _missing(named: Named) -> rules.Problem | None:
    """A problem when ``named`` matches no file here (the path quoted whole: the spec bounds it)."""
    expanded = str(Path(named.path).expanduser())
    where = "" if Path(expanded).is_absolute() else f" (relative to {Path.cwd()})"
    if glob.has_magic(expanded):
        if _first_match(expanded) is None:
            return rules.Problem(
                path=named.field,
                message=f"the glob {named.path!r} matches no file on this machine{where}",
            )
        return None
    if Path(expanded).is_file():
        return None
    what = "is a directory, not a token file" if Path(expanded).is_dir() else "does not exist"
    return rules.Problem(
        path=named.field,
        message=f"token file {named.path!r} {what}{where}: prepare it with "
        "meshtrain data prepare, fix the path, or use an s3:// URL",
    )


def _from_hf(
    job: api_spec.TrainingJobSpec, directory: Path
) -> tuple[api_spec.TrainingJobSpec, list[rules.Problem]]:
    """``job`` completed from ``directory`` and the problem :func:`.hf_directory.check_spec` finds."""
    try:
        return hf_directory.check_spec(job, directory), []
    except hf_config.HFError as err:
        message = str(err).removeprefix(f"{hf_config.FIELD}: ")
        return job, [rules.Problem(path=hf_config.FIELD, message=message)]


def check(job: api_spec.TrainingJobSpec, *, local: bool) -> Verdict:
    """Check the paths of ``job`` that name this machine's files (``local``: every path not a URL)."""
    problems: list[rules.Problem] = []
    unchecked: list[Named] = []
    for named in dataset_paths(job):
        if not is_this_machines(named.path, local):
            unchecked += [] if urls.is_url(named.path) else [named]
            continue
        problem = _missing(named)
        problems += [problem] if problem else []
    from_hf = job.model.init.from_hf
    if from_hf and is_this_machines(from_hf, local):
        job, found = _from_hf(job, Path(from_hf).expanduser())
        problems += found
    elif from_hf and not urls.is_url(from_hf):
        unchecked.append(Named(hf_config.FIELD, from_hf))
    return Verdict(job=job, problems=problems, unchecked=unchecked)
