"""`rl-tpu --help`: the recipes, and every config key with its default and the comment that documents it.

The descriptions are the comments on the fields of the rl_tpu/config/ modules (on the field's line, or the comment
block right above it), so the help cannot drift from the schema.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import io
import pkgutil
import re
import tokenize
from enum import Enum
from importlib import resources
from types import ModuleType

from rl_tpu import config

MAX_DESCRIPTION = 110
KEY_WIDTH = 40  # a longer KEY=default pushes its description along
USAGE = """usage: rl-tpu +recipe=NAME [KEY=VALUE ...]          (also: python -m rl_tpu.main ...)
       rl-tpu -m +recipe=NAME KEY=A,B ...                a sweep: one trial per combination
       rl-tpu -m +recipe=NAME hydra/sweeper=optuna ...   an Optuna search (examples/sweep/README.md)
       rl-tpu doctor +recipe=NAME [KEY=VALUE ...]        the preflight: 2 short steps checked (docs/preflight.md)
       rl-tpu --hydra-help                               Hydra's own options (--cfg job, --info, ...)
       rl-tpu inspect RUN_FOLDER                         write the run's rollout inspector, RUN_FOLDER/inspect.html
"""


def field_comments(source: str) -> dict[tuple[str, str], str]:
    """(class name, field name) -> the comment documenting that field in `source`."""
    comments = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    lines = source.splitlines()
    found = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            line = item.lineno
            if line in comments and not lines[line - 1].lstrip().startswith("#"):  # a comment after the field
                found[(node.name, item.target.id)] = comments[line]
                continue
            above = []
            while line - 1 in comments and lines[line - 2].lstrip().startswith("#"):
                line -= 1
                above.insert(0, comments[line])
            if above:
                found[(node.name, item.target.id)] = " ".join(above)
    return found


def one_line(text: str) -> str:
    """The first sentence, cut to fit a terminal line."""
    sentence = re.split(r"(?<!e\.g)(?<!i\.e)(?<!Dr)\.\s+", text)[0].rstrip(".")
    return sentence if len(sentence) <= MAX_DESCRIPTION else sentence[: MAX_DESCRIPTION - 3].rstrip() + "..."


def shown(value) -> str:
    """A default as it would be written on the command line."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(shown(v) for v in value) + "]"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def shown_default(f: dataclasses.Field) -> str:
    return shown(f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)


def key_lines(schema: type, comments: dict[tuple[str, str], str], prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, description) for every leaf key under `schema`, in the schema's order."""
    rows = []
    hints = {name: hint for name, hint in inspect.get_annotations(schema, eval_str=True).items()}
    for f in dataclasses.fields(schema):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            rows += key_lines(hint, comments, f"{prefix}{f.name}.")
            continue
        description = one_line(comments.get((schema.__name__, f.name), ""))
        if isinstance(hint, type) and issubclass(hint, Enum):
            allowed = "one of " + ", ".join(m.value for m in hint)
            description = f"{description} ({allowed})" if description else allowed
        rows.append((prefix + f.name, shown_default(f), description))
    return rows


def recipes() -> list[tuple[str, str]]:
    """(name, first line of its description) for each recipe shipped in the package."""
    found = []
    for entry in sorted(resources.files("rl_tpu.configs").joinpath("recipe").iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            lines = entry.read_text().splitlines()
            header = [
                line.lstrip("# ").strip()
                for line in lines[: next((i for i, text in enumerate(lines) if not text.startswith("#")), len(lines))]
                if "@package" not in line
            ]
            found.append((entry.name.removesuffix(".yaml"), one_line(" ".join(header))))
    return found


def config_modules() -> list[ModuleType]:
    """The schema's modules: the package and every module in it, so that a section moved or added is read too."""
    names = sorted(info.name for info in pkgutil.iter_modules(config.__path__))
    return [config, *(importlib.import_module(f"{config.__name__}.{name}") for name in names)]


def help_text() -> str:
    comments = {}
    for module in config_modules():
        comments.update(field_comments(inspect.getsource(module)))
    lines = [USAGE, "recipes (+recipe=NAME):"]
    lines += [f"  {name:<20} {what}" for name, what in recipes()]
    rows = key_lines(config.RunConfig, comments)
    width = KEY_WIDTH
    lines += ["", "keys (KEY=default, then what it does):"]
    lines += [f"  {f'{key}={default}':<{width}} {what}".rstrip() for key, default, what in rows]
    return "\n".join(lines) + "\n"
