"""Generates docs/configuration.md from the configuration types themselves, so the page cannot drift from the code:
`python -m conveyor.deployments.config_docs > docs/configuration.md` (tests/test_docs.py checks the file equals `render()`).

For each type, one table of its fields in declaration order: name, type (the annotation as written in the source),
default (the runtime default; a `default_factory` lambda shows its body), and a description. The description is
pydantic's `Field(description=...)` where given, else the comment on the comment-only line(s) just above the field
plus the comment at the end of its line(s), read from the source with `ast` and `tokenize`. A field with neither
gets an empty description: nothing here invents one."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import sys
import tokenize
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

COMMAND = "python -m conveyor.deployments.config_docs > docs/configuration.md"


@dataclass(frozen=True)
class Section:
    """One type's table: `where` says how a user sets its fields (written here, since the types do not say)."""

    cls: type
    where: str


@dataclass(frozen=True)
class Row:
    name: str
    type: str
    constraints: str  # pydantic's Field(ge=..., ...) as "> 0, <= 0.1"; empty for dataclasses (checked in code)
    default: str
    description: str


@dataclass(frozen=True)
class _Source:
    text: str
    tree: ast.Module
    comments: dict[int, str]  # line number -> comment text (without '#')
    comment_only: frozenset[int]  # lines holding nothing but a comment


@lru_cache(maxsize=None)
def _source(path: str) -> _Source:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = text.splitlines()
    only = frozenset(n for n in comments if lines[n - 1].lstrip().startswith("#"))
    return _Source(text, ast.parse(text), comments, only)


def _class_def(cls: type) -> tuple[_Source, ast.ClassDef]:
    """The module source of `cls` and its top-level class statement; KeyError where it is not top-level."""
    src = _source(inspect.getsourcefile(cls) or "")
    for node in src.tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return src, node
    raise KeyError(f"{cls.__module__}.{cls.__qualname__}: no top-level class statement")


