"""An in-process Kubernetes API for the operator tests: kmock 0.8's KubernetesEmulator, served on a
thread of its own, with the server-side behaviour kopf and the official client depend on (kmock has no
such logic: no uids, resource versions, generations, generateName, 201 on create or status subresource).

Relies on kmock 0.8 internals (`_handle`, `_serve_*`, `kmock._internal.dicts`); re-check on upgrade."""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonpatch
import kmock
import yaml
from kmock._internal import parsing
from kmock._internal.dicts import merge_patch_dict

from llumnix.service_spec import API_GROUP, API_VERSION, KIND, PLURAL

CR_RESOURCE = f"{API_GROUP}/{API_VERSION}/{PLURAL}"
PEERING_RESOURCE = "kopf.dev/v1/kopfpeerings"


def _parse_path(path: str) -> parsing.ParsedPath:
    """kmock 0.8 reads `/api/v1/namespaces[/NAME[/SUB]]` as a namespace prefix without a resource; it
    is the Namespace resource itself (kopf lists and watches it to find the namespaces to serve)."""
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and (
        len(parts) <= 4 or (len(parts) == 5 and parts[4] in ("status", "finalize"))
    ):
        name, subresource = [*parts[3:], None, None][:2]
        return parsing.ParsedPath("", "v1", "namespaces", None, name, subresource)
    return _kmock_parse_path(path)


_kmock_parse_path = parsing.parse_path
parsing.parse_path = _parse_path


class ApiServerEmulator(kmock.KubernetesEmulator):
    """Assigns server fields on create, applies patches (JSON and merge) to whole objects, keeps
    `.status` and the rest apart (status subresource), and answers lists with a resourceVersion."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._versions = itertools.count(1)
        self.last_version = 0

    def _next_version(self) -> str:
        self.last_version = next(self._versions)
        return str(self.last_version)

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is not None and request.action == kmock.action.CREATE:
            self._assign_server_fields(request)
        elif request.resource is not None and request.action == kmock.action.UPDATE and request.name:
            self._apply_patch(request)
        return await super()._handle(request)

    async def _serve_create(self, request: kmock.Request) -> Any:
        return kmock.Response(status=201, payload=await super()._serve_create(request))

    async def _serve_list(self, request: kmock.Request) -> Any:
        result = await super()._serve_list(request)
        resource = request.resource
        kind = self.resources[resource].kind if resource in self.resources else "Object"
        return {
            "apiVersion": f"{resource.group}/{resource.version}".lstrip("/"),
            "kind": f"{kind}List",
            **result,
            "metadata": {"resourceVersion": str(self.last_version)},
        }

    async def _serve_watch(self, request: kmock.Request) -> Any:
        since = request.params.get("resourceVersion", "")
        async for event in super()._serve_watch(request):
            # A watch from a listed version must not replay what the list returned.
            if (
                since.isdigit()
                and isinstance(event, dict)
                and event.get("type") == "ADDED"
                and int(event["object"]["metadata"].get("resourceVersion", 0)) <= int(since)
            ):
                continue
            yield event

    @staticmethod
    def _set_data(request: kmock.Request, data: Any) -> None:
        object.__setattr__(request, "data", data)  # kmock matches on its recorded request: mutate in place

    def _assign_server_fields(self, request: kmock.Request) -> None:
        data = copy.deepcopy(request.data or {})
        meta = data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if request.namespace:
            meta["namespace"] = request.namespace
        meta.update(
            uid=str(uuid.uuid4()),
            resourceVersion=self._next_version(),
            generation=1,
            creationTimestamp=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        )
        self._set_data(request, data)

    def _apply_patch(self, request: kmock.Request) -> None:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return  # kmock answers 404
        old = copy.deepcopy(self.objects[key].raw)
        try:
            new = (
                jsonpatch.apply_patch(old, request.data)
                if isinstance(request.data, list)
                else merge_patch_dict(old, request.data or {})
            )
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc)) from exc
        new = copy.deepcopy(dict(new))
        info = self.resources[request.resource] if request.resource in self.resources else None  # noqa: SIM401
        if request.subresource == "status":
            new = {**old, "status": new.get("status")}
        elif request.subresource == "scale":  # the Scale object's spec.replicas is the resource's
            new = {**old, "spec": {**old.get("spec", {}), "replicas": new.get("spec", {}).get("replicas")}}
        elif info is not None and "status" in info.subresources:
            new["status"] = old.get("status")
        if new.get("status") is None:
            new.pop("status", None)
        meta = new.setdefault("metadata", {})
        for field in ("uid", "creationTimestamp", "namespace", "name"):
            if field in old.get("metadata", {}):
                meta[field] = old["metadata"][field]

        def body(obj: dict) -> dict:
            return {k: v for k, v in obj.items() if k not in ("metadata", "status")}

        meta["generation"] = old.get("metadata", {}).get("generation", 1) + (body(new) != body(old))
        meta["resourceVersion"] = self._next_version()
        self._set_data(request, [{"op": "replace", "path": "", "value": new}])

    # ---- what tests read -------------------------------------------------------------------

    def live(self, plural: str, namespace: str = "default") -> dict[str, dict]:
        """Objects of a resource (by plural) that exist now, by name."""
        return {
            name: obj.raw
            for (res, ns, name), obj in self.objects.items()
            if res.plural == plural and ns == namespace and not obj.deleted
        }

    def writes(self) -> Iterator[tuple[str, str, str | None, str | None]]:
        """(method, plural, name, subresource) of every create, patch and delete received so far."""
        for request in list(self._requests):
            if request.method in ("POST", "PATCH", "PUT", "DELETE") and request.resource is not None:
                yield str(request.method.value), request.resource.plural, request.name, request.subresource


class EmulatedCluster:
    """The emulator on 127.0.0.1:<random port>, its own thread and event loop, with the LLMService
    and kopf's KopfPeering resources registered (the chart's CRDs); `kubeconfig` points a client (and
    kopf) at it."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self._ready = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)

    async def _serve(self) -> None:
        async with ApiServerEmulator() as emulator, kmock.Server(emulator) as server:
            self.emulator = emulator
            self.url = str(server.url).rstrip("/")
            self._stop = asyncio.Event()
            self._loop = asyncio.get_running_loop()
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> EmulatedCluster:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the emulated API server did not start")
        self.emulator.resources.load_bundled()
        self.emulator.resources[CR_RESOURCE] = {
            "kind": KIND,
            "singular": KIND.lower(),
            "namespaced": True,
            "subresources": {"status", "scale"},
            "verbs": {"get", "list", "watch", "create", "patch", "update", "delete"},
        }
        self.emulator.objects["v1/namespaces", None, "default"] = {
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default", "uid": str(uuid.uuid4()),
                                                                  "resourceVersion": "0"}}
        # kopf's peering resource, as charts/llumnix/crds/kopf-peering.yaml installs it (no subresources)
        self.emulator.resources[PEERING_RESOURCE] = {
            "kind": "KopfPeering",
            "singular": "kopfpeering",
            "namespaced": True,
            "subresources": set(),
            "verbs": {"get", "list", "watch", "create", "patch", "update", "delete"},
        }
        self.kubeconfig = self.tmp_path / "kubeconfig"
        self.kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "emulated",
                    "clusters": [{"name": "emulated", "cluster": {"server": self.url}}],
                    "users": [{"name": "test", "user": {"token": "test"}}],
                    "contexts": [
                        {
                            "name": "emulated",
                            "context": {"cluster": "emulated", "user": "test", "namespace": "default"},
                        }
                    ],
                }
            )
        )
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
