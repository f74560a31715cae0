"""A Kubernetes object held to the API's schema as the official client's models spell it.

``ApiClient.deserialize`` alone drops fields it does not know and takes a
number where a string belongs; the API server rejects both (or, worse, drops
the field: an ``imagePullSecret`` typo would leave the pod without its
credentials). This walks the document against each model's ``attribute_map``
and ``openapi_types``: every field must be one the model has, of its type,
and the client's own required-field checks run on the way.
"""

from __future__ import annotations

import json
from typing import Any

import kubernetes


class SchemaError(AssertionError):
    pass


def _check(value: Any, type_name: str, where: str) -> None:
    if type_name.startswith(("list[", "List[")):
        if not isinstance(value, list):
            raise SchemaError(f"{where}: expected a list, got {type(value).__name__}")
        for n, item in enumerate(value):
            _check(item, type_name[5:-1], f"{where}[{n}]")
        return
    if type_name.startswith(("dict(", "Dict[")):
        inner = type_name[5:-1].split(", ", 1)[1]
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise SchemaError(f"{where}: expected a mapping of strings, got {value!r}")
        for key, item in value.items():
            _check(item, inner, f"{where}.{key}")
        return
    simple = {"str": str, "int": int, "bool": bool, "float": (int, float), "datetime": str, "date": str}
    if type_name in simple:
        wrong_bool = type_name in ("int", "float", "str") and isinstance(value, bool)
        if wrong_bool or not isinstance(value, simple[type_name]):  # type: ignore[arg-type]
            raise SchemaError(f"{where}: expected {type_name}, got {value!r}")
        return
    if type_name == "object":
        return
    model = getattr(kubernetes.client, type_name)
    if not isinstance(value, dict):
        raise SchemaError(f"{where}: expected a {type_name} object, got {value!r}")
    by_json = {json_name: attr for attr, json_name in model.attribute_map.items()}
    for key, item in value.items():
        if key not in by_json:
            raise SchemaError(f"{where}: {type_name} has no field {key!r}")
        _check(item, model.openapi_types[by_json[key]], f"{where}.{key}")


def validate(doc: dict[str, Any], kind: str) -> Any:
    """``doc`` checked field by field against model ``kind`` (V1Job, V1ConfigMap), then loaded by the client
    (its required fields and enumerations); the model. SchemaError naming the path of the first fault."""
    _check(doc, kind, kind)
    try:
        return kubernetes.client.ApiClient().deserialize(json.dumps(doc), kind, "application/json")
    except ValueError as exc:
        raise SchemaError(f"{kind}: {exc}") from None
