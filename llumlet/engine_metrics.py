"""What the llumlet reads from the engine's Prometheus `/metrics`: the fallback load source when
the connector's snapshots stop, and the cross-check the contract tests use."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    total_blocks: int
    block_size: int
    kv_cache_usage: float
    """Fraction of KV blocks in use (vllm:kv_cache_usage_perc, 0..1 despite its name)."""
    running: int
    waiting: int
    preemptions_total: int

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - round(self.kv_cache_usage * self.total_blocks)


class MetricsFormatError(ValueError):
    pass


_WANTED = ("vllm:cache_config_info", "vllm:kv_cache_usage_perc", "vllm:num_requests_running",
           "vllm:num_requests_waiting", "vllm:num_preemptions")


def _wanted_lines(text: str) -> str:
    """vLLM exposes hundreds of histogram series; parsing only the few needed keeps the poll cheap."""
    keep = []
    for line in text.splitlines():
        name = line[7:] if line.startswith(("# HELP ", "# TYPE ")) else line
        if name.startswith(_WANTED):
            keep.append(line)
    return "\n".join(keep) + "\n"


def parse_engine_metrics(text: str) -> EngineMetrics:
    """Sums over engine indexes (data-parallel engines each report one series)."""
    gauges: dict[str, float] = {}
    cache_info: dict[str, str] = {}
    for family in text_string_to_metric_families(_wanted_lines(text)):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                cache_info = dict(sample.labels)
            elif sample.name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                                 "vllm:num_requests_waiting", "vllm:num_preemptions_total"):
                gauges[sample.name] = gauges.get(sample.name, 0.0) + sample.value
    if "num_gpu_blocks" not in cache_info or "vllm:kv_cache_usage_perc" not in gauges:
        raise MetricsFormatError("engine /metrics lacks vllm:cache_config_info or vllm:kv_cache_usage_perc")
    return EngineMetrics(
        total_blocks=int(cache_info["num_gpu_blocks"]),
        block_size=int(cache_info.get("block_size") or 16),
        kv_cache_usage=gauges["vllm:kv_cache_usage_perc"],
        running=int(gauges.get("vllm:num_requests_running", 0)),
        waiting=int(gauges.get("vllm:num_requests_waiting", 0)),
        preemptions_total=int(gauges.get("vllm:num_preemptions_total", 0)),
    )