def _field_statements(node: ast.ClassDef) -> dict[str, ast.AnnAssign]:
    return {s.target.id: s for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def _comment(src: _Source, stmt: ast.stmt) -> str:
    """Comment-only lines directly above the statement, then comments at the end of its line(s)."""
    above: list[str] = []
    line = stmt.lineno - 1
    while line in src.comment_only:
        above.insert(0, src.comments[line])
        line -= 1
    end = stmt.end_lineno or stmt.lineno
    trailing = [src.comments[n] for n in range(stmt.lineno, end + 1) if n in src.comments and n not in src.comment_only]
    return " ".join(c for c in above + trailing if c)


def _factory_text(src: _Source, stmt: ast.AnnAssign | None, factory: Any) -> str:
    """A `default_factory` lambda as its body's source text; any other factory by the value it builds."""
    if stmt is not None and isinstance(stmt.value, ast.Call):
        for kw in stmt.value.keywords:
            if kw.arg == "default_factory" and isinstance(kw.value, ast.Lambda):
                return f"{ast.get_source_segment(src.text, kw.value.body)} (per instance)"
    return repr(factory())


def _constraints(info: Any) -> list[str]:
    """pydantic's annotated-types constraints (Field(ge=..., ...)) as short comparisons."""
    out = []
    for m in info.metadata:
        for attr, op in (
            ("ge", ">="),
            ("gt", ">"),
            ("le", "<="),
            ("lt", "<"),
            ("min_length", "length >="),
            ("max_length", "length <="),
        ):
            if getattr(m, attr, None) is not None:
                out.append(f"{op} {getattr(m, attr)!r}")
    return out


def _default_text(src: _Source, stmt: ast.AnnAssign | None, value: Any) -> str:
    """repr(value), plus the source expression where it is arithmetic (`8388608 (8 * 2**20)`); a pydantic model
    left at its own defaults as `Name()`."""
    if isinstance(value, BaseModel) and value == type(value)():
        return f"{type(value).__name__}()"
    text = repr(value)
    expr = stmt.value if stmt is not None else None
    if isinstance(expr, ast.Call):  # field(default=...) or Field(default, ...)
        expr = next((kw.value for kw in expr.keywords if kw.arg == "default"), expr.args[0] if expr.args else None)
    if isinstance(expr, ast.BinOp):
        return f"{text} ({ast.get_source_segment(src.text, expr)})"
    return text


def _type_text(src: _Source, stmt: ast.AnnAssign | None, fallback: Any) -> str:
    if stmt is not None:
        return ast.get_source_segment(src.text, stmt.annotation) or str(fallback)
    return fallback if isinstance(fallback, str) else getattr(fallback, "__name__", str(fallback))


def rows(cls: type) -> list[Row]:
    """The fields of a dataclass or a pydantic model, in declaration order."""
    src, node = _class_def(cls)
    stmts = _field_statements(node)
    out = []
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            stmt = stmts.get(f.name)
            if f.default is not dataclasses.MISSING:
                default = _default_text(src, stmt, f.default)
            elif f.default_factory is not dataclasses.MISSING:
                default = _factory_text(src, stmt, f.default_factory)
            else:
                default = "required"
            out.append(
                Row(f.name, _type_text(src, stmt, f.type), "", default, _comment(src, stmt) if stmt is not None else "")
            )
    elif issubclass(cls, BaseModel):
        for name, info in cls.model_fields.items():
            stmt = stmts.get(name)
            if info.default is not PydanticUndefined:
                default = _default_text(src, stmt, info.default)
            elif info.default_factory is not None:
                default = _factory_text(src, stmt, info.default_factory)
            else:
                default = "required"
            description = info.description or (_comment(src, stmt) if stmt is not None else "")
            out.append(
                Row(name, _type_text(src, stmt, info.annotation), ", ".join(_constraints(info)), default, description)
            )
    else:
        raise TypeError(f"{cls.__qualname__}: neither a dataclass nor a pydantic model")
    return out


def _cell(text: str, code: bool = False) -> str:
    """A Markdown table cell: pipes escaped (GitHub needs it inside code spans too), one line."""
    text = " ".join(text.split()).replace("|", "\\|")
    return f"`{text}`" if code and text else text


def table(cls: type) -> str:
    lines = ["| Field | Type | Default | Description |", "|---|---|---|---|"]
    for r in rows(cls):
        limits = f" ({_cell(r.constraints)})" if r.constraints else ""
        lines.append(
            f"| {_cell(r.name, True)} | {_cell(r.type, True)}{limits} | {_cell(r.default, True)} | "
            f"{_cell(r.description)} |"
        )
    return "\n".join(lines)


def sections() -> tuple[Section, ...]:
    # imported here: deployments.app pulls in Ray Serve and the engine config pulls in torch
    from conveyor.cluster.admission_config import AdmissionConfig
    from conveyor.cluster.autoscaling import KVScalingConfig, PrefillScalingConfig
    from conveyor.cluster.routing import RouterConfig
    from conveyor.deployments.app import AppArgs, KVAutoscaling
    from conveyor.deployments.disaggregation import Disaggregation
    from conveyor.deployments.http_guard import GuardConfig
    from conveyor.engine.config import EngineConfig, SpeculativeConfig

    return (
        Section(
            AppArgs,
            "The `args:` of an application in a Serve config file (`serve_config.yaml`), or the dict "
            "given to `deployments.app.deploy`. An unknown or invalid field fails the deploy with a "
            "message naming it. `engine`, `admission`, `request_router` and `kv_autoscaling` take the "
            "types below; `autoscaling` is Ray Serve's own `AutoscalingConfig`.",
        ),
        Section(
            Disaggregation,
            "`args.disaggregation`: prefill/decode disaggregation (docs/disaggregation.md); it replaces "
            "`num_replicas` and is refused with `autoscaling`, `kv_autoscaling` (each role has its own: "
            "`prefill_autoscaling`, `decode_autoscaling`) or tensor_parallel_size > 1.",
        ),
        Section(
            KVAutoscaling,
            "`args.kv_autoscaling`: replica autoscaling on KV-cache demand (set it or "
            "`autoscaling`, not both). `policy` takes the fields of KVScalingConfig below. The same type is "
            "`args.disaggregation.decode_autoscaling` (KVScalingConfig) and `prefill_autoscaling` "
            "(PrefillScalingConfig).",
        ),
        Section(
            EngineConfig,
            "`args.engine` takes every field except `model` and `revision` (they come from `args.model` "
            "and `args.revision`). Offline: `LLM(model, **fields)` or `EngineConfig(...)`. A bad value "
            "raises ValueError naming the field. Building the config touches no file: the engine resolves "
            "it when it starts (the model fetched or generated, every `auto` decided), and a value the "
            "model refuses (a `max_model_len` above its limit) fails there, naming the field.",
        ),
        Section(
            SpeculativeConfig,
            "`args.engine.speculative` (`null`: off): speculative decoding (docs/speculative_decoding.md). "
            "Requests with penalties, a seed, min_tokens, logprobs, logit_bias or structured outputs decode "
            "without drafts.",
        ),
        Section(
            AdmissionConfig,
            "`args.admission` (`AdmissionArgs`): these fields, less `block_size` (it follows "
            "`engine.block_size`) and the ranking weights `affinity_weight`, `headroom_weight`, `queue_weight` "
            "and `lora_affinity` (they are `args.request_router`'s, so admission reserves where the router "
            "sends), plus `enabled` (default true; false: no admission actor).",
        ),
        Section(
            RouterConfig,
            "`args.request_router` (`RequestRouterArgs`): the KV-aware request router. These fields, less "
            "`block_size` (it follows `engine.block_size`), plus `enabled` (default true; false: Ray Serve's "
            "default router; admission still ranks with the weights set here).",
        ),
        Section(
            KVScalingConfig,
            "`args.kv_autoscaling.policy`; `min_replicas` and `max_replicas` come from `args.kv_autoscaling`.",
        ),
        Section(
            PrefillScalingConfig,
            "`args.disaggregation.prefill_autoscaling.policy`: the prefill replicas scale on the prompt tokens "
            "queued at them; `min_replicas` and `max_replicas` come from `prefill_autoscaling`.",
        ),
        Section(
            GuardConfig,
            "Built from `args.api_key` (or, where that is unset, the `CONVEYOR_API_KEY` environment "
            "variable of the router's process), `args.max_body_bytes` and "
            "`args.protect_health_metrics`.",
        ),
    )


def render() -> str:
    """docs/configuration.md, whole (ends with one newline)."""
    parts = [
        "# Configuration",
        f"Generated from the configuration types' source by `{COMMAND}`; do not edit by hand "
        "(tests/test_docs.py fails when this page and the code disagree). Types are the annotations as written; "
        "defaults are Python values (in YAML, `None` is `null`, `True` is `true`). Descriptions are the fields' "
        "own comments or `Field(description=...)`; a field without one has none here. "
        "Where the serving path's switches come from and what they trade is in [design.md](design.md).",
    ]
    for s in sections():
        doc = ast.get_docstring(_class_def(s.cls)[1])  # the class's own docstring, not dataclass's generated one
        parts.append(f"## {s.cls.__name__}")
        parts.append(f"`{s.cls.__module__}.{s.cls.__qualname__}`. {s.where}")
        if doc:
            parts.append(" ".join(doc.split()))
        parts.append(table(s.cls))
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
