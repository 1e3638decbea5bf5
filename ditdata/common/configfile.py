"""`--config FILE`: a command's options from a TOML, YAML or JSON file, and back (TOML).

The keys are the commands' own flag names without the dashes (`batch-size = 256`,
`flip = true` for `--flip/--no-flip`; `batch_size` is read too). A command whose options
come in sections (`dittrain run`: data, model, optim, ...) reads them from tables of those
names (`[optim]`); the others read top-level keys. The file's values become the command's
defaults (click's default_map), so a flag given on the command line wins over the file.
Every value is checked up front, before anything runs: an unknown key, a key in the wrong
table or a value of the wrong type is one line naming the key and the file.

A RECIPE file holds the settings of several commands: a top-level `[recipe]` table (what the
recipe is and where its values come from; no command reads it) marks it, and every other
top-level table is one command's settings, named after it (`[encode]`, `[features]`, `[run]`
with `[run.model]`, `[run.optim]`, ..., `[sample]`). Each command reads its own table and
leaves the others alone, so one file gives a published recipe from the pixels to the FID
samples (pipelines/configs/recipes/).

The file's kind is its suffix: `.toml` (stdlib tomllib), `.yaml`/`.yml` (PyYAML's safe loader,
with YAML 1.2's numbers: `1e-4` is a float, as in TOML and JSON, not the string YAML 1.1 makes
of it) or `.json`; the same keys and tables in each. A null (YAML `~`, JSON `null`) is a key left
at its default.

On the command line of a sectioned command, `--SECTION.KEY VALUE` (or `=VALUE`) is the same as
the key in the file's [SECTION] table (torchtitan's and LightningCLI's spelling: `dittrain run
--optim.lr 1e-4` is `--lr 1e-4`); an on/off flag takes `--SECTION.KEY`, `--SECTION.KEY true` or
`false`. A section or key that does not exist, or a key in another section, is one line
(`undotted`).

`to_toml` writes such a file back (`dittrain run --print-config`), and `given` says which
options were set by the user (on the command line or in the file) rather than defaulted:
what a resume compares with the run's record.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping
from pathlib import Path

import click
from click.core import ParameterSource

CONFIG_OPTION = "config"  # the parameter name of --config (never itself a key of the file)


def key_of(param: click.Parameter) -> str:
    """The file key of an option: its first long flag without the dashes (`--batch-size` ->
    `batch-size`; `--flip/--no-flip` -> `flip`)."""
    longs = [o for o in param.opts if o.startswith("--")]
    return longs[0][2:] if longs else param.name.replace("_", "-")


def _options(command: click.Command) -> dict[str, click.Option]:
    """key (and its underscore spelling) -> option, for the options a file may set."""
    found: dict[str, click.Option] = {}
    for p in command.params:
        if isinstance(p, click.Option) and p.name != CONFIG_OPTION and not p.is_eager:
            found[key_of(p)] = p
            found.setdefault(key_of(p).replace("-", "_"), p)
    return found


def _bad(path: Path, key: str, why: str) -> click.BadParameter:
    return click.BadParameter(f"{path}: {key}: {why}", param_hint="'--config'")


class OneOrMany(click.Option):
    """A repeatable option whose key in a file takes one value or a list of them (`dittrain run`'s
    --latents: `latents = "STORE"`, as files wrote it before stores could be mixed, or a list)."""


def _check_type(path: Path, key: str, param: click.Option, value):
    """The TOML value, as what the option takes (a list of them for a repeatable option)."""
    if isinstance(value, dict):
        raise _bad(path, key, "a table where a value belongs")
    if param.multiple:
        if not isinstance(value, list) and isinstance(param, OneOrMany) and not isinstance(value, dict | bool):
            value = [value]
        if not isinstance(value, list):
            raise _bad(path, key, f"takes a list, e.g. {key} = [\"a\", \"b\"], not {value!r}")
        return [_check_one(path, key, param, v) for v in value]
    if isinstance(value, list):
        raise _bad(path, key, f"takes one value, not the list {value!r}")
    if param.is_flag and param.flag_value is True or isinstance(param.type, click.types.BoolParamType):
        if not isinstance(value, bool):
            raise _bad(path, key, f"takes true or false, not {value!r}")
        return value
    return _check_one(path, key, param, value)


def _check_one(path: Path, key: str, param: click.Option, value):
    """One value, strict where click would coerce silently (it turns 1.5 into 1 for an
    integer, and anything into a string), then converted by the option's own type."""
    kind = param.type
    if isinstance(kind, click.types.IntParamType):  # IntRange too
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(path, key, f"takes an integer, not {value!r}")
    elif isinstance(kind, click.types.FloatParamType):
        # a number, or one of the words its type takes besides (`words`: "auto" of --t-shift)
        if (isinstance(value, bool) or not isinstance(value, int | float)) and value not in getattr(kind, "words", ()):
            words = "".join(f" or {w!r}" for w in getattr(kind, "words", ()))
            raise _bad(path, key, f"takes a number{words}, not {value!r}")
    elif isinstance(value, bool | list | dict):
        raise _bad(path, key, f"takes a value such as {param.metavar or 'TEXT'}, not {value!r}")
    elif isinstance(value, int | float):
        value = str(value)  # a string option given a number in the file: --grad-checkpointing 2
    try:
        return kind.convert(value, param, None)
    except click.BadParameter as e:
        raise _bad(path, key, e.message) from None


