"""Arguments read as text, given the types the tool's JSON schema names, as vLLM's engine parsers
do (qwen3_xml's parameters are all text; mistral's JSON values are corrected the same way).

The rule, vLLM's `coerce_to_schema_type` and `ParserEngine._fix_arg_types`: a string value of a
property whose schema names types is read as the first of null, integer, number, boolean,
object, array that it parses as (a string type keeps it), else as JSON, else kept; a value that
is not a string is written as JSON and read the same way; objects and arrays are followed into
their `properties` and `items`. Infinite or NaN numbers stay text (JSON has none). The arguments
are written again (json.dumps, non-ASCII kept) only when a value changed.
"""

from __future__ import annotations

import json
import math
from typing import Any

from rollwire.proxy.http.dialect.toolcalls.base import Tools

_ALIASES = {
    **dict.fromkeys(("str", "text", "varchar", "char", "enum"), "string"),
    **dict.fromkeys(("int", "int32", "int64", "uint", "uint32", "uint64", "long", "short", "unsigned"), "integer"),
    **dict.fromkeys(("float", "float32", "float64", "double"), "number"),
    "bool": "boolean",
    "dict": "object",
    **dict.fromkeys(("arr", "list", "sequence"), "array"),
}
_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")
_ENUM_TYPES = (
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)


def properties(tools: Tools, name: str) -> dict[str, Any]:
    """The `properties` of the first tool named `name` ({} when none or not an object)."""
    for tool in tools:
        function = tool.get("function")
        if isinstance(function, dict) and function.get("name") == name:
            params = function.get("parameters")
            props = params.get("properties", {}) if isinstance(params, dict) else {}
            return props if isinstance(props, dict) else {}
    return {}


def fix_types(arguments: str, name: str, tools: Tools) -> str:
    """`arguments` (a JSON string) with its values read as tool `name`'s schema types."""
    if not tools or not name:
        return arguments
    try:
        args = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
    props = properties(tools, name)
    if not isinstance(args, dict) or not props:
        return arguments
    return json.dumps(args, ensure_ascii=False) if _fix_dict(args, props) else arguments


def _fix_dict(args: dict[str, Any], props: dict[str, Any]) -> bool:
    changed = False
    for key, value in args.items():
        schema = props.get(key)
        if isinstance(schema, dict):
            fixed, moved = _fix(value, schema)
            if moved:
                args[key], changed = fixed, True
    return changed


def _fix(value: Any, schema: dict[str, Any]) -> tuple[Any, bool]:
    if isinstance(value, str):
        fixed = coerce(value, types(schema))
        return fixed, fixed is not value
    if isinstance(value, dict):
        nested = schema.get("properties")
        return value, isinstance(nested, dict) and _fix_dict(value, nested)
    if isinstance(value, list):
        items = schema.get("items")
        changed = False
        if isinstance(items, dict):
            for i, item in enumerate(value):
                fixed, moved = _fix(item, items)
                if moved:
                    value[i], changed = fixed, True
        return value, changed
    fixed = coerce(json.dumps(value, ensure_ascii=False), types(schema))
    return fixed, type(fixed) is not type(value) or fixed != value


def types(schema: Any) -> list[str]:
    """The types a schema names: `type`, its `enum` values' types, and `anyOf`/`oneOf`/`allOf`'s."""
    if not isinstance(schema, dict):
        return ["string"]
    found: set[str] = set()
    kind = schema.get("type")
    if isinstance(kind, str):
        found.add(kind)
    elif isinstance(kind, list):
        found.update(t for t in kind if isinstance(t, str))
    enum = schema.get("enum")
    if isinstance(enum, list):
        for value in enum:
            if value is None:
                found.add("null")
                continue
            found.update(next(([n] for t, n in _ENUM_TYPES if isinstance(value, t)), []))
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list):
            for choice in schema[key]:
                found.update(types(choice))
    return list(found) if found else ["string"]


def coerce(value: str, kinds: list[str]) -> Any:
    """`value` read as the first of `kinds` it parses as (the order null, integer, number,
    boolean, object, array, string), else as JSON, else itself (the same object)."""
    wanted = {_ALIASES.get(k.strip().lower(), k.strip().lower()) for k in kinds}
    for kind in _ORDER:
        if kind not in wanted:
            continue
        if kind == "null" and value.lower() == "null":
            return None
        if kind == "string":
            return value
        if kind == "integer":
            try:
                return int(value)
            except ValueError:
                continue
        if kind == "number":
            try:
                number = float(value)
            except ValueError:
                continue
            if math.isfinite(number):
                return number if number != int(number) else int(number)
        if kind == "boolean":
            word = value.lower().strip()
            if word in ("true", "1", "false", "0"):
                return word in ("true", "1")
        if kind in ("object", "array"):
            parsed = _json(value)
            if parsed is not _NONE:
                return parsed
    parsed = _json(value)
    return value if parsed is _NONE else parsed


_NONE = object()


def _json(value: str) -> Any:
    """`value` as finite JSON, or _NONE."""
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):
        return _NONE
    return parsed if _finite(parsed) else _NONE


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True
