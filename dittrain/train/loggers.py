"""Where a run's figures go: metrics.jsonl always, TensorBoard and Weights & Biases on request.

    --logger tensorboard,wandb,jsonl -> open_loggers(...) -> [JsonlLogger, TensorBoardLogger, WandbLogger]

LOGGER_TABLE names each logger (the --logger spellings, dittrain.config.LOGGERS). Every logger
is opened by its class's `start` (None, after a note, where it cannot start here) and has the
same three calls, made by rank 0 only (dittrain.train.log.Log):

    Logger.start(out, config=, resumed=, project=, name=, note=)   the run directory `out`
    scalars(step, {"train/loss": 0.12, ...})   tags are GROUP/NAME (train/*, eval/*, val/*)
    image(step, tag, uint8 array (H, W, 3))     the EMA sample grids
    close()

metrics.jsonl is the run's own record (`dittrain runs` and the resume logic read it), so it
is kept whatever --logger says; its lines are flat ({"step": 3, "loss": ...}: the group is
dropped, except val/*'s: val_loss, ..., KEEP_GROUP). Weights & Biases is a convenience that
never stops or stalls a run: a short init timeout, and a failed init or log call is one
note, after which the run goes on without it. It honours WANDB_MODE (offline: everything stays under RUN/wandb/, `wandb sync` uploads it
later; disabled: nothing) and W&B's own variables: a --wandb-project / --wandb-name flag wins,
else WANDB_PROJECT / WANDB_NAME, else ditkit's defaults (project "ditkit", the run folder's
name); WANDB_DIR, WANDB_RUN_ID and WANDB_RESUME, where set, replace RUN/, the kept id and
resume="allow". A resumed run continues the same W&B run: the id it used (its own or
WANDB_RUN_ID) is kept in RUN/wandb_id.txt.
"""

from __future__ import annotations

import json
import os
import secrets
import string
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ditdata.common import files
from ditdata.common.errors import UserError, described
from ditdata.common.extras import install_hint, require
from dittrain.config import LOGGERS

WANDB_ID = "wandb_id.txt"  # in the run directory
WANDB_INIT_TIMEOUT = 20.0  # seconds (wandb's own default is 90); $WANDB_INIT_TIMEOUT overrides it
# The project when neither --wandb-project nor WANDB_PROJECT names one (wandb's own would be
# "uncategorized"); the config's default ("") is "not given".
WANDB_DEFAULT_PROJECT = "ditkit"


class LoggerError(UserError, ValueError):
    """--logger names a logger that does not exist or is not installed (one line)."""


def parse_loggers(spec: str) -> list[str]:
    """'tensorboard,wandb' -> ['jsonl', 'tensorboard', 'wandb'] (jsonl always, first; each
    once); LoggerError for an unknown name or wandb without the wandb extra."""
    names = ["jsonl"]
    for name in (s.strip().lower() for s in spec.split(",")):
        if name and name not in LOGGERS:
            raise LoggerError(f"--logger {spec}: unknown logger {name!r}; choose from {', '.join(LOGGERS)}")
        if name and name not in names:
            names.append(name)
    if "wandb" in names:
        require("wandb", "--logger wandb", "wandb", LoggerError)
    return names


def open_loggers(spec: str, out: Path, *, config: dict, resumed: bool, wandb_project: str, wandb_name: str,
                 note: Callable[[str], None]) -> list:
    """The loggers --logger asks for, writing into the run directory `out`. A logger that
    cannot start here (TensorBoard not installed, W&B init failed) is a note, not an error."""
    opened = (LOGGER_TABLE[name].start(out, config=config, resumed=resumed, project=wandb_project, name=wandb_name,
                                       note=note) for name in parse_loggers(spec))
    return [logger for logger in opened if logger is not None]


# groups whose metrics.jsonl names keep the group ("val/loss" -> "val_loss"): a validation record's loss must not
# read as a training record's ("loss" is what makes a record a training one: dittrain.train.runs)
KEEP_GROUP = ("val",)


def _flat(tag: str) -> str:
    """A tag's name in metrics.jsonl: GROUP/NAME -> NAME, or GROUP_NAME for the KEEP_GROUP groups."""
    group, _, name = tag.rpartition("/")
    return f"{group}_{name}" if group in KEEP_GROUP else name


