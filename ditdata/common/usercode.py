"""Code and weights the user brings (a `python:MODULE:FUNCTION` feature encoder, a model folder,
an aesthetic predictor file; captioners, text encoders and RAE encoders as they land) are
hostile input like any file: this is the one place their calls and their outputs pass through.

    out = user_call("--encoder SPEC", net, x)    # its exception -> UserCodeError, one line:
                                                 # "--encoder SPEC: its forward raised ExcType: msg"
    check_output(out, source="--encoder SPEC", field="feat", keys=keys, shard="00003",
                 shape=(256, 768))               # floating, (N, *shape), every value finite
    check_weights(state_dict, "--aesthetic FILE")   # weights loaded from the user's files: finite
    mod = import_user_module("enc.py", "--encoder SPEC", "ditkit_encoder", DitdataError)
                                                 # a module name or a .py file; its failure -> one line

Why a failure inside such code is the user's, not a bug of ours: the message then names the
code that raised and its exception, where "internal error ... please report it" would send
the user to us. Out of memory is left alone (ditdata.common.cli reports it as such), and so is
a UserError the code raises itself. DITKIT_DEBUG=1 shows the traceback (the cause is chained).

Why outputs are checked before anything is stored: a NaN that reaches an int8 quantizer or a
float16 array is stored as a plausible value (zeros, inf) and trains a model on it without a
word. check_output stops the command on the first batch holding one, naming the source, the
shard and the first sample key; the caller has written nothing of that shard, so a rerun
after a fix resumes from it.

Light at import time: torch is only looked at (sys.modules), never imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ditdata.common.errors import UserError, described
from ditdata.common.memory import is_out_of_memory


class UserCodeError(UserError):
    """Code or weights the user supplied failed or gave unusable output; the message names them."""


PYTHON_PREFIX = "python:"  # a loader name that is user code: python:MODULE:FUNCTION


def user_function(spec: str, label: str, prefix: str, error: type[Exception] = UserError):
    """(its module, FUNCTION's name, the function) of a `python:MODULE:FUNCTION` spec, the module
    imported as import_user_module does; a malformed spec or a missing function is `error`
    "LABEL: ..." in one line."""
    module, sep, fn_name = spec[len(PYTHON_PREFIX):].rpartition(":")
    if not sep or not module or not fn_name:
        raise error(f"{label}: expected python:MODULE:FUNCTION (MODULE a module name or a .py file)")
    mod = import_user_module(module, label, prefix, error)
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise error(f"{label}: {module} has no function {fn_name}")
    return mod, fn_name, fn


def import_user_module(module: str, label: str, prefix: str, error: type[Exception] = UserError):
    """The module of a `python:MODULE:FUNCTION` spec: MODULE a dotted name on sys.path, or a path
    to a .py file, imported as PREFIX_STEM (the prefix keeps two kinds' files of the same name,
    a captioner's and an encoder's, from replacing each other in sys.modules). Any failure is
    `error` "LABEL: cannot import MODULE (ExcType: msg)", or "LABEL: no such file PATH"; an
    `error` the module raises itself passes through."""
    try:
        if module.endswith(".py"):
            path = Path(module).expanduser().resolve()
            if not path.is_file():
                raise error(f"{label}: no such file {path}")
            spec = importlib.util.spec_from_file_location(f"{prefix}_{path.stem}", path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod
            spec.loader.exec_module(mod)
            return mod
        return importlib.import_module(module)
    except error:
        raise
    except Exception as e:
        raise error(f"{label}: cannot import {module} ({described(e)})") from e


def user_call(source: str, fn: Callable, *args, what: str = "its forward", **kwargs) -> Any:
    """fn(*args, **kwargs), its exception re-raised as UserCodeError "SOURCE: its forward raised
    ExcType: msg" (module docstring); out of memory and UserErrors pass through unchanged."""
    try:
        return fn(*args, **kwargs)
    except UserError:
        raise
    except Exception as e:
        if isinstance(e, MemoryError) or is_out_of_memory(e):
            raise
        raise UserCodeError(f"{source}: {what} raised {described(e)}") from e


def check_output(x, *, source: str, keys: Sequence | None = None, shard: str | None = None,
                 field: str | None = None, shape: tuple[int, ...] | None = None, then: str = "") -> None:
    """UserCodeError unless `x` (a torch tensor or numpy array of N samples) is floating, of
    shape (N, *shape) when `shape` is given (N = len(keys) when keys are given), and finite in
    every value. The message names `source`, the `field`, the `shard` and the first bad
    sample's key (or row), then says `then` (what became of the output: "; nothing was stored")."""
    what = f"{field} " if field else ""
    where = f" of shard {shard}" if shard is not None else ""
    dtype = getattr(x, "dtype", None)
    floating = (x.is_floating_point() if hasattr(x, "is_floating_point")
                else isinstance(x, np.ndarray) and np.issubdtype(x.dtype, np.floating))
    if not floating:
        got = f"a {type(x).__name__} of {dtype}" if dtype is not None else f"a {type(x).__name__}"
        raise UserCodeError(f"{source}: returned {what}as {got}{where}; expected floating-point values{then}")
    n = len(keys) if keys is not None else None
    if shape is not None:
        want = ((n if n is not None else int(x.shape[0])), *shape)
        if tuple(x.shape) != tuple(want):
            raise UserCodeError(f"{source}: returned {what}of shape {tuple(x.shape)}{where}, expected "
                                f"{tuple(want)}{then}")
    if not len(x):
        return
    if hasattr(x, "detach") and x.device.type != "cpu":  # tested on its device: only the (N,) verdict comes back
        bad = (~x.detach().reshape(len(x), -1).isfinite().all(dim=1)).cpu().numpy()
    else:  # numpy's isfinite is ~20x torch's on one CPU thread (64 x 256 x 768: 3 ms against 63)
        x = x.detach().float().numpy() if hasattr(x, "detach") else x
        bad = ~np.isfinite(np.asarray(x, dtype=np.float32).reshape(len(x), -1)).all(axis=1)
    if bad.any():
        first = int(np.argmax(bad))
        key = f"key {list(keys)[first]!r}" if keys is not None else f"row {first}"
        raise UserCodeError(f"{source}: gave non-finite {what}values (NaN/inf) for {int(bad.sum())} of {len(x)} "
                            f"sample(s){where}, the first {key}{then}")


def check_weights(tensors, source: str) -> None:
    """UserCodeError when a state dict the user supplied (name -> torch tensor or numpy array)
    holds NaN or inf: every output computed from it would be non-finite, so it is refused when
    it is loaded, naming the first such tensor, rather than when the first batch is checked."""
    bad = []
    for name, t in tensors.items():
        floating = t.is_floating_point() if hasattr(t, "is_floating_point") else np.issubdtype(t.dtype, np.floating)
        if floating and not (t.isfinite().all() if hasattr(t, "isfinite") else np.isfinite(t).all()):
            bad.append(name)
    if bad:
        raise UserCodeError(f"{source}: its weights hold non-finite values (NaN/inf) in {len(bad)} of "
                            f"{len(tensors)} tensors, the first {bad[0]!r}; they are damaged or come from a "
                            "training run that diverged")


__all__ = ["UserCodeError", "check_output", "check_weights", "import_user_module", "user_call"]