SUFFIXES = (".toml", ".yaml", ".yml", ".json")  # what --config reads, by suffix


def read(path: str | Path) -> dict:
    """The config file (TOML, YAML or JSON by its suffix), parsed; a missing or malformed file,
    or one whose top level is not a table of keys, is one line."""
    path = Path(path)
    kind = path.suffix.lower()
    if kind not in SUFFIXES:
        raise click.BadParameter(f"{path}: a config file is .toml, .yaml, .yml or .json, not {kind or 'no suffix'!r}",
                                 param_hint="'--config'")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise click.BadParameter(f"{path}: {e.strerror or e}", param_hint="'--config'") from None
    try:
        data = _parse(kind, raw)
    except ValueError as e:  # tomllib's, json's and yaml's errors (YAMLError is wrapped in _parse)
        what = {".yml": "YAML", ".yaml": "YAML"}.get(kind, kind[1:].upper())
        raise click.BadParameter(f"{path}: not valid {what} ({' '.join(str(e).split())})",
                                 param_hint="'--config'") from None
    if not isinstance(data, dict):
        raise click.BadParameter(f"{path}: the file must be a table of keys (KEY = VALUE, KEY: VALUE or "
                                 f"{{\"KEY\": VALUE}}), not a {type(data).__name__}", param_hint="'--config'")
    return data


def _parse(kind: str, raw: bytes):
    if kind == ".toml":
        import tomllib

        return tomllib.loads(raw.decode("utf-8", errors="strict"))
    if kind == ".json":
        import json

        return json.loads(raw)
    import yaml

    try:
        return yaml.load(raw, Loader=_yaml_loader())  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        raise ValueError(str(e)) from None


def _yaml_loader():
    """PyYAML's SafeLoader with YAML 1.2's floats: `1e-4` and `3E5` are numbers (YAML 1.1, which
    PyYAML follows, wants a dot and a signed exponent and reads them as strings), so a learning
    rate written as in TOML or JSON means the same."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    float_12 = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                              |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                              |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                              |[-+]?\.(?:inf|Inf|INF)
                              |\.(?:nan|NaN|NAN))$""", re.X)
    Loader.yaml_implicit_resolvers = {k: [r for r in v if r[0] != "tag:yaml.org,2002:float"]
                                      for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", float_12, list("-+0123456789."))
    return Loader


RECIPE = "recipe"  # the top-level table that marks a recipe file (module docstring)


def command_table(path: str | Path, data: Mapping, command: str) -> Mapping:
    """The settings of `command` in a config file: the file itself, or in a recipe file its
    table named after the command (one line when it has none)."""
    if not isinstance(data.get(RECIPE), dict):
        return data
    mine = data.get(command)
    if not isinstance(mine, dict):
        found = sorted(k for k, v in data.items() if isinstance(v, dict) and k != RECIPE)
        raise click.BadParameter(f"{path}: a recipe file without a [{command}] table (it has "
                                 f"{', '.join(f'[{t}]' for t in found) or 'none'}): nothing in it is for this command",
                                 param_hint="'--config'")
    return mine


def defaults_from(command: click.Command, path: str | Path, data: Mapping,
                  sections: Mapping[str, str] | None = None, cli_only: frozenset = frozenset()) -> dict:
    """The checked values of a config file as {parameter name: value} (click's default_map).

    sections: parameter name -> the table it belongs in; None reads top-level keys.
    cli_only: parameters that a file may not set (what one invocation asks, not a setting)."""
    path, options, values = Path(path), _options(command), {}
    tables = sorted(set(sections.values())) if sections else []
    for where, key, value in _entries(path, data, tables):
        if value is None:  # YAML ~ / JSON null: the key at its default (TOML has no null)
            continue
        param = options.get(key)
        if param is None:
            names = sorted({key_of(p) for p in options.values()})
            close = difflib.get_close_matches(key.replace("_", "-"), names, n=1)
            hint = f" (did you mean {close[0]}?)" if close else f"; `{command.name} --help` lists the flags"
            raise _bad(path, _where(where, key), f"unknown key{hint}")
        if param.name in cli_only:
            raise _bad(path, _where(where, key), "is a command-line flag only, not a setting of the file")
        if sections:
            home = sections.get(param.name, "other")
            if home != where:
                raise _bad(path, _where(where, key), f"belongs in the [{home}] table")
        values[param.name] = _check_type(path, _where(where, key), param, value)
    return values


def _entries(path: Path, data: Mapping, tables: list[str]):
    """(table or None, key, value) of every setting in the file."""
    for key, value in data.items():
        if tables and isinstance(value, dict):
            if key not in tables:
                raise _bad(path, f"[{key}]", f"unknown table; the tables are {', '.join(tables)}")
            for sub, v in value.items():
                yield key, sub, v
        elif isinstance(value, dict) and not tables:
            raise _bad(path, f"[{key}]", "a table, but this command's settings are top-level keys (no tables)")
        else:
            yield None, key, value


def _where(table: str | None, key: str) -> str:
    return f"[{table}] {key}" if table else key


def option(sections: Callable[[], Mapping[str, str]] | None = None, cli_only: tuple[str, ...] = ()):
    """The --config option (eager: the file is read before any other option, so its values
    are the defaults that the command line's flags then override). sections, cli_only: as
    for defaults_from (sections is called when a file is read, so it may import lazily)."""

    def load(ctx: click.Context, param, value):
        if value is None or ctx.resilient_parsing:
            return value
        table = sections() if sections is not None else None
        data = command_table(value, read(value), ctx.command.name)
        found = defaults_from(ctx.command, value, data, table, frozenset(cli_only))
        ctx.default_map = {**(ctx.default_map or {}), **found}
        return value

    return click.option("--config", CONFIG_OPTION, type=click.Path(dir_okay=False, path_type=str),
                        default=None, is_eager=True, expose_value=False, callback=load, metavar="FILE",
                        help="Read the options from this TOML, YAML or JSON file (keys: the flag names without dashes"
                             + (", in tables named after the sections below; on the command line --SECTION.KEY "
                                "VALUE is the same as KEY in [SECTION]" if sections else "")
                             + "; a recipe file: its table named after this command); flags given here win "
                             "over it.")


_BOOLS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False, "on": True, "off": False}


