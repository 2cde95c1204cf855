"""The live-migration data plane on one CUDA GPU without vLLM: a request's KV blocks copied out of one
paged cache, sent over a KV channel and copied into another cache on the same device, with the
connector's own code (llumnix/engine/kv_blocks.py, kv_migration_worker.transfer_payload, the tcp and pair
transports, staging), at 256 -> 8k tokens of LLaMA-7B-shaped KV (32 layers, 32 KV heads, head size 128,
fp16, 16-token blocks: 512 KiB per token). Optionally the recompute it competes with: the prefill of the
same number of tokens by a random-weight LLaMA-7B-shaped model in transformers (not vLLM's kernels).

For machines where torch is there and vLLM is not (bench/gpu_check.py needs vLLM): only torch, the
project and its protobuf stubs are imported (`--prefill` also needs transformers and safetensors).

    python bench/kv_channel_gpu.py --out OUT                    # CUDA: tcp, gloo, and NCCL's verdict
    python bench/kv_channel_gpu.py --out OUT --prefill          # and the transformers prefill baseline
    python bench/kv_channel_gpu.py --device cpu --shape tiny    # the same path on CPU (tests)

NCCL needs two GPUs (one rank each); on one GPU its attempt is made and its error reported. Writes
OUT/kv_channel_gpu.json and OUT/kv_channel_gpu.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from llumnix.engine.handshake import migration_key, new_kv_secret
from llumnix.engine.kv_blocks import KVBlockCopier
from llumnix.engine.kv_migration_worker import transfer_payload
from llumnix.engine.kv_staging import StagingStore
from llumnix.engine.kv_transport import KV_FRAME_SCHEMA_VERSION, KVTransportError
from llumnix.engine.kv_transport_factory import make_receiver, make_sender
from llumnix.engine.kv_transport_pair import ChannelRendezvous
from llumnix.v1.kv_transfer_pb2 import KVStageHeader, OpenChannel

SHAPES = {
    # layers, KV heads, head size: LLaMA-7B, and the 2-layer test model's
    "7b": (32, 32, 128),
    "tiny": (2, 2, 32),
}
BLOCK_TOKENS = 16
TIMEOUT_S = 60.0


def kv_caches(shape: str, num_blocks: int, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One paged cache as the connector sees it: per layer `[blocks, kv_heads, block_tokens, 2 * head]`."""
    layers, heads, head = SHAPES[shape]
    return {
        f"model.layers.{i}.self_attn": torch.randn(
            num_blocks, heads, BLOCK_TOKENS, 2 * head, device=device, dtype=dtype
        )
        for i in range(layers)
    }


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Channel:
    """A receiver (the destination engine's) and, per migration, the sender of `backend`."""

    def __init__(self, backend: str, bytes_per_block: int, dtype: str, device: str) -> None:
        self.backend = backend
        self.secret = new_kv_secret()
        self.staging = StagingStore(bytes_per_block, dtype, lease_s=600)
        self.receiver = make_receiver(
            host="127.0.0.1",
            staging=self.staging,
            kv_secret=self.secret,
            device=torch.device(device),  # as the engine does: pair payloads and pinning follow it
            timeout_s=TIMEOUT_S,
        )
        self.receiver.start()
        self.rendezvous = ChannelRendezvous("127.0.0.1", lease_s=600, timeout_s=TIMEOUT_S)

    def sender(self, migration_id: str) -> Any:
        channel = None
        if self.backend != "tcp":
            channel = self.rendezvous.open(OpenChannel(backend=self.backend, migration_id=migration_id))
        return make_sender(self.backend, self.receiver.address, timeout_s=TIMEOUT_S, channel=channel)

    def close(self) -> None:
        self.receiver.close()
        self.rendezvous.close()


