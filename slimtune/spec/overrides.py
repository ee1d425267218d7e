"""`--set a.b=value` overrides of a spec, as torchtune's `key=value` and Axolotl's `--key value` give.

Each override names a field by its dotted path (`train.learning_rate`, `export.push.repo_id`) and gives a
YAML value (`1e-4`, `true`, `[f16, q8_0]`). Paths are checked against the spec's sections before the
value is set, so a typo is reported as an unknown field instead of landing in the file silently; the
values are then validated with the rest of the spec, exactly as if they had been in the file.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml
from pydantic import BaseModel

from slimtune.core.bounded import NestingError, clip, load_yaml, short_repr
from slimtune.spec.schema import PipelineSpec, SpecError, _submodel


def parse_assignment(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value parsed as YAML); raises SpecError on a malformed assignment."""
    key, sep, raw = text.partition("=")
    parts = key.strip().split(".")
    shown = short_repr(text)
    if not sep or not all(p.strip() for p in parts):
        raise SpecError([f"--set {shown}: expected a dotted field path and a value, e.g. --set lora.r=32"])
    try:
        value = load_yaml(raw) if raw.strip() else None
    except NestingError as e:
        raise SpecError([f"--set {shown}: {e}"]) from None
    except yaml.YAMLError as e:
        raise SpecError([f"--set {shown}: the value is not valid YAML ({' '.join(str(e).split())})"]) from None
    return [p.strip() for p in parts], value


def _check_path(parts: list[str]) -> str | None:
    """None when `parts` names a field of the spec, else the problem (naming the fields that exist)."""
    model: type[BaseModel] | None = PipelineSpec
    for i, part in enumerate(parts):
        where = clip(".".join(parts[:i])) or "the spec"
        if model is None:
            return f"{where} is a value, not a section; set it as a whole (e.g. {clip(parts[0])}...=VALUE)"
        if part not in model.model_fields:
            return f"unknown field {short_repr('.'.join(parts[: i + 1]))}; {where} has {', '.join(model.model_fields)}"
        model = _submodel(model.model_fields[part].annotation)
    return None


def apply_overrides(data: dict[str, Any], assignments: list[str]) -> dict[str, Any]:
    """A copy of the raw spec mapping `data` with every `--set` assignment applied, in order.

    Raises:
        SpecError: every malformed assignment and unknown field path, one line each.
    """
    out = copy.deepcopy(data)
    problems = []
    for text in assignments:
        try:
            parts, value = parse_assignment(text)
        except SpecError as e:
            problems += e.problems
            continue
        problem = _check_path(parts)
        if problem:
            problems.append(f"--set {short_repr(text)}: {problem}")
            continue
        node = out
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}  # a section the file leaves at its defaults (or a null push section)
            node = node[part]
        node[parts[-1]] = value
    if problems:
        raise SpecError(problems)
    return out


def effective_yaml(spec: PipelineSpec) -> str:
    """The spec as it runs (file + overrides + defaults + resolved paths), as YAML to re-run it from."""
    header = "# The effective spec of this run: the file, its --set overrides and every default.\n"
    return header + yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)