def undotted(command: click.Command, args: list[str], section_of: Callable[[str], str | None],
             sections: list[str], ctx: click.Context | None = None) -> list[str]:
    """The command line with every `--SECTION.KEY[=VALUE]` turned into the option's own flag
    (module docstring); a bad section or key, or a key of another section, is a one-line
    click.UsageError. Arguments after `--` are left as they are."""
    options, out, i = _options(command), [], 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            out += args[i - 1:]
            break
        name, eq, value = arg.partition("=")
        if not name.startswith("--") or "." not in name:
            out.append(arg)
            continue
        section, _, key = name[2:].partition(".")
        param = options.get(key)
        if key.startswith("no-") or key.startswith("no_"):  # --SECTION.no-KEY: the off side of a flag
            on = options.get(key[3:])
            if on is not None and on.secondary_opts:
                param, eq, value = on, "=", "false"
        if section not in sections:
            raise click.UsageError(f"{name}: no section {section!r}; the sections are {', '.join(sections)}", ctx)
        if param is None or section_of(param.name) != section:
            mine = sorted({key_of(p) for p in options.values() if section_of(p.name) == section})
            if param is not None:
                why = f"--{key_of(param)} is in the {section_of(param.name) or 'other'} section"
            else:
                close = difflib.get_close_matches(key.replace("_", "-"), mine, n=1)
                why = f"did you mean --{section}.{close[0]}?" if close else f"its keys: {', '.join(mine)}"
            raise click.UsageError(f"{name}: no such key in the {section} section ({why})", ctx)
        flag = next(o for o in param.opts if o.startswith("--"))
        if param.is_flag and param.secondary_opts:  # on/off: bare, =BOOL or a following BOOL
            if not eq and i < len(args) and args[i].lower() in _BOOLS:
                value, eq = args[i], "="
                i += 1
            if eq and value.lower() not in _BOOLS:
                raise click.UsageError(f"{name}: takes true or false, not {value!r}", ctx)
            out.append(flag if not eq or _BOOLS[value.lower()] else param.secondary_opts[0])
        else:
            out.append(f"{flag}={value}" if eq else flag)
    return out


def given(ctx: click.Context) -> set[str]:
    """The parameters the user set (on the command line, in the --config file or the
    environment), as opposed to those left at their defaults."""
    chosen = (ParameterSource.COMMANDLINE, ParameterSource.DEFAULT_MAP, ParameterSource.ENVIRONMENT)
    return {p.name for p in ctx.command.params if ctx.get_parameter_source(p.name) in chosen}


# ------------------------------------------------------------------------------ writing


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    s = str(v)
    # TOML basic strings: backslash, quote and control characters escaped
    out = "".join(c if c not in '"\\' and ord(c) >= 0x20 and c != "\x7f" else
                  {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t"}.get(c, f"\\u{ord(c):04x}") for c in s)
    return f'"{out}"'


def to_toml(tables: Mapping[str, Mapping], header: str = "") -> str:
    """{table: {key: value}} as TOML (None values left out: TOML has no null, and a key left
    out takes its default when the file is read back). A table named "" is top-level."""
    lines = [f"# {ln}" if ln else "#" for ln in header.splitlines()]
    for name, entries in sorted(tables.items(), key=lambda kv: kv[0] != ""):
        body = [f"{k} = {_value(v)}" for k, v in entries.items() if v is not None]
        if name:
            lines += ["", f"[{name}]"] if lines else [f"[{name}]"]
        lines += body
    return "\n".join(lines) + "\n"


__all__ = ["CONFIG_OPTION", "RECIPE", "SUFFIXES", "OneOrMany", "command_table", "defaults_from", "given", "key_of", "option",
           "read", "to_toml", "undotted"]
