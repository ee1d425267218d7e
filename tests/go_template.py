"""A small evaluator of the Go text/template subset that Ollama chat TEMPLATEs use, run as Ollama runs them.

Supported: text, `{{-`/`-}}` whitespace trimming, output of an expression, `$x := expr`, `if`/`else if`/
`else`/`end`, `range .Messages` and `range $i, $_ := .Messages`. Expressions: `.Field`, `$.Field`, `$x`,
string and integer literals, parentheses, and the functions `eq ne and or not len slice`. Anything else
fails loudly, so a TEMPLATE that outgrows the subset cannot pass by being misread. Ollama's data (its
`template.Execute`): `.System` is every system message's content joined by blank lines, and `.Messages` is
the chat with consecutive messages of one role (tool messages excepted) merged by blank lines.
"""

from __future__ import annotations

import json
import re
from typing import Any

_ACTION = re.compile(r"(\{\{.*?\}\})", re.S)
_WORD = re.compile(r'\s*(\(|\)|"(?:[^"\\]|\\.)*"|[^\s()]+)')
_RANGE = re.compile(r"range (?:\$(\w+), \$\w* := )?\.Messages")


def _tokens(template: str) -> list[tuple[str, str]]:
    parts = _ACTION.split(template)
    for i, part in enumerate(parts):  # Go trims all whitespace before "{{- " and after " -}}"
        if part.startswith("{{- ") and i > 0:
            parts[i - 1] = parts[i - 1].rstrip(" \t\r\n")
        if part.endswith(" -}}") and i + 1 < len(parts):
            parts[i + 1] = parts[i + 1].lstrip(" \t\r\n")
    out = []
    for part in parts:
        action = re.fullmatch(r"\{\{-?\s*(.*?)\s*-?\}\}", part, re.S)
        out.append(("action", action.group(1)) if action else ("text", part))
    return [t for t in out if t != ("text", "")]


def _parse(tokens: list[tuple[str, str]], i: int = 0) -> tuple[list, int, str | None]:
    nodes: list = []
    while i < len(tokens):
        kind, value = tokens[i]
        if kind == "text":
            nodes.append(("text", value))
        elif value == "end" or value.startswith("else"):
            return nodes, i, value
        elif value.startswith("range "):
            loop = _RANGE.fullmatch(value)
            assert loop, f"unsupported Go template action {{{{ {value} }}}}"
            body, i, term = _parse(tokens, i + 1)
            assert term == "end", "range without end"
            nodes.append(("range", loop.group(1), body))
        elif value.startswith("if "):
            branches, cond = [], value[3:]
            while True:
                body, i, term = _parse(tokens, i + 1)
                branches.append((cond, body))
                if term == "end":
                    break
                assert term is not None, "if without end"
                cond = term.removeprefix("else").strip().removeprefix("if ").strip() or None
            nodes.append(("if", branches))
        elif assign := re.fullmatch(r"\$(\w+) :?= (.*)", value, re.S):
            nodes.append(("set", assign.group(1), assign.group(2)))
        else:
            nodes.append(("print", value))
        i += 1
    return nodes, i, None


def _truth(value: Any) -> bool:
    return bool(value)


_FUNCS = {
    "eq": lambda a, *bs: any(a == b for b in bs),
    "ne": lambda a, b: a != b,
    "not": lambda a: not _truth(a),
    "len": len,
    "slice": lambda seq, start=0, stop=None: seq[start:stop],  # Go's slice x 1 is x[1:]
}


def _field(name: str, dot: Any) -> Any:
    if isinstance(dot, dict) and name in dot:
        return dot[name]
    if isinstance(dot, dict) and name.lower() in dot:  # a message: {role, content}
        return dot[name.lower()]
    raise AssertionError(f"unsupported field .{name}")


def _expr(text: str, data: dict, dot: Any, scope: dict) -> Any:
    words = _WORD.findall(text)
    value, rest = _command(words, data, dot, scope)
    assert not rest, f"unsupported expression {text}"
    return value


def _command(words: list[str], data: dict, dot: Any, scope: dict) -> tuple[Any, list[str]]:
    """One command: a function with its arguments, or a single operand; stops at a closing parenthesis."""
    head, *rest = words
    if head in ("and", "or") or head in _FUNCS:
        args = []
        while rest and rest[0] != ")":
            arg, rest = _operand(rest, data, dot, scope)
            args.append(arg)
        if head == "and":
            return next((a for a in args if not _truth(a)), args[-1]), rest
        if head == "or":
            return next((a for a in args if _truth(a)), args[-1]), rest
        return _FUNCS[head](*args), rest
    return _operand(words, data, dot, scope)


def _operand(words: list[str], data: dict, dot: Any, scope: dict) -> tuple[Any, list[str]]:
    head, *rest = words
    if head == "(":
        value, rest = _command(rest, data, dot, scope)
        assert rest and rest[0] == ")", "unbalanced parenthesis"
        return value, rest[1:]
    if head.startswith('"'):
        return json.loads(head), rest
    if head.isdigit():
        return int(head), rest
    if head.startswith("$."):
        return _field(head[2:], data), rest
    if head.startswith("$"):
        assert head[1:] in scope, f"undefined variable {head}"
        return scope[head[1:]], rest
    if head.startswith("."):
        return _field(head[1:], dot), rest
    raise AssertionError(f"unsupported operand {head}")


def _eval(nodes: list, data: dict, dot: Any, scope: dict) -> str:
    out = []
    for node in nodes:
        if node[0] == "text":
            out.append(node[1])
        elif node[0] == "print":
            out.append(str(_expr(node[1], data, dot, scope)))
        elif node[0] == "set":
            scope[node[1]] = _expr(node[2], data, dot, scope)
        elif node[0] == "range":
            for i, message in enumerate(data["Messages"]):
                out.append(_eval(node[2], data, message, {**scope, **({node[1]: i} if node[1] else {})}))
        else:
            for cond, body in node[1]:
                if cond is None or _truth(_expr(cond, data, dot, scope)):
                    out.append(_eval(body, data, dot, dict(scope)))
                    break
    return "".join(out)


def _collate(messages: list[dict]) -> tuple[str, list[dict]]:
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    collated: list[dict] = []
    for m in messages:
        if collated and collated[-1]["role"] == m["role"] and m["role"] != "tool":
            collated[-1] = {**collated[-1], "content": collated[-1]["content"] + "\n\n" + m["content"]}
        else:
            collated.append(dict(m))
    return system, collated


def render_go(template: str, messages: list[dict]) -> str:
    """The prompt Ollama builds from `template` for a chat of {role, content} messages."""
    nodes, _, term = _parse(_tokens(template))
    assert term is None, f"unbalanced {term}"
    system, collated = _collate(messages)
    data = {"System": system, "Messages": collated}
    return _eval(nodes, data, data, {})
