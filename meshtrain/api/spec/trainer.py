"""``spec.trainer``: which program the pods run (meshtrain's trainer or the user's own PyTorch
program), and its rule."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from meshtrain.api.spec import base


class TrainerProgram(base.SpecModel):
    """Which program the pods run: meshtrain's trainer, or the user's own PyTorch program.

    A custom program runs in ``spec.image`` with the same placement, gang, restarts, checkpoint
    volume and environment: ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``,
    ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT`` make a plain ``torchrun train.py`` join the gang.
    """

    type: Literal["builtin", "custom"] = Field(
        "builtin",
        description="builtin: meshtrain's trainer (model, training, parallelism sections); "
        "custom: the command below, launched one pod per node slot like the built-in trainer.",
    )
    command: list[Annotated[str, Field(max_length=4096, description="An argument.")]] = Field(
        default_factory=list,
        max_length=64,
        description="custom: the container command, e.g. [torchrun, /app/train.py]; torchrun "
        "reads the gang's size, rank and rendezvous address from PET_* variables.",
    )
    args: list[Annotated[str, Field(max_length=4096, description="An argument.")]] = Field(
        default_factory=list, max_length=256, description="custom: arguments after the command."
    )
    working_dir: str | None = Field(
        None, max_length=4096, description="custom: working directory of the container."
    )
    progress_port: int | None = Field(
        None,
        ge=1024,
        le=65535,
        description="custom: port on which the program's global rank 0 serves meshtrain's progress "
        "document (GET /progress, a JSON object of at most 4 KiB: step, loss, tokens_per_second, "
        "last_checkpoint_step, updated_at); the operator stores it in status.progress.  Unset: the "
        "operator does not poll the program.",
    )


def _custom_trainer_command(program: TrainerProgram) -> str | None:
    if program.type == "custom" and not program.command:
        return (
            "trainer.type is custom but trainer.command is empty: give the program to run, e.g. "
            "[torchrun, /app/train.py] (torchrun reads the gang from the PET_* variables)"
        )
    if program.type == "builtin" and (program.command or program.args or program.working_dir):
        return (
            "trainer.command, args and workingDir are for trainer.type custom; the built-in trainer "
            "is configured by the model, training and parallelism sections: remove them or set "
            "trainer.type: custom"
        )
    return None


def _custom_progress_port(program: TrainerProgram) -> str | None:
    if program.progress_port is not None and program.type != "custom":
        return (
            f"trainer.progressPort={program.progress_port} is for trainer.type custom; the built-in "
            "trainer serves its progress on metrics.port: remove trainer.progressPort"
        )
    return None


RULES: tuple[base.Rule[TrainerProgram], ...] = (
    base.Rule(
        "custom-trainer-command",
        "spec.trainer.command",
        "self.trainer.type == 'custom' ? size(self.trainer.command) > 0 : "
        "(size(self.trainer.command) == 0 && size(self.trainer.args) == 0 && !has(self.trainer.workingDir))",
        "trainer.type custom needs trainer.command; trainer.command, args and workingDir are only "
        "for trainer.type custom",
        _custom_trainer_command,
    ),
    base.Rule(
        "custom-trainer-progress-port",
        "spec.trainer.progressPort",
        "!has(self.trainer.progressPort) || self.trainer.type == 'custom'",
        "trainer.progressPort is only for trainer.type custom (the built-in trainer serves its "
        "progress on metrics.port)",
        _custom_progress_port,
    ),
)
