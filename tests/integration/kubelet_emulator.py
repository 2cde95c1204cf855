"""Plays the kubelet (and the Deployment controller, endpoints and DNS) for the emulated API server:
every engine pod the operator creates is started as local processes from the pod's own containers
(command, args, env), and every router Deployment as one router process.

The "pod network" is the loopback range: each pod gets its own 127.0.1.x address, and inside its
containers `127.0.0.1` and `0.0.0.0` (the pod's own addresses) become that IP; emptyDir mounts
become per-pod directories; `python` and `llumnix` run from this virtualenv. Readiness comes from the
pod's readiness probe (the llumlet's /health); pod IP, phase and the Ready condition are written back
through the API. A deleted pod runs its preStop hook, then gets SIGTERM (SIGKILL after a grace).
The headless Service's DNS is a file of ready llumlet addresses (`--instances-dns` becomes
`--instances-file`)."""

from __future__ import annotations

import base64
import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes

from llumnix_operator.naming import LLUMLET_GRPC_PORT, LLUMLET_HTTP_PORT

STOP_GRACE_S = 10.0


@dataclass
class FakePod:
    name: str
    ip: str
    root: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    hooks: dict[str, list[str]] = field(default_factory=dict)
    ready: bool = False
    failed: bool = False


class Kubelet:
    def __init__(self, api_url: str, namespace: str = "default") -> None:
        self.api = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=api_url))
        self.core = kubernetes.client.CoreV1Api(self.api)
        self.apps = kubernetes.client.AppsV1Api(self.api)
        self.namespace = namespace
        self.root = Path(tempfile.mkdtemp(prefix="kl", dir="/tmp"))  # short: ipc:// paths are limited
        self.instances_file = self.root / "llumlets.txt"
        self.instances_file.write_text("")
        self.pods: dict[str, FakePod] = {}
        self.routers: dict[str, FakePod] = {}
        self._addresses = itertools.count(10)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kubelet")
        self.errors: list[BaseException] = []

    # ---- running containers ------------------------------------------------------------------

    def _new_ip(self) -> str:
        n = next(self._addresses)
        return f"127.0.{1 + n // 250}.{n % 250 + 1}"

    def _translate(self, word: str, pod: FakePod, mounts: dict[str, Path], env: dict[str, str]) -> str:
        if mounts:  # one pass, longest mount first: a local path (itself under /tmp) is not rewritten again
            pattern = "|".join(re.escape(m) for m in sorted(mounts, key=len, reverse=True))
            word = re.sub(f"({pattern})(?=/|$)", lambda m: str(mounts[m.group(1)]), word)
        for name, value in env.items():  # $(VAR) references, as the kubelet expands them
            word = word.replace(f"$({name})", value)
        return word.replace("127.0.0.1", pod.ip).replace("0.0.0.0", pod.ip)

    def _argv(self, argv: list[str], pod: FakePod, mounts: dict[str, Path], env: dict[str, str]) -> list[str]:
        head = {"python": [sys.executable], "llumnix": [sys.executable, "-m", "llumnix.cli"]}
        out = head.get(argv[0], [argv[0]]) + [self._translate(a, pod, mounts, env) for a in argv[1:]]
        if "--instances-dns" in out:  # the headless Service's DNS: a file the kubelet keeps current
            i = out.index("--instances-dns")
            out[i:i + 2] = ["--instances-file", str(self.instances_file)]
        return out

    def _env(self, container: dict, pod_name: str, pod: FakePod, mounts: dict[str, Path]) -> dict[str, str]:
        declared: dict[str, str] = {}
        for item in container.get("env") or []:
            if "value" in item:
                declared[item["name"]] = self._translate(item["value"], pod, mounts, declared)
            elif "secretKeyRef" in item["valueFrom"]:  # read when the container starts, as the kubelet does
                ref = item["valueFrom"]["secretKeyRef"]
                secret = self.core.read_namespaced_secret(ref["name"], self.namespace)
                declared[item["name"]] = base64.b64decode(secret.data[ref["key"]]).decode()
            else:
                path = item["valueFrom"]["fieldRef"]["fieldPath"]
                declared[item["name"]] = {"metadata.name": pod_name, "status.podIP": pod.ip}[path]
        return declared

    def _start(self, name: str, spec: dict) -> FakePod:
        pod = FakePod(name, self._new_ip(), Path(tempfile.mkdtemp(prefix="p", dir=self.root)))
        volumes = {v["name"]: pod.root / v["name"] for v in spec.get("volumes") or []}
        for path in volumes.values():
            path.mkdir()
        for container in spec["containers"]:
            mounts = {m["mountPath"]: volumes.get(m["name"], pod.root / m["name"])
                      for m in container.get("volumeMounts") or [] if m["mountPath"] != "/dev/shm"}
            env = self._env(container, name, pod, mounts)
            argv = self._argv(container["command"] + container.get("args", []), pod, mounts, env)
            log = open(pod.root / f"{container['name']}.log", "wb")  # noqa: SIM115 (the process owns it)
            pod.processes[container["name"]] = subprocess.Popen(
                argv, env={**os.environ, "PYTHONSAFEPATH": "1", **env}, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, cwd=pod.root, start_new_session=True)
            hook = (container.get("lifecycle") or {}).get("preStop", {}).get("exec", {}).get("command")
            if hook:
                pod.hooks[container["name"]] = self._argv(hook, pod, mounts, env)
        return pod

    def _stop_pod(self, pod: FakePod, run_hooks: bool) -> None:
        if run_hooks and not pod.failed:
            hooks = [subprocess.Popen(h, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for h in pod.hooks.values()]
            for hook in hooks:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    hook.wait(60)
        for process in pod.processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for process in pod.processes.values():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(5)

    def kill(self, name: str) -> None:
        """The pod's processes die (a node lost, an OOM kill): SIGKILL, and the pod turns Failed."""
        pod = self.pods[name]
        for process in pod.processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)

    # ---- the sync loop -----------------------------------------------------------------------

    def _healthy(self, pod: FakePod) -> bool:
        try:
            with urllib.request.urlopen(f"http://{pod.ip}:{LLUMLET_HTTP_PORT}/health", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def _write_status(self, pod: FakePod, status: dict[str, Any]) -> None:
        with contextlib.suppress(kubernetes.client.ApiException):
            self.core.patch_namespaced_pod_status(pod.name, self.namespace, {"status": status},
                                                  _content_type="application/merge-patch+json")

    def _sync_pods(self) -> None:
        listed = {p.metadata.name: self.api.sanitize_for_serialization(p)
                  for p in self.core.list_namespaced_pod(self.namespace).items}
        for name, raw in listed.items():
            if name not in self.pods:
                self.pods[name] = self._start(name, raw["spec"])
                self._write_status(self.pods[name], {"phase": "Pending", "podIP": self.pods[name].ip})
            pod = self.pods[name]
            if pod.failed:
                continue
            if any(p.poll() is not None for p in pod.processes.values()):
                pod.failed = True
                self._stop_pod(pod, run_hooks=False)
                self._write_status(pod, {"phase": "Failed", "message": "a container exited",
                                         "conditions": [{"type": "Ready", "status": "False"}]})
            elif not pod.ready and self._healthy(pod):
                pod.ready = True
                self._write_status(pod, {"phase": "Running", "podIP": pod.ip,
                                         "conditions": [{"type": "Ready", "status": "True"}]})
        for name in set(self.pods) - set(listed):
            threading.Thread(target=self._stop_pod, args=(self.pods.pop(name), True), daemon=True).start()
        ready = sorted(f"{p.ip}:{LLUMLET_GRPC_PORT}" for p in self.pods.values() if p.ready and not p.failed)
        text = "\n".join(ready) + "\n"
        if self.instances_file.read_text() != text:
            self.instances_file.write_text(text)

    def _sync_routers(self) -> None:
        for deployment in self.apps.list_namespaced_deployment(self.namespace).items:
            raw = self.api.sanitize_for_serialization(deployment)
            name = raw["metadata"]["name"]
            if name not in self.routers:
                self.routers[name] = self._start(f"{name}-0", raw["spec"]["template"]["spec"])

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync_pods()
                self._sync_routers()
            except Exception as exc:  # kept for the test to report
                self.errors.append(exc)
            self._stop.wait(0.2)

    def router_url(self, deployment: str, port: int) -> str:
        return f"http://{self.routers[deployment].ip}:{port}"

    def __enter__(self) -> Kubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        for pod in [*self.pods.values(), *self.routers.values()]:
            self._stop_pod(pod, run_hooks=False)
