"""The manual holds true: every command block of README.md and docs/*.md is run or checked,
docs/api.md's examples run, docs/layout.md names every module, and every path, dotted name and
link the pages give exists.

Command blocks (```bash, ```sh or unlabelled): continuation lines are joined, comments dropped,
and each line is split at `&&`, `||`, `;` and `|` into commands. Each command must be one of:

- `ditdata ...`, `dittrain ...`, `python -m ditdata|dittrain ...`, `srun ...` of one of these, or
  `torchrun ... -m ditdata.cli|dittrain.cli ...` (torchrun's own options parsed by torch's
  parser): checked against the real click command: the subcommand exists, every option is one of
  its options, the options and arguments are as many as it takes, and every value converts with
  the option's click type (choices, ranges, numbers, sizes). Path values are not converted, so
  placeholders such as STORE, RUN or FILE stand for any path;
- `python -m MODULE` of any other module that exists, `pip install` of ditkit extras that
  pyproject.toml declares, `bash FILE` of a file in the repository;
- one of ALLOWED_SHAPES, each with its reason.

```toml blocks are `dittrain run --config` files: `dittrain run --config FILE --print-config`
must accept them. ```python blocks are docs/api.md's examples, run in order in one session on a
tiny store. Any other block is exempted by name in EXEMPT, with the reason; an exemption that
matches no block fails, so the list cannot go stale.

The README's overview block is also run as written, by tests/test_readme.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib
import importlib.util
import inspect
import io
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from ditdata.cli import main as ditdata_main
from dittrain.cli import main as dittrain_main

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
GROUPS = {"ditdata": ditdata_main, "dittrain": dittrain_main}
CLI_MODULES = {"ditdata": "ditdata", "dittrain": "dittrain", "ditdata.cli": "ditdata", "dittrain.cli": "dittrain"}
COMMAND_LANGS = ("bash", "sh", "")
EXTRAS = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])

# commands that are not ditkit's, each shape with its reason (matched against the whole command)
ALLOWED_SHAPES = [
    (r"hf download [\w.-]+/[\w.-]+( [\w.+-]+)?", "fills the Hugging Face cache, on a machine with internet"),
    (r"wget (-P \S+ )?https://\S+", "fetches ADM's reference batch and the Inception weights once"),
    (r"mkdir -p \S+", "the torch hub cache folder for the Inception weights"),
    (r"aws s3 cp (--recursive )?\S+ s3://\S+", "uploads a store to S3, manifest last"),
    (r"gsutil (-m )?cp (-r )?\S+ gs://\S+", "uploads a store to GCS, manifest last"),
    (r"\{ \[ \$\? -eq 75 \]", "the Slurm script's test of the stopped status (75)"),
    (r"scontrol requeue \$SLURM_JOB_ID", "the Slurm script's requeue"),
    (r"\}", "the end of the Slurm script's requeue group"),
]

# blocks that are not commands: (page, the start of the block's first line) -> why
EXEMPT = {
    ("docs/memory.md", "GiB at the predicted peak"): "the output of `dittrain plan`, not a command; "
    "tests/test_plan.py checks the command it prints",
    ("docs/store.md", "STORE/manifest.json        written last"): "a store's files, not a command",
    ("docs/store.md", "STORE/manifest.json        the top manifest"): "a bucketed store's files, not a command",
}


# --------------------------------------------------------------------------- reading the pages


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    lang: str
    body: str

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"

    def first_line(self) -> str:
        return next((ln for ln in self.body.splitlines() if ln.strip()), "")


def fenced_blocks(text: str, page: str = "page") -> list[Block]:
    """The fenced code blocks of a markdown text, indented ones (inside lists) too, each body
    dedented by its fence's indentation."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = re.match(r"^(\s*)```([\w+-]*)\s*$", lines[i])
        if not opening:
            i += 1
            continue
        indent, lang, start = opening.group(1), opening.group(2), i
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        assert i < len(lines), f"{page}:{start + 1}: a code block that is never closed"
        blocks.append(Block(page, start + 1, lang, "\n".join(body) + "\n"))
        i += 1
    return blocks


def command_lines(body: str) -> list[str]:
    """The command lines of a block: continuation lines joined, comments and blank lines dropped."""
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        tokens = list(lex)  # (the lexer drops a trailing comment)
        if tokens:
            out.append(tokens)
    return [shlex.join(t) for t in out]


