"""Chaos for the operator's cluster in a test: two `llumnix operator --peering` processes (as the chart
runs them) against the emulated API server, the fake kubelet running engine pods and the router as
local processes, and a steady load through the router while a seeded schedule kills -9 an engine pod,
kills -9 the acting operator replica (a new one starts, as its Deployment would), kills it again in
the middle of a drain, and scales the service up and down through /scale. No request may fail; the
engine pods never outnumber the most replicas asked for by more than one (no duplicates), end at the
desired count, all owned by the LLMService (no orphans); no operator logs a traceback."""

from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import kubernetes
import pytest
from cluster_harness import Load, healthy, sim_service, wait_for
from kube_emulator import EmulatedCluster
from kubelet_emulator import Kubelet

from llumnix_operator.naming import ENGINE, selector_string

pytestmark = pytest.mark.slow
G, V, P, NS = "llumnix.io", "v1alpha1", "llmservices", "default"
MERGE = "application/merge-patch+json"
PEERING = "llumnix"
PEERING_LIFETIME_S = 8
"""How long a killed replica's peering entry blocks the standby (production: 60 s)."""
SEED = int(os.environ.get("LLUMNIX_OPERATOR_CHAOS_SEED", "1"))
FAULTS = ("engine", "operator", "scale-up", "scale-down", "operator-mid-drain")


