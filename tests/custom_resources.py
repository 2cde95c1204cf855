"""Validates custom resources against the OpenAPI v3 schemas of their published CRDs, refusing what the
API server refuses under kubectl's strict field validation: schema violations, fields the schema does
not define, and duplicate keys in `x-kubernetes-list-type: map` / `set` lists. Metadata is checked only
as the CRD declares it (an object). A CRD with CEL rules is refused: they are not evaluated here."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import yaml

PROMETHEUS_OPERATOR_CRDS = Path(__file__).resolve().parent / "schemas/prometheus-operator"


def _unique_list_entries(
    validator: jsonschema.protocols.Validator, list_type: str, instance: Any, schema: dict[str, Any]
) -> Iterator[jsonschema.ValidationError]:
    if not validator.is_type(instance, "array") or list_type == "atomic":
        return
    if list_type == "map":
        key_names = schema["x-kubernetes-list-map-keys"]
        keys = [json.dumps([entry.get(k) for k in key_names]) for entry in instance]
    else:  # set
        keys = [json.dumps(entry, sort_keys=True) for entry in instance]
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        yield jsonschema.ValidationError(f"duplicate entries in a list of type {list_type}: {duplicates}")


_CRDValidator = jsonschema.validators.extend(
    jsonschema.Draft7Validator, {"x-kubernetes-list-type": _unique_list_entries}
)


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with every object that lists its properties closed to others (the API server would
    otherwise drop unknown fields silently)."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {name: _strict(sub) for name, sub in out["properties"].items()}
        if not out.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _strict(out["additionalProperties"])
    if "items" in out:
        out["items"] = _strict(out["items"])
    for combinator in ("allOf", "anyOf", "oneOf"):
        if combinator in out:
            out[combinator] = [_strict(sub) for sub in out[combinator]]
    return out


class CRDSchemas:
    """The served versions' schemas of the CRDs in one folder, by (apiVersion, kind)."""

    def __init__(self, folder: Path) -> None:
        self._validators: dict[tuple[str, str], jsonschema.protocols.Validator] = {}
        for path in sorted(folder.glob("*.yaml")):
            crd = yaml.safe_load(path.read_text())
            spec = crd["spec"]
            for version in spec["versions"]:
                if version["served"]:
                    openapi = version["schema"]["openAPIV3Schema"]
                    if "x-kubernetes-validations" in json.dumps(openapi):
                        raise NotImplementedError(f"{path.name} has CEL rules, which this does not evaluate")
                    schema = _strict(openapi)
                    self._validators[f"{spec['group']}/{version['name']}", spec["names"]["kind"]] = (
                        _CRDValidator(schema)
                    )

    def errors(self, resource: dict[str, Any]) -> list[str]:
        """Each way the resource breaks its CRD's schema, as 'dotted.path: message', sorted."""
        key = (resource["apiVersion"], resource["kind"])
        if key not in self._validators:
            raise LookupError(f"no CRD schema for {key}; known: {sorted(self._validators)}")
        return sorted(
            f"{'.'.join(str(p) for p in error.absolute_path)}: {error.message}"
            for error in self._validators[key].iter_errors(resource)
        )