def commands(line: str) -> list[list[str]]:
    """One command line split at &&, ||, ; and | into the tokens of each command."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    parts, current = [], []
    for token in lex:
        if token in ("&&", "||", ";", "|"):
            parts.append(current)
            current = []
        else:
            current.append(token)
    return [p for p in [*parts, current] if p]


def all_blocks() -> list[Block]:
    return [b for p in PAGES for b in fenced_blocks(p.read_text(), str(p.relative_to(REPO)))]


# --------------------------------------------------------------------------- the checker


def _given(value) -> bool:
    """A value the parser found (click marks the others None or with an enum sentinel, UNSET)."""
    return value not in (None, (), []) and not isinstance(value, enum.Enum)


def _flat(value) -> list:
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in _flat(item)]
    return [value] if _given(value) else []


def check_cli(prog: str, args: list[str]) -> list[str]:
    """What is wrong with `prog args` against the real click command (empty: nothing)."""
    group = GROUPS[prog]
    if args in (["--help"], ["-h"], ["--version"]):
        return []
    if not args:
        return [f"{prog}: no command given"]
    ctx = click.Context(group, info_name=prog)
    cmd = group.get_command(ctx, args[0])
    if cmd is None:
        return [f"{prog} has no command {args[0]!r} (it has {', '.join(group.list_commands(ctx))})"]
    where = f"{prog} {args[0]}"
    sub = click.Context(cmd, info_name=args[0], parent=ctx)
    try:  # click's own parser: option names, flags, how many values each takes
        values, extra, _ = cmd.make_parser(sub).parse_args(list(args[1:]))
    except click.UsageError as e:
        return [f"{where}: {e.format_message()}"]
    problems = [f"{where}: unexpected arguments {extra}"] if extra else []
    for param in cmd.get_params(sub):
        value = values.get(param.name)
        if isinstance(param, click.Argument) and param.required and not _given(value):
            problems.append(f"{where}: missing argument {param.human_readable_name}")
        if not _given(value) or (isinstance(param, click.Option) and (param.is_flag or param.count)):
            continue
        if isinstance(param.type, (click.Path, click.File)):
            continue  # placeholders (STORE, RUN, FILE) stand for any path
        for item in _flat(value):
            try:
                param.type.convert(item, param, sub)
            except click.BadParameter as e:
                problems.append(f"{where}: {e.format_message()}")
    return problems


def check_torchrun(args: list[str]) -> list[str]:
    """torchrun's options through torch's own parser, then the ditkit command it runs."""
    from torch.distributed.run import get_args_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = get_args_parser().parse_args(args)
    except SystemExit:
        return [f"torchrun {shlex.join(args)}: {err.getvalue().strip().splitlines()[-1]}"]
    if not ns.module or ns.training_script not in ("ditdata.cli", "dittrain.cli"):
        return [f"torchrun runs {ns.training_script!r}: expected -m ditdata.cli or -m dittrain.cli"]
    return check_cli(CLI_MODULES[ns.training_script], ns.training_script_args)


def check_pip(args: list[str]) -> list[str]:
    targets = [a for a in args[1:] if not a.startswith("-")]
    if args[:1] != ["install"] or not targets:
        return [f"pip {shlex.join(args)}: only `pip install` of ditkit's extras is expected"]
    problems = []
    for target in targets:
        m = re.fullmatch(r"(?:\.|ditkit)\[([\w,-]+)\]", target)
        if not m:
            problems.append(f"pip install {target}: not ditkit with extras")
        else:
            problems += [f"pip install {target}: no extra {e!r} in pyproject.toml"
                         for e in m.group(1).split(",") if e not in EXTRAS]
    return problems


def check_command(tokens: list[str]) -> list[str]:
    """What is wrong with one command (its tokens); empty when it checks out."""
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", tokens[0]):
        tokens = tokens[1:]  # environment assignments: DITKIT_TAEF2=/models/taef2 ditdata ...
    if not tokens:
        return ["an empty command"]
    prog, args = Path(tokens[0]).name, tokens[1:]
    if prog == "srun":
        return check_command(args)
    if prog in GROUPS:
        return check_cli(prog, args)
    if prog == "torchrun":
        return check_torchrun(args)
    if re.fullmatch(r"python(3(\.\d+)?)?", prog) and args[:1] == ["-m"] and len(args) > 1:
        if args[1] in CLI_MODULES:
            return check_cli(CLI_MODULES[args[1]], args[2:])
        return [] if importlib.util.find_spec(args[1]) else [f"python -m {args[1]}: no such module"]
    if prog == "pip":
        return check_pip(args)
    if prog == "bash" and args:
        return [] if (REPO / args[0]).is_file() else [f"bash {args[0]}: no such file in the repository"]
    joined = shlex.join(tokens).replace("'", "")
    if any(re.fullmatch(shape, joined) for shape, _ in ALLOWED_SHAPES):
        return []
    return [f"{joined}: not a command this test knows (add it to ALLOWED_SHAPES with a reason?)"]


def check_block(block: Block) -> list[str]:
    """What is wrong with a command block, each problem with the line it is on."""
    return [f"{block.name}: {problem}" for line in command_lines(block.body)
            for tokens in commands(line) for problem in check_command(tokens)]


# --------------------------------------------------------------------------- the checker, checked

FAKE_PAGE = """\
Text.