class JsonlLogger:
    """metrics.jsonl: one flat JSON record per scalars() call (tags lose their group)."""

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def start(cls, out: Path, **_) -> JsonlLogger:
        return cls(out / "metrics.jsonl")

    def scalars(self, step: int, values: dict) -> None:
        rec = {"step": step, **{_flat(tag): v for tag, v in values.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def image(self, step: int, tag: str, image: np.ndarray) -> None:
        pass  # the grids themselves are RUN/samples/step_N.png

    def close(self) -> None:
        pass


class TensorBoardLogger:
    """RUN/tensorboard/ event files: the scalars and the grids (add_image, HWC)."""

    def __init__(self, logdir: Path):
        from torch.utils.tensorboard import SummaryWriter  # ImportError without the [train] extra

        self.writer = SummaryWriter(str(logdir))

    @classmethod
    def start(cls, out: Path, *, note: Callable[[str], None], **_) -> TensorBoardLogger | None:
        try:
            return cls(out / "tensorboard")
        except ImportError:
            note(f"note: TensorBoard is not installed ({install_hint('train')}); no TensorBoard logs")
            return None

    def scalars(self, step: int, values: dict) -> None:
        for tag, v in values.items():
            if not isinstance(v, str):  # text (a bucketed run's batch_shape) is metrics.jsonl's
                self.writer.add_scalar(tag, v, step)

    def image(self, step: int, tag: str, image: np.ndarray) -> None:
        self.writer.add_image(tag, image, step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A Weights & Biases run in RUN/wandb/; `start` returns None (after a note) when it
    cannot start, and the first failed call afterwards is a note and turns it off."""

    def __init__(self, run, note: Callable[[str], None]):
        self.run, self.note = run, note

    @classmethod
    def start(cls, out: Path, *, config: dict, resumed: bool, project: str | None, name: str | None,
              note: Callable[[str], None]) -> WandbLogger | None:
        """A W&B run for the run directory `out` (None after a note where it cannot start);
        `project` and `name` are the flags' values ("" or None: not given)."""
        import wandb

        id_file = out / WANDB_ID
        timeout = float(os.environ.get("WANDB_INIT_TIMEOUT") or WANDB_INIT_TIMEOUT)
        try:
            run = wandb.init(config=config, **wandb_init_args(out, project=project, name=name, resumed=resumed),
                             settings=wandb.Settings(init_timeout=timeout, console="off", silent=True))
        except Exception as e:  # unreachable service, no API key, ...: the run goes on without W&B
            note(f"note: wandb did not start ({_reason(e)}); training goes on without it")
            return None
        if run.disabled:  # WANDB_MODE=disabled
            run.finish()
            note("note: WANDB_MODE=disabled: no wandb logs")
            return None
        run_id = run.id  # WANDB_RUN_ID's where it is set: kept, so that a resume without it goes on
        files.write_text_atomic(id_file, run_id + "\n")
        where = f"offline, in {Path(run.dir).parent}: `wandb sync` uploads it" if run.offline else run.url
        note(f"dittrain: wandb run {run_id} ({where})")
        return cls(run, note)

    def scalars(self, step: int, values: dict) -> None:
        self._log(step, values)

    def image(self, step: int, tag: str, image: np.ndarray) -> None:
        import wandb

        if self.run is not None:
            self._log(step, {tag: wandb.Image(image)})

    def _log(self, step: int, data: dict) -> None:
        # a resumed run re-logs the steps past its checkpoint; W&B keeps the ones it has
        if self.run is None or step < self.run.step:
            return
        try:
            self.run.log(data, step=step)
        except Exception as e:
            self.note(f"note: wandb logging failed ({_reason(e)}); training goes on without it")
            self.run = None

    def close(self) -> None:
        run, self.run = self.run, None
        if run is not None:
            try:
                run.finish()
            except Exception as e:
                self.note(f"note: wandb did not finish cleanly ({_reason(e)}); its files are in {run.dir}")


def wandb_init_args(out: Path, *, project: str | None, name: str | None, resumed: bool) -> dict:
    """wandb.init's project, name, dir, id and resume. Each is passed only where the user gave
    it (a flag) or W&B's own variable for it is unset, so WANDB_PROJECT, WANDB_NAME, WANDB_DIR,
    WANDB_RUN_ID and WANDB_RESUME work as W&B documents them (an argument would override them).
    Where neither names one: the project WANDB_DEFAULT_PROJECT, the run folder's name, RUN/
    (its wandb/ folder), the id kept in RUN/wandb_id.txt on a resume (a new one otherwise),
    and resume="allow", so that a resumed run continues the same W&B run."""
    def unset(var: str) -> bool:
        return not os.environ.get(var)

    args = {}
    if project:
        args["project"] = project
    elif unset("WANDB_PROJECT"):
        args["project"] = WANDB_DEFAULT_PROJECT
    if name:
        args["name"] = name
    elif unset("WANDB_NAME"):
        args["name"] = out.resolve().name
    if unset("WANDB_DIR"):
        args["dir"] = str(out)
    if unset("WANDB_RUN_ID"):
        id_file = out / WANDB_ID
        kept = id_file.read_text().strip() if resumed and id_file.is_file() else ""
        args["id"] = kept or "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    if unset("WANDB_RESUME"):
        args["resume"] = "allow"
    return args


def _reason(e: BaseException) -> str:
    return described(e) if str(e).strip() else type(e).__name__


# --logger's names -> the logger classes (a new logger: a class with start/scalars/image/close, one
# entry here and its name in dittrain.config.LOGGERS, which --help lists without importing this)
LOGGER_TABLE = {"jsonl": JsonlLogger, "tensorboard": TensorBoardLogger, "wandb": WandbLogger}
assert tuple(LOGGER_TABLE) == LOGGERS
