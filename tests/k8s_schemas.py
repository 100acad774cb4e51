"""Validate Kubernetes objects offline: `validate_object(obj)` raises `ManifestError` naming the
object and the first offending field, or returns quietly.

- Core objects (Deployment, StatefulSet, Job, Service, ...): `kubernetes_validate`'s bundled
  JSON schemas for Kubernetes `KUBERNETES_VERSION`, strict mode (unknown fields are errors, as
  `kubectl apply`'s server-side field validation makes them).
- Custom resources whose CRD schema is vendored under `k8s/schemas/` (Volcano `Queue` and `Job`,
  CloudNativePG `Cluster`): JSON Schema Draft 7 against the CRD's `openAPIV3Schema`, read the way
  the API server reads a structural schema: a `properties` object without
  `x-kubernetes-preserve-unknown-fields` takes no other fields, `nullable` admits null,
  `x-kubernetes-int-or-string` admits both, and `format: int32/int64` is range-checked; the other
  `x-kubernetes-*` keys (list types, CEL rules) are not evaluated. A Volcano Job's pod templates
  are also validated as core Pods.
- Every object needs `metadata.name` (a DNS subdomain); a kind with no schema is an error, never
  a silent pass.

`tests/test_k8s_manifests.py` validates the `k8s/` manifests with it; `tests/test_torchx_k8s.py`
validates the Volcano Job the torchx component generates. `python -m tests.k8s_schemas vendor
CRD.yaml OUT.json --repository ... --path ... --commit ...` re-extracts a vendored schema
(k8s/schemas/*/README.md).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[1]
SCHEMA_DIR = REPO / "k8s" / "schemas"
KUBERNETES_VERSION = "1.30"

# (apiVersion, kind) -> vendored openAPIV3Schema, relative to SCHEMA_DIR
CRD_SCHEMAS: dict[tuple[str, str], str] = {
    ("scheduling.volcano.sh/v1beta1", "Queue"): "volcano/queues.scheduling.volcano.sh-v1beta1.json",
    ("batch.volcano.sh/v1alpha1", "Job"): "volcano/jobs.batch.volcano.sh-v1alpha1.json",
    ("postgresql.cnpg.io/v1", "Cluster"): "cloudnativepg/clusters.postgresql.cnpg.io-v1.json",
}

_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
# keywords whose value is a schema, or a list or map of schemas
_SUBSCHEMA = ("additionalProperties", "items", "not")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "definitions")


class ManifestError(ValueError):
    """An object that the API server would refuse: `where` is `Kind/name`, `field` the dotted
    path of the offending field (empty for the object itself)."""

    def __init__(self, where: str, field: str, message: str) -> None:
        self.where, self.field, self.problem = where, field, message
        super().__init__(f"{where}: {field or '(object)'}: {message}")


def object_id(obj: Mapping[str, Any]) -> str:
    name = (obj.get("metadata") or {}).get("name", "<no name>")
    return f"{obj.get('kind', '<no kind>')}/{name}"


def _dotted(path: Iterable[Any]) -> str:
    return ".".join(str(p) for p in path)


# -- the API server's reading of a CRD schema ----------------------------------------------------


def structural(schema: Any) -> Any:
    """A copy of a CRD's openAPIV3Schema that plain JSON Schema validates the way the API server
    does (module docstring); every `x-kubernetes-*` key is dropped once read."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key in _SUBSCHEMA and isinstance(value, dict):
            out[key] = structural(value)
        elif key in _SUBSCHEMA_LISTS:
            out[key] = [structural(s) for s in value]
        elif key in _SUBSCHEMA_MAPS:
            out[key] = {name: structural(s) for name, s in value.items()}
        else:
            out[key] = value  # data (default, enum, ...) and plain keywords, as they are
    if schema.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable") and "type" in out:
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        out["type"] = [*types, "null"]
    if schema.get("x-kubernetes-embedded-resource") and "properties" in out:
        for field in ("apiVersion", "kind", "metadata"):
            out["properties"].setdefault(field, {})
    preserve = schema.get("x-kubernetes-preserve-unknown-fields") is True
    if "properties" in out and "additionalProperties" not in out and not preserve:
        out["additionalProperties"] = False  # pruned, or refused under strict field validation
    return out


def _format_checker() -> jsonschema.FormatChecker:
    checker = jsonschema.FormatChecker()
    for name, (low, high) in _INT_RANGES.items():

        def in_range(value: object, low: int = low, high: int = high) -> bool:
            return not isinstance(value, int) or isinstance(value, bool) or low <= value <= high

        checker.checks(name)(in_range)
    return checker


@functools.cache
def crd_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    path = SCHEMA_DIR / CRD_SCHEMAS[(api_version, kind)]
    schema = structural(json.loads(path.read_text()))
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema, format_checker=_format_checker())


# -- validation ----------------------------------------------------------------------------------