```bash
dittrain run --latents STORE --model DiT-B/2 \\
    --out RUN --made-up-flag 3   # a flag no command has
ditdata encode SHARDS --vae sd-vae-ft-ema --backend zip --out STORE
```

- a list item:

  ```
  ditdata frobnicate SHARDS
  dittrain sample --ckpt RUN --steps many --out grid.png
  dittrain runs
  pip install -e '.[nosuchextra]'
  curl https://example.com | sh
  ```
"""


def test_the_checker_fails_on_made_up_flags_commands_and_values():
    blocks = fenced_blocks(FAKE_PAGE, "fake.md")
    assert [(b.line, b.lang) for b in blocks] == [(3, "bash"), (11, "")]
    assert command_lines(blocks[0].body)[0] == \
        "dittrain run --latents STORE --model DiT-B/2 --out RUN --made-up-flag 3"  # joined, comment dropped
    problems = check_block(blocks[0]) + check_block(blocks[1])
    expected = ["No such option '--made-up-flag'", "'zip' is not one of", "has no command 'frobnicate'",
                "'many' is not a valid integer", "missing argument RUN_DIR", "no extra 'nosuchextra'",
                "curl https://example.com: not a command", "sh: not a command"]
    for text in expected:
        assert any(text in p for p in problems), (text, problems)
    assert len(problems) == len(expected), problems


def test_the_checker_passes_what_is_right():
    good = ["dittrain run --latents STORE --model DiT-B/2 --precision bf16 --grad-checkpointing 2 --out RUN -q",
            "ditdata filter SHARDS --min-clip-score -1 --out keep.parquet",
            "dittrain plan --model DiT-XL/2 --latent-shape 4x32x32 --gpu-memory 24GiB",
            "torchrun --standalone --nproc_per_node 8 -m ditdata.cli encode SHARDS --out STORE",
            "DITKIT_TAEF2=/models/taef2 python -m dittrain sample --ckpt RUN --class 207 --out x.png",
            "srun dittrain run --config run.toml --out RUN --resume"]
    for line in good:
        assert check_command(shlex.split(line)) == [], line
    assert check_command(shlex.split("torchrun --nproc_per_node 8 -m dittrain.cli run --lr fast"))
    assert check_command(shlex.split("torchrun --no-such-torchrun-flag -m dittrain.cli run"))


# --------------------------------------------------------------------------- the pages' blocks

BLOCKS = all_blocks()


def _exempt_reason(block: Block) -> str | None:
    return next((why for (page, start), why in EXEMPT.items()
                 if block.page == page and block.first_line().startswith(start)), None)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in COMMAND_LANGS], ids=lambda b: b.name)
def test_command_block(block):
    assert not _exempt_reason(block), f"{block.name} is exempted but is a command block: label it ```text"
    assert command_lines(block.body), f"{block.name}: a command block without a command"
    problems = check_block(block)
    assert not problems, "\n".join(problems)


def test_every_block_is_checked_run_or_exempted():
    for b in BLOCKS:
        checked = b.lang in (*COMMAND_LANGS, "toml") or (b.lang == "python" and b.page == "docs/api.md")
        assert checked or _exempt_reason(b), \
            f"{b.name}: a ```{b.lang} block that no test checks or runs; check it, or add it to EXEMPT with a reason"
    assert sum(b.lang in COMMAND_LANGS for b in BLOCKS) > 20  # the pages were read
    for page, start in EXEMPT:
        assert any(b.page == page and b.first_line().startswith(start) for b in BLOCKS), \
            f"EXEMPT names a block that is gone: {page}: {start!r}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "toml"], ids=lambda b: b.name)
def test_toml_block_is_a_run_config_file(block, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(block.body)
    r = CliRunner().invoke(dittrain_main, ["run", "--config", str(config), "--print-config"])
    assert r.exit_code == 0, r.output
    assert "[data]" in r.output


def test_the_readme_test_command_is_what_ci_runs():
    """The README's second set-up command ends with the test command that .ci/run runs (its one pytest
    line; the `|| suite=$?` after it keeps the exit code while the smoke job finishes)."""
    readme = (REPO / "README.md").read_text()
    setup = next(b for b in fenced_blocks(readme) if "pytest" in b.body)
    readme_test = commands(command_lines(setup.body)[-1])[-1]
    (ci_line,) = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
                  if "pytest" in line and not line.lstrip().startswith("#")]
    ci_test = commands(ci_line.split("||")[0])[-1]
    assert readme_test == ci_test == [".venv/bin/python", "-m", "pytest", "-q"]
    assert '[ "$suite" -eq 0 ]' in (REPO / ".ci" / "run").read_text()  # a failing suite fails CI


def test_the_readme_is_a_front_door():
    assert len((REPO / "README.md").read_text().splitlines()) < 300


# --------------------------------------------------------------------------- docs/api.md


def test_api_examples_run(tmp_path, monkeypatch):
    """docs/api.md's python blocks, in order, in one namespace, in a folder with a tiny store."""
    from storeutil import make_store

    make_store(tmp_path / "store")  # 48 latents of 3x8x8, classes a, b, c
    monkeypatch.chdir(tmp_path)
    page = REPO / "docs" / "api.md"
    examples = [b for b in fenced_blocks(page.read_text(), "docs/api.md") if b.lang == "python"]
    assert len(examples) >= 4
    namespace: dict = {}
    for block in examples:
        exec(compile(block.body, block.name, "exec"), namespace)
    assert (tmp_path / "runs" / "api" / "ema.safetensors").is_file()
    assert (tmp_path / "grid.png").is_file()


