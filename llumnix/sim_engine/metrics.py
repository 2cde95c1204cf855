"""The sim engine's `/metrics`: the vLLM series the llumlet and dashboards read, with vLLM's names and
labels, computed from the engine state at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llumnix.sim_engine.engine import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, SimEngine

_FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, "error")


class EngineCollector(Collector):
    def __init__(self, engine: SimEngine, model_name: str) -> None:
        self.engine = engine
        self.labels = {"engine": "0", "model_name": model_name}

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        instance = engine.instance
        running = (
            len(instance.prefilling) + len(instance.running) + len(instance.suspended) + len(instance.resumed)
        )
        used = instance.total_blocks - instance.free_blocks
        yield self._gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", running
        )
        yield self._gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(instance.waiting)
        )
        yield self._gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            used / instance.total_blocks,
        )
        yield self._counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", instance.preemptions
        )
        yield self._counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", engine.prompt_tokens_total
        )
        yield self._counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", engine.generation_tokens_total
        )
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            engine.prefix_cache_queries_total,
        )
        yield self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            instance.prefix_hit_tokens,
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=["engine", "finished_reason", "model_name"],
        )
        for reason in _FINISH_REASONS:
            success.add_metric(
                [self.labels["engine"], reason, self.labels["model_name"]], engine.finished_by_reason[reason]
            )
        yield success
        info = {
            "block_size": str(instance.block_size),
            "num_gpu_blocks": str(instance.total_blocks),
            "enable_prefix_caching": "False",
            "cache_dtype": "auto",
            "engine": "0",
        }
        cache = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=sorted(info)
        )
        cache.add_metric([info[k] for k in sorted(info)], 1.0)
        yield cache


class EngineMetrics:
    def __init__(self, engine: SimEngine, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(engine, model_name))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