def move(
    source: KVBlockCopier, destination: KVBlockCopier, channel: Channel, tokens: int, device: str
) -> dict[str, Any]:
    """One single-stage migration of `tokens` tokens' blocks: copy-out, send (until the receiver's ack),
    copy-in; each timed, and the destination's blocks compared with the source's."""
    blocks = -(-tokens // BLOCK_TOKENS)
    ids = list(range(blocks))
    migration_id = f"{channel.backend}-{tokens}-{time.monotonic_ns()}"
    layout = source.layout
    header = KVStageHeader(
        schema_version=KV_FRAME_SCHEMA_VERSION,
        migration_id=migration_id,
        stage=1,
        first_block=0,
        num_blocks=blocks,
        num_tokens=tokens,
        payload_bytes=blocks * layout.bytes_per_block,
        bytes_per_block=layout.bytes_per_block,
        dtype=layout.dtype,
        kv_key=migration_key(channel.secret, migration_id),
    )
    sender = channel.sender(migration_id)
    try:
        started = time.perf_counter()
        buffer = source.copy_out_block_major(ids)
        synchronize(device)
        copied = time.perf_counter()
        ack = sender.send(header, transfer_payload(buffer, channel.backend))
        sent = time.perf_counter()
    finally:
        sender.close()
    if not ack.ok:
        raise KVTransportError(ack.error)
    staged = channel.staging.take(migration_id)
    destination.copy_in_parts(ids, staged.parts(0, blocks))  # what the destination engine's load does
    synchronize(device)
    loaded = time.perf_counter()
    equal = bool(torch.equal(destination.copy_out_block_major(ids), buffer))
    total_s = loaded - started
    return {
        "channel": channel.backend,
        "tokens": tokens,
        "blocks": blocks,
        "bytes": header.payload_bytes,
        "copy_out_ms": round((copied - started) * 1e3, 3),
        "send_ms": round((sent - copied) * 1e3, 3),
        "copy_in_ms": round((loaded - sent) * 1e3, 3),
        "total_ms": round(total_s * 1e3, 3),
        "gib_per_s": round(header.payload_bytes / total_s / 2**30, 2),
        "equal": equal,
    }


def measure_channel(
    backend: str,
    source: KVBlockCopier,
    destination: KVBlockCopier,
    lengths: list[int],
    device: str,
    budget_s: float,
) -> tuple[list[dict[str, Any]], str]:
    """Rows for every length, or the error that stopped the channel. A first, unmeasured move of the
    longest length connects and allocates what later moves of that length reuse (host buffers come from
    torch's process-wide caching host allocator, page-locked on CUDA, and a cached buffer serves only a
    request of its own size class: on a VM's fresh memory a first allocation costs more than the move);
    its time is in the outcome. The moves run in a thread joined with `budget_s`, so a channel that
    hangs (NCCL on one device can) is reported."""
    rows: list[dict[str, Any]] = []
    outcome: list[str] = []

    def run() -> None:
        channel = Channel(backend, source.layout.bytes_per_block, source.layout.dtype, device)
        try:
            first = move(source, destination, channel, max(lengths), device)
            rows.extend(move(source, destination, channel, n, device) for n in lengths)
            outcome.append(f"ok (the first move, of {first['tokens']} tokens, allocating: "
                           f"{first['total_ms']:.0f} ms)")
        except Exception as exc:  # a channel that cannot work here is a finding, not a crash
            outcome.append(f"{type(exc).__name__}: {exc}"[:1000])
        finally:
            channel.close()

    worker = threading.Thread(target=run, name=f"kv-{backend}", daemon=True)
    worker.start()
    worker.join(budget_s)
    return rows, outcome[0] if outcome else f"did not finish within {budget_s:.0f} s"


def prefill_baseline(lengths: list[int], model_cache: Path) -> list[dict[str, Any]]:
    """Prefill time of `lengths` tokens by a random-weight LLaMA-7B-shaped model (transformers, sdpa)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_check import LLAMA_7B, ensure_random_llama
    from transformers import LlamaForCausalLM

    model_dir, _ = ensure_random_llama(model_cache, LLAMA_7B, "cuda")
    model = LlamaForCausalLM.from_pretrained(
        model_dir, dtype=torch.float16, device_map="cuda", attn_implementation="sdpa"
    )
    rows = []
    with torch.inference_mode():
        model(torch.randint(10, 400, (1, 64), device="cuda"))  # warm-up
        for tokens in lengths:
            ids = torch.randint(10, 400, (1, tokens), device="cuda")
            torch.cuda.synchronize()
            started = time.perf_counter()
            model(ids, logits_to_keep=1)
            torch.cuda.synchronize()
            rows.append({"tokens": tokens, "prefill_ms": round((time.perf_counter() - started) * 1e3, 2)})
    del model
    torch.cuda.empty_cache()
    return rows


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# KV channel on {report['device_name']} (no vLLM)",
        "",
        f"{report['shape']} KV ({report['bytes_per_token']:,} bytes per token, {report['dtype']}), two "
        f"caches on one device, one single-stage move per length; torch {report['torch']}.",
        "",
        "| channel | tokens | MiB | copy-out ms | send ms | copy-in ms | total ms | GiB/s | bytes equal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["moves"]:
        lines.append(
            f"| {r['channel']} | {r['tokens']} | {r['bytes'] / 2**20:.1f} | {r['copy_out_ms']} | "
            f"{r['send_ms']} | {r['copy_in_ms']} | {r['total_ms']} | {r['gib_per_s']} | "
            f"{'yes' if r['equal'] else 'NO'} |"
        )
    lines += ["", *(f"- {channel}: {outcome}" for channel, outcome in report["channels"].items())]
    if report.get("prefill"):
        lines += ["", "| tokens | transformers prefill ms (recompute) |", "|---|---|"]
        lines += [f"| {p['tokens']} | {p['prefill_ms']} |" for p in report["prefill"]]
    if report.get("prefill_error"):
        lines += ["", f"Prefill baseline not measured: {report['prefill_error']}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    parser.add_argument("--lengths", default="256,1024,2048,4096,8192")
    parser.add_argument("--channels", default="tcp,gloo,nccl")
    parser.add_argument(
        "--budget", type=float, default=90.0, help="seconds per channel (default: %(default)s)"
    )
    parser.add_argument("--prefill", action="store_true", help="also time the transformers prefill baseline")
    parser.add_argument("--model-cache", type=Path, default=Path(".cache/models"))
    parser.add_argument("--out", type=Path, default=None, help="reports (default: a new temp dir)")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("no CUDA device (use --device cpu)")
    dtype = torch.float16 if args.device.startswith("cuda") else torch.float32
    num_blocks = -(-max(lengths) // BLOCK_TOKENS) + 1
    source = KVBlockCopier(kv_caches(args.shape, num_blocks, args.device, dtype), num_blocks)
    destination = KVBlockCopier(kv_caches(args.shape, num_blocks, args.device, dtype), num_blocks)
    layers, heads, head = SHAPES[args.shape]
    report: dict[str, Any] = {
        "shape": args.shape,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "bytes_per_token": source.layout.bytes_per_block // BLOCK_TOKENS,
        "moves": [],
        "channels": {},
        "layers": layers,
        "kv_heads": heads,
        "head_size": head,
    }
    for backend in args.channels.split(","):
        rows, outcome = measure_channel(backend, source, destination, lengths, args.device, args.budget)
        report["moves"] += rows
        report["channels"][backend] = outcome
        print(f"[kv_channel_gpu] {backend}: {outcome}", file=sys.stderr, flush=True)
    if args.prefill:
        try:
            report["prefill"] = prefill_baseline(lengths, args.model_cache)
        except Exception as exc:  # the baseline is optional; its failure is reported
            report["prefill_error"] = f"{type(exc).__name__}: {exc}"[:1000]
    out = (args.out or Path(tempfile.mkdtemp(prefix="kv-channel-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_channel_gpu.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "kv_channel_gpu.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if all(r["equal"] for r in report["moves"]) and report["moves"] else 1


if __name__ == "__main__":
    sys.exit(main())