def _resolve(dotted: str):
    """The module or attribute a dotted name such as ditdata.store.open_store names."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_api_tables_name_real_parameters():
    """Each `| parameter of `f` |` table of docs/api.md lists parameters that f really has, and
    each `| field of `C` |` table fields that the dataclass C really has."""
    text = (REPO / "docs" / "api.md").read_text()
    tables = re.findall(r"^\| (parameter|field) of `([\w.]+)` \|.*\n\|[-|]+\|\n((?:\|.*\n)+)", text, re.M)
    assert len(tables) >= 5 and any(kind == "field" for kind, _, _ in tables)
    for kind, dotted, rows in tables:
        obj = _resolve(dotted)
        params = ({f.name for f in dataclasses.fields(obj)} if kind == "field"
                  else inspect.signature(obj).parameters)
        names = re.findall(r"^\| `(\w+)` \|", rows, re.M)
        assert names, dotted
        missing = [n for n in names if n not in params]
        assert not missing, f"docs/api.md: {dotted} has no parameter {missing} (it has {list(params)})"


# --------------------------------------------------------------------------- docs/layout.md


def test_layout_names_every_module():
    text = (REPO / "docs" / "layout.md").read_text()
    named = set(re.findall(r"`((?:ditdata|dittrain)/[\w/]+\.py)`", text))
    modules = {str(p.relative_to(REPO)) for pkg in ("ditdata", "dittrain") for p in (REPO / pkg).rglob("*.py")}
    assert not modules - named, f"docs/layout.md does not name {sorted(modules - named)}"
    assert not named - modules, f"docs/layout.md names modules that do not exist: {sorted(named - modules)}"


# --------------------------------------------------------------------------- paths, names, links


def _inline_code(text: str) -> list[str]:
    text = re.sub(r"(?ms)^\s*```.*?^\s*```", "", text)  # not inside fenced blocks
    return re.findall(r"`([^`\n]+)`", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_paths_and_dotted_names_exist(page):
    """Every repository path (ditdata/..., bench/..., tests/...) and every dotted name
    (ditdata.x.y, dittrain.x.y) a page gives in inline code exists."""
    problems = []
    for code in _inline_code(page.read_text()):
        for path in re.findall(r"(?<![\w./-])((?:ditdata|dittrain|bench|pipelines|tests|docs|\.ci)/[\w./-]*)", code):
            path = path.rstrip(".")
            if not (REPO / path).exists():
                problems.append(f"no such path: {path}")
        m = re.fullmatch(r"((?:ditdata|dittrain)(?:\.\w+)+)(\(.*\))?", code)
        if m:
            try:
                _resolve(m.group(1))
            except (ImportError, AttributeError) as e:
                problems.append(f"{m.group(1)}: {e}")
    assert not problems, f"{page.relative_to(REPO)}:\n" + "\n".join(problems)


def _anchors(text: str) -> set[str]:
    """The heading anchors of a markdown page, as GitHub makes them."""
    counts: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"(?ms)^\s*```.*?^\s*```", "", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = counts.get(slug, 0)
        counts[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")  # a repeated heading gets -1, -2, ...
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve(page):
    """Every relative link goes to a file that exists, and every #anchor to one of its headings."""
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"\w+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        rel = file.relative_to(REPO).as_posix() if file.is_relative_to(REPO) else str(file)
        if not file.exists():
            problems.append(f"{target}: no such file")
            continue
        if anchor and anchor not in _anchors(file.read_text()):
            problems.append(f"{target}: no heading #{anchor} in {rel}")
    assert not problems, f"{page.relative_to(REPO)}:\n" + "\n".join(problems)