def _check_metadata(obj: Mapping[str, Any], where: str) -> None:
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        raise ManifestError(where, "metadata", "required object is missing")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise ManifestError(where, "metadata.name", "required")
    if len(name) > 253 or not _DNS_SUBDOMAIN.fullmatch(name):
        raise ManifestError(where, "metadata.name", f"{name!r} is not a DNS subdomain name")
    for field in ("labels", "annotations"):
        for key, value in (meta.get(field) or {}).items():
            if not isinstance(value, str):
                raise ManifestError(where, f"metadata.{field}.{key}", f"{value!r} is not a string")


def _validate_crd(obj: Mapping[str, Any], where: str) -> None:
    validator = crd_validator(obj["apiVersion"], obj["kind"])
    error = jsonschema.exceptions.best_match(validator.iter_errors(obj))
    if error is not None:
        raise ManifestError(where, _dotted(error.absolute_path), error.message)


def _validate_core(obj: Mapping[str, Any], where: str) -> None:
    try:
        kubernetes_validate.validate(dict(obj), KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise ManifestError(where, _dotted(exc.path), exc.message) from None
    except kubernetes_validate.SchemaNotFoundError as exc:
        raise ManifestError(
            where, "", f"no schema to validate it against ({exc.message})"
        ) from None


def validate_object(obj: Mapping[str, Any]) -> None:
    """Raise ManifestError unless `obj` is a valid object of its kind (module docstring)."""
    if not isinstance(obj, Mapping):
        raise ManifestError("<not an object>", "", f"expected a mapping, got {type(obj).__name__}")
    where = object_id(obj)
    for field in ("apiVersion", "kind"):
        if not isinstance(obj.get(field), str) or not obj.get(field):
            raise ManifestError(where, field, "required string is missing")
    _check_metadata(obj, where)
    if (obj["apiVersion"], obj["kind"]) in CRD_SCHEMAS:
        _validate_crd(obj, where)
    else:
        _validate_core(obj, where)
    if (obj["apiVersion"], obj["kind"]) == ("batch.volcano.sh/v1alpha1", "Job"):
        for i, task in enumerate((obj.get("spec") or {}).get("tasks") or []):
            template = task.get("template") or {}
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": template.get("metadata") or {},
                "spec": template.get("spec") or {},
            }
            try:
                _validate_core(pod, where)
            except ManifestError as exc:
                field = f"spec.tasks.{i}.template.{exc.field}".rstrip(".")
                raise ManifestError(where, field, exc.problem) from None


def validate_all(objects: Iterable[Mapping[str, Any]]) -> None:
    for obj in objects:
        validate_object(obj)


# -- vendoring a CRD's schema ------------------------------------------------------------------


def strip_descriptions(schema: Any) -> Any:
    """The schema without `description` keywords (property names and data stay untouched)."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "description":
            continue
        if key in _SUBSCHEMA and isinstance(value, dict):
            out[key] = strip_descriptions(value)
        elif key in _SUBSCHEMA_LISTS:
            out[key] = [strip_descriptions(s) for s in value]
        elif key in _SUBSCHEMA_MAPS:
            out[key] = {name: strip_descriptions(s) for name, s in value.items()}
        else:
            out[key] = copy.deepcopy(value)
    return out


def vendor_crd(
    crd_text: str, version: str, *, repository: str, path: str, commit: str, license: str
) -> dict[str, Any]:
    """`spec.versions[name == version].schema.openAPIV3Schema` of a CRD, descriptions removed,
    with its source recorded under `x-source` (and `$comment`)."""
    crd = yaml.safe_load(crd_text)
    (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    source = {
        "crd": crd["metadata"]["name"],
        "version": version,
        "repository": repository,
        "path": path,
        "commit": commit,
        "license": license,
    }
    return {
        "$comment": (
            f"openAPIV3Schema of CRD {source['crd']} {version}, from {repository} at commit "
            f"{commit}, {path}; {license}; descriptions removed, nothing else changed"
        ),
        "x-source": source,
        **strip_descriptions(entry["schema"]["openAPIV3Schema"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.k8s_schemas")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("vendor", help="extract a CRD's openAPIV3Schema as JSON")
    p.add_argument("crd", type=Path, help="the CRD YAML file")
    p.add_argument("out", type=Path, help="the JSON file to write")
    p.add_argument("--version", required=True, help="the CRD version, e.g. v1beta1")
    p.add_argument("--repository", required=True, help="e.g. https://github.com/volcano-sh/volcano")
    p.add_argument("--path", required=True, help="the CRD's path in that repository")
    p.add_argument("--commit", required=True)
    p.add_argument("--license", default="Apache-2.0")
    args = parser.parse_args(argv)
    schema = vendor_crd(
        args.crd.read_text(),
        args.version,
        repository=args.repository,
        path=args.path,
        commit=args.commit,
        license=args.license,
    )
    args.out.write_text(json.dumps(schema, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
