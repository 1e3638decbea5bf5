"""How `ditdata` and `dittrain` fail: one line on stderr, a non-zero exit, no traceback.

Both command groups use `OneLineErrors` (shared here, in the package both sides may
import). Expected failures (a UserError of any module: a broken store, a missing model, a
busy output, ...) and operating-system errors (disk full, permission denied) print their
message; click's usage errors print theirs with a pointer to --help instead of the usage
block; running out of GPU memory says so (ditdata.common.memory: a command that names what
it ran says more); anything else is a bug, reported in one line that says how to get the
traceback (DITKIT_DEBUG=1 or -v/--verbose, which also show tracebacks for the expected failures). A
progress bar still drawn when a command fails is closed first, so the `Error:` line starts
a line of its own (ditdata.common.progress).
"""

from __future__ import annotations

import os
import sys

import click

from ditdata.common.errors import UserError, one_line
from ditdata.common.memory import is_out_of_memory, out_of_memory_message
from ditdata.common.progress import end_open_bars

DEBUG_ENV = "DITKIT_DEBUG"


def os_error_message(e: OSError) -> str:
    """An OSError as a readable line: what failed and on which path."""
    what = e.strerror or str(e) or type(e).__name__
    where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    return f"{where}: {what}" if where else what


def _verbose(ctx: click.Context, param, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        os.environ[DEBUG_ENV] = "1"  # the environment, so loader workers and torchrun's ranks see it too


# -v/--verbose: the spelling of DITKIT_DEBUG=1 on every command of both groups (OneLineErrors.add_command)
verbose_option = click.Option(["--verbose", "-v"], is_flag=True, expose_value=False, is_eager=True, callback=_verbose,
                              help=f"Tracebacks instead of one-line errors (the same as {DEBUG_ENV}=1).")


class OneLineErrors(click.Group):
    """A click group whose failures are one line each (module docstring): a UserError's
    message is meant for the user as it is. Every command added to it takes -v/--verbose."""

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        if not any(p.name == "verbose" for p in cmd.params):
            cmd.params.append(verbose_option)
        super().add_command(cmd, name)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except Exception as e:
            if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
                end_open_bars()  # the traceback starts a line of its own
                raise
            if isinstance(e, UserError):
                raise click.ClickException(one_line(e)) from e
            if isinstance(e, OSError):
                raise click.ClickException(one_line(os_error_message(e))) from e
            if isinstance(e, MemoryError):
                raise click.ClickException("out of memory; use smaller batches or a smaller input") from e
            if is_out_of_memory(e):
                raise click.ClickException(out_of_memory_message(e)) from e
            raise click.ClickException(
                f"internal error ({type(e).__name__}: {one_line(e, 300)}); rerun with "
                f"{DEBUG_ENV}=1 for the traceback and please report it"
            ) from e

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.UsageError as e:
            end_open_bars()
            # click prints the whole usage block; one line and where to read more is enough
            cmd = e.ctx.command_path if e.ctx is not None else self.name
            click.echo(f"Error: {one_line(e.format_message())} (see '{cmd} --help')", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            end_open_bars()
            click.echo(f"Error: {one_line(e.format_message())}", err=True)
            sys.exit(e.exit_code)
        except click.exceptions.Abort:
            end_open_bars()
            click.echo("Aborted!", err=True)
            sys.exit(130)
        sys.exit(rv if isinstance(rv, int) else 0)


class SectionedCommand(click.Command):
    """A command whose --help lists its options under section headings: section_of(name) names a
    parameter's section (None: "other"), sections() gives their order ("other" comes last)."""

    def section_of(self, name: str) -> str | None:
        return None

    def sections(self) -> list[str]:
        return []

    def parse_args(self, ctx, args):
        # --SECTION.KEY VALUE: the key of the config file's [SECTION] table (ditdata.common.configfile.undotted)
        if sections := [s for s in self.sections() if s != "config"]:
            from ditdata.common.configfile import undotted

            args = undotted(self, list(args), self.section_of, sections, ctx)
        return super().parse_args(ctx, args)

    def format_options(self, ctx, formatter):
        groups: dict[str, list] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                groups.setdefault(self.section_of(param.name) or "other", []).append(record)
        for section in [*self.sections(), "other"]:
            if section in groups:
                with formatter.section(f"{section.capitalize()} options"):
                    formatter.write_dl(groups[section])


def aliased(option: click.Option, *names: str) -> click.Option:
    """A copy of an option shared between commands that also answers to `names` in one of them
    (dittrain plan's --steps for run's --max-steps); the shared one is left as it is."""
    import copy

    option = copy.copy(option)
    option.opts = [*option.opts, *names]
    return option


# -q/--quiet of every long command: no progress bar, and no progress lines in a log file
quiet_option = click.option("--quiet", "-q", is_flag=True,
                            help="No progress bar (and, when stderr is not a terminal, no progress lines).")


class FiniteFloat(click.FloatRange):
    """A float option that also refuses nan and inf (click's FloatRange lets nan through:
    every comparison with it is false). `allow_inf` keeps +inf for "no limit" options."""

    name = "finite float"

    def __init__(self, *args, allow_inf: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.allow_inf = allow_inf

    def _describe_range(self) -> str:
        # click describes a range without bounds as "x<=None"; say nothing instead
        return "" if self.min is None and self.max is None else super()._describe_range()

    def convert(self, value, param, ctx):
        import math

        rv = super().convert(value, param, ctx)
        if math.isnan(rv) or (math.isinf(rv) and not (self.allow_inf and rv > 0)):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return rv