class OperatorReplicas:
    """`llumnix operator --peering` processes; each gets its pod name as kopf's identity (POD_ID)."""

    def __init__(self, kubeconfig: Path, logs: Path) -> None:
        self.kubeconfig = kubeconfig
        self.logs = logs
        self.processes: dict[str, subprocess.Popen] = {}
        self._names = (f"operator-{i}" for i in itertools.count())

    def start(self) -> str:
        name = next(self._names)
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "POD_ID": name, "PYTHONSAFEPATH": "1"}
        with open(self.logs / f"{name}.log", "wb") as log:
            self.processes[name] = subprocess.Popen(
                [sys.executable, "-m", "llumnix.cli", "operator", "--namespace", NS, "--peering", PEERING,
                 "--peering-lifetime", str(PEERING_LIFETIME_S), "--metrics-port", "0"],
                env=env, cwd=self.logs, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        return name

    def alive(self) -> set[str]:
        return {name for name, p in self.processes.items() if p.poll() is None}

    def kill(self, name: str) -> None:
        self.processes[name].send_signal(signal.SIGKILL)
        self.processes[name].wait(10)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def __enter__(self) -> OperatorReplicas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


class PodCounter:
    """Samples the engine pods through the API every 0.1 s against `asked`: the replicas asked for since
    the service last settled (the test appends each count before it sends it, and keeps only the last
    once every pod of it is ready)."""

    def __init__(self, core: kubernetes.client.CoreV1Api, selector: str, asked: list[int]) -> None:
        self.core = core
        self.selector = selector
        self.asked = asked
        self.samples = 0
        self.excess: list[tuple[int, int]] = []
        """(pods, most replicas asked for since the last settle) of each sample with over one too many."""
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            most = max(self.asked)  # read before the list: a scale-up is recorded before it is sent
            pods = len(self.core.list_namespaced_pod(NS, label_selector=self.selector).items)
            self.samples += 1
            self.peak = max(self.peak, pods)
            if pods > most + 1:
                self.excess.append((pods, most))

    def __enter__(self) -> PodCounter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def test_two_operator_replicas_survive_chaos_under_load(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    schedule = list(FAULTS)
    rng.shuffle(schedule)
    started = time.monotonic()
    logs = tmp_path / "operators"
    logs.mkdir()
    with (
        EmulatedCluster(tmp_path) as cluster,
        Kubelet(cluster.url) as kubelet,
        OperatorReplicas(cluster.kubeconfig, logs) as operators,
    ):
        api = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=cluster.url))
        custom = kubernetes.client.CustomObjectsApi(api)
        core = kubernetes.client.CoreV1Api(api)
        selector = selector_string("sim", ENGINE)

        def engine_pods() -> list[dict]:
            return [api.sanitize_for_serialization(p)
                    for p in core.list_namespaced_pod(NS, label_selector=selector).items]

        def settled(n: int) -> bool:
            pods = engine_pods()
            conditions = [(p.get("status") or {}).get("conditions") or [] for p in pods]
            return len(pods) == n and all(
                any(c["type"] == "Ready" and c["status"] == "True" for c in pod) for pod in conditions
            )

        def peers() -> dict[str, dict]:
            body = custom.get_namespaced_custom_object("kopf.dev", "v1", NS, "kopfpeerings", PEERING)
            return dict(body.get("status") or {})

        def events(reason: str) -> int:
            return sum(e.get("reason") == reason for e in cluster.emulator.live("events").values())

        desired = [2]
        asked = [2]  # since the last settle: what PodCounter allows (plus one)

        def scale(n: int) -> None:
            desired.append(n)
            asked.append(n)
            custom.patch_namespaced_custom_object_scale(G, V, NS, P, "sim", {"spec": {"replicas": n}},
                                                        _content_type=MERGE)

        def kill_acting_operator() -> str:
            """Kills -9 the replica that acts (the highest priority in the peering) once both replicas
            are registered, starts a new one and waits for the standby to take over (it removes the
            dead replica's entry when it resumes)."""
            live = wait_for(lambda: set(peers()) == operators.alive() and peers(), 60, "both replicas peered")
            acting = max(live, key=lambda name: live[name]["priority"])
            operators.kill(acting)
            operators.start()
            wait_for(lambda: acting not in peers(), 60, f"a standby taking over from {acting}")
            return acting

        # The chart creates the peering object; its Deployment starts the replicas together.
        custom.create_namespaced_custom_object("kopf.dev", "v1", NS, "kopfpeerings", {
            "apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": PEERING}})
        operators.start()
        operators.start()
        custom.create_namespaced_custom_object(G, V, NS, P, sim_service("sim", 2))
        wait_for(lambda: settled(2), 120, "two ready engine pods")
        wait_for(lambda: "sim-router" in kubelet.routers, 30, "the router")
        url = kubelet.router_url("sim-router", 8000)
        wait_for(lambda: healthy(url), 60, "the router's /health")

        timings: list[tuple[str, float]] = []
        killed_operators: list[str] = []
        with PodCounter(core, selector, asked) as counter, Load(url) as load:
            wait_for(lambda: load.ok >= 5, 60, "requests through the router")
            for fault in schedule:
                began = time.monotonic()
                n = desired[-1]
                if fault == "engine":
                    victim = rng.choice(sorted(p["metadata"]["name"] for p in engine_pods()))
                    kubelet.kill(victim)
                    wait_for(lambda v=victim: v not in {p["metadata"]["name"] for p in engine_pods()},
                             60, f"the killed pod {victim} removed")
                elif fault == "operator":
                    killed_operators.append(kill_acting_operator())
                elif (fault == "scale-up" and n < 3) or (fault == "scale-down" and n == 1):
                    scale(n + 1)
                elif fault == "scale-down" or fault == "scale-up":  # scale-up at the maximum: down
                    done = load.ok
                    wait_for(lambda d=done: load.ok >= d + 3, 60, "requests running before the drain")
                    scale(n - 1)
                else:  # operator-mid-drain: the acting replica dies while a pod drains
                    if n == 1:
                        scale(2)
                        wait_for(lambda: settled(2), 120, "two ready engine pods before the drain")
                        n = 2
                    drains = events("Draining")
                    scale(n - 1)
                    wait_for(lambda d=drains: events("Draining") > d, 60, "a drain started")
                    killed_operators.append(kill_acting_operator())
                wait_for(lambda: settled(desired[-1]), 180, f"recovery from {fault}")
                asked[:] = [desired[-1]]
                timings.append((fault, round(time.monotonic() - began, 1)))
            done = load.ok
            wait_for(lambda d=done: load.ok >= d + 5, 60, "requests after the last fault")

        final = engine_pods()
        service = custom.get_namespaced_custom_object(G, V, NS, P, "sim")
        uid = service["metadata"]["uid"]
        owned = {
            kind: [api.sanitize_for_serialization(o) for o in listing(NS).items]
            for kind, listing in {
                "pod": core.list_namespaced_pod,
                "service": core.list_namespaced_service,
                "deployment": kubernetes.client.AppsV1Api(api).list_namespaced_deployment,
                "secret": core.list_namespaced_secret,
                "serviceaccount": core.list_namespaced_service_account,
            }.items()
        }
        custom.delete_namespaced_custom_object(G, V, NS, P, "sim")
        wait_for(lambda: "sim" not in cluster.emulator.live("llmservices"), 60,
                 "the LLMService gone (the acting replica released its finalizer)")
        after_delete = {p["metadata"]["name"] for p in engine_pods()}
        operators.stop()  # nothing can create a pod after this
        left = {p["metadata"]["name"] for p in engine_pods()}
        logs_text = {name: operators.log(name) for name in operators.processes}
        assert kubelet.errors == [], kubelet.errors[:3]

    elapsed = time.monotonic() - started
    assert load.failures == [], load.failures[:5]
    assert counter.excess == [], counter.excess[:5]  # (pods, most replicas asked for since settled)
    assert len(final) == desired[-1], [p["metadata"]["name"] for p in final]
    # Everything of the service is owned by the live LLMService: Kubernetes' garbage collector deletes
    # it with the LLMService (the emulator has none), so nothing is orphaned.
    for kind, objects in owned.items():
        for obj in objects:
            refs = obj["metadata"].get("ownerReferences") or []
            if obj["metadata"]["name"].startswith("sim-"):
                assert [r["uid"] for r in refs] == [uid], (kind, obj["metadata"]["name"], refs)
    assert {o["metadata"]["name"] for o in owned["pod"]} == {p["metadata"]["name"] for p in final}
    assert left <= after_delete, left - after_delete  # no pod created once the LLMService was deleted
    tracebacks = {name: text[text.index("Traceback"):][:2000] for name, text in logs_text.items()
                  if "Traceback" in text}
    assert not tracebacks, tracebacks
    assert len(killed_operators) == 2
    print(f"\n[operator chaos] seed {SEED}: {len(schedule)} faults {timings}; {load.ok} requests ok, "
          f"0 failed; engine pods peak {counter.peak} (most asked {max(desired)}, {counter.samples} "
          f"samples); operators {sorted(logs_text)}; {elapsed:.0f} s")

