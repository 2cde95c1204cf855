"""The LLMService CustomResourceDefinition, generated from `llumnix.service_spec` (the one definition).

`scripts/gen_crd.py` writes it to the chart; a test fails when the checked-in copy is stale.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from llumnix.service_spec import (
    API_GROUP,
    API_VERSION,
    CROSS_FIELD_RULES,
    KIND,
    NAME_CEL,
    NAME_MESSAGE,
    PLURAL,
    SHORT_NAMES,
    SPEC_SCHEMA,
)

CONDITION_TYPES = ["Ready", "Progressing", "Degraded"]

STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "observed state, written by the operator",
    "properties": {
        "observedGeneration": {"type": "integer"},
        "replicas": {"type": "integer", "description": "instances that exist (for the /scale subresource)"},
        "selector": {"type": "string", "description": "label selector of the engine pods (for HPA)"},
        "instances": {
            "type": "object",
            "properties": {"ready": {"type": "integer"}, "desired": {"type": "integer"}},
        },
        "aggregateFreeness": {
            "type": "number",
            "description": "freeness of the serving instances seen as one (free KV blocks per batched "
            "request, the whole backlog counted): what the autoscaler compares with scaleUpBelow and "
            "scaleDownAbove",
        },
        "headroom": {
            "type": "string",
            "description": "aggregateFreeness for a person: 'idle' when no request runs, else the "
            "decode steps each running request can still take before the KV cache is full",
        },
        "migrations": {
            "type": "object",
            "properties": {"completed": {"type": "integer"}, "aborted": {"type": "integer"}},
        },
        "instanceSummaries": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "phase": {"type": "string"},
                    "freeness": {"type": "number"},
                    "running": {"type": "integer"},
                    "waiting": {"type": "integer"},
                    "draining": {"type": "boolean"},
                },
            },
        },
        "lastScaling": {
            "type": "object",
            "properties": {
                "time": {"type": "string", "format": "date-time"},
                "action": {"type": "string"},
                "instance": {"type": "string"},
                "reason": {"type": "string"},
                "aggregateFreeness": {"type": "number"},
            },
        },
        "conditions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "status"],
                "properties": {
                    "type": {"type": "string", "enum": CONDITION_TYPES},
                    "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                    "reason": {"type": "string"},
                    "message": {"type": "string"},
                    "lastTransitionTime": {"type": "string", "format": "date-time"},
                },
            },
        },
    },
}

PRINTER_COLUMNS = [
    {"name": "Ready", "type": "integer", "jsonPath": ".status.instances.ready"},
    {"name": "Desired", "type": "integer", "jsonPath": ".status.instances.desired"},
    # priority 1 (`-o wide` only): the raw number, 32759 for an idle service, means little next to Headroom
    {"name": "Freeness", "type": "number", "jsonPath": ".status.aggregateFreeness", "priority": 1,
     "description": "aggregate freeness (free KV blocks per batched request), the autoscaler's signal"},
    {"name": "Headroom", "type": "string", "jsonPath": ".status.headroom",
     "description": "idle, or decode steps each running request can still take"},
    {"name": "Migrations", "type": "integer", "jsonPath": ".status.migrations.completed"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _spec_schema_with_rules() -> dict[str, Any]:
    """SPEC_SCHEMA with each cross-field rule attached, as CEL, to the node it is about."""
    schema = copy.deepcopy(SPEC_SCHEMA)
    for rule in CROSS_FIELD_RULES:
        node = schema["properties"][rule.path] if rule.path else schema
        node.setdefault("x-kubernetes-validations", []).append({"rule": rule.cel, "message": rule.message})
    return schema


def crd_manifest() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{API_GROUP}"},
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": SHORT_NAMES,
                "categories": ["llumnix"],
            },
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "required": ["spec"],
                            # The only rule over metadata the API server evaluates for a custom resource.
                            "x-kubernetes-validations": [{"rule": NAME_CEL, "message": NAME_MESSAGE}],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": _spec_schema_with_rules(),
                                "status": STATUS_SCHEMA,
                            },
                        }
                    },
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


def _field_rows(schema: dict[str, Any], path: str) -> list[str]:
    properties = schema.get("properties")
    if schema.get("type") == "object" and properties:
        return [row for key, sub in properties.items() for row in _field_rows(sub, f"{path}.{key}")]
    kind = schema.get("type", "")
    if "enum" in schema:
        kind += " (" + " \\| ".join(schema["enum"]) + ")"
    default = json.dumps(schema["default"]) if "default" in schema else ""
    limits = (("minimum", "≥"), ("maximum", "≤"))
    bounds = ", ".join(f"{sign} {schema[key]}" for key, sign in limits if key in schema)
    description = (schema.get("description") or "").replace("|", "\\|")
    return [f"| `{path}` | {kind} | {default} | {bounds} | {description} |"]


def spec_fields_table() -> str:
    """The Markdown table of every `.spec` field (scripts/gen_crd.py writes it into docs/operator.md)."""
    header = "| Field | Type | Default | Range | Meaning |\n|---|---|---|---|---|\n"
    return header + "\n".join(_field_rows(SPEC_SCHEMA, "spec")) + "\n"
