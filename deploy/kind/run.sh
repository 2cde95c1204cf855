#!/usr/bin/env bash
# End to end on a kind cluster with sim engines: build the image, install the chart, apply an
# LLMService, send requests through its router, scale up, kill a pod, scale down (drain, then delete),
# and check that every request succeeded. The namespace enforces Pod Security's "restricted" profile. Exits 0 with "skipped: ..." where docker/kind are missing.
#
#   deploy/kind/run.sh            # KEEP_CLUSTER=1 keeps the cluster afterwards
set -euo pipefail

missing=()
for tool in docker kind kubectl helm curl; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if ((${#missing[@]})); then
  echo "skipped: docker/kind not found (missing: ${missing[*]}; this end-to-end run needs docker, kind, kubectl, helm, curl)"
  exit 0
fi
if ! docker info >/dev/null 2>&1; then
  echo "skipped: docker/kind not found (the docker daemon is not reachable)"
  exit 0
fi

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cluster="${KIND_CLUSTER:-llumnix-e2e}"
image="llumnix:kind"
ns=llumnix-e2e

cleanup() {
  [[ -n "${forward_pid:-}" ]] && kill "$forward_pid" 2>/dev/null || true
  if [[ "${KEEP_CLUSTER:-0}" != 1 ]]; then kind delete cluster --name "$cluster" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

step() { echo "==> $*"; }

step "building $image"
docker build -t "$image" "$root"
step "creating kind cluster $cluster"
kind get clusters 2>/dev/null | grep -qx "$cluster" || kind create cluster --name "$cluster" --wait 120s
kind load docker-image "$image" --name "$cluster"

step "installing the chart"
kubectl create namespace "$ns" --dry-run=client -o yaml | kubectl apply -f -
# Pod Security admission enforces the "restricted" profile here: the operator's pod, and every engine and
# router pod it creates, is refused if it does not meet it (the run then fails waiting for them).
kubectl label namespace "$ns" pod-security.kubernetes.io/enforce=restricted --overwrite
helm upgrade --install llumnix "$root/charts/llumnix" --namespace "$ns" --wait --timeout 180s \
  --set image.repository=llumnix --set image.tag=kind --set image.pullPolicy=Never \
  --set operator.allNamespaces=false

step "applying the LLMService"
kubectl -n "$ns" apply -f "$here/llmservice-sim.yaml"
wait_ready() {  # wait_ready N: N instances ready
  kubectl -n "$ns" wait llmservice/sim --for=jsonpath='{.status.instances.ready}'="$1" --timeout=300s
}
wait_ready 2
kubectl -n "$ns" rollout status deployment/sim-router --timeout=180s

kubectl -n "$ns" port-forward service/sim-router 18000:8000 >/dev/null 2>&1 &
forward_pid=$!
sleep 3

failures=0
send() {  # send N: N completions through the router, counting failures
  for _ in $(seq "$1"); do
    curl -sf -m 60 http://127.0.0.1:18000/v1/completions -H 'Content-Type: application/json' \
      -d '{"model": "sim", "prompt": "hello", "max_tokens": 64}' >/dev/null || failures=$((failures + 1))
  done
}

step "requests on 2 instances"
send 20
step "scale up to 3"
kubectl -n "$ns" scale llmservice/sim --replicas 3
wait_ready 3
send 10 &
step "killing an engine pod (it is replaced)"
victim="$(kubectl -n "$ns" get pods -l llumnix.io/service=sim,app.kubernetes.io/component=engine -o name | head -1)"
kubectl -n "$ns" delete "$victim" --wait=false
wait
wait_ready 3
step "scale down to 1 (drain by migration, then delete)"
send 20 &
kubectl -n "$ns" scale llmservice/sim --replicas 1
wait
wait_ready 1
kubectl -n "$ns" get llmservice sim
kubectl -n "$ns" get events --field-selector involvedObject.kind=LLMService

if ((failures)); then
  echo "FAILED: $failures request(s) failed"
  exit 1
fi
echo "OK: every request succeeded"
