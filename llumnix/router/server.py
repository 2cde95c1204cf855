"""The router process: wires the instance set, the dispatcher and its queue, and the HTTP API; stops
gracefully (stop accepting, let in-flight requests finish within a grace period)."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field

from aiohttp import web

from llumnix.load import LoadModelConfig
from llumnix.policies.dispatch import DEFAULT_BUSY_FREENESS, DEFAULT_PREFIX_WEIGHT, make_dispatch_policy
from llumnix.router.api import ApiSettings, RouterApi
from llumnix.router.api_keys import ApiKeyChecker
from llumnix.router.dispatcher import Dispatcher, DispatchQueue
from llumnix.router.errors import RouterError
from llumnix.router.instance_source import InstanceSource
from llumnix.router.instances import InstanceSet
from llumnix.router.metrics import RouterMetrics
from llumnix.router.prompt_ids import PromptTokens
from llumnix.service_token import ServiceToken

logger = logging.getLogger("llumnix.router")


@dataclass(frozen=True)
class RouterConfig:
    api: ApiSettings
    host: str = "0.0.0.0"
    port: int = 8000
    """0 picks a free port (see Router.port)."""
    dispatch_policy: str = "llumnix"
    busy_freeness: float = DEFAULT_BUSY_FREENESS
    top_k: int = 1
    prefix_weight: float = DEFAULT_PREFIX_WEIGHT
    tokenizer: str | None = None
    """The model's tokenizer (a local folder): text and chat prompts are looked up in the prefix
    caches too. None: only prompts given as token ids."""
    load_model: LoadModelConfig = field(default_factory=LoadModelConfig)
    queue_capacity: int = 1024
    queue_timeout_s: float = 60.0
    api_keys: tuple[bytes, ...] = ()
    shutdown_grace_s: float = 30.0
    reuse_port: bool = False
    """Share the port with other router processes (SO_REUSEPORT; see `llumnix.router.workers`)."""
    service_token: ServiceToken | None = None
    """Presented to every llumlet (they require the service's token)."""


class Router:
    def __init__(self, config: RouterConfig, source: InstanceSource) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.instances = InstanceSet(source, on_change=self._wake, token=config.service_token)
        policy = make_dispatch_policy(config.dispatch_policy, busy_freeness=config.busy_freeness,
                                      top_k=config.top_k, load_model=config.load_model,
                                      prefix_weight=config.prefix_weight)
        self.dispatcher = Dispatcher(policy, self.instances, self.metrics,
                                     PromptTokens.load(config.tokenizer, config.api.model))
        self.queue = DispatchQueue(self.dispatcher, config.queue_capacity, config.queue_timeout_s,
                                   self.metrics)
        self.api = RouterApi(config.api, self.queue, self.instances, self.metrics,
                             ApiKeyChecker(config.api_keys), config.service_token)
        self._runner: web.AppRunner | None = None
        self.port = config.port

    def _wake(self) -> None:
        self.queue.wake()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "::") else self.config.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        self.instances.start()
        # handler_cancellation: a client that disconnects cancels its request (and the instance aborts it)
        self._runner = web.AppRunner(self.api.app(), access_log=None, handler_cancellation=True,
                                     shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port, backlog=2048,
                           reuse_port=self.config.reuse_port or None)
        try:
            await site.start()
        except OSError as exc:
            await self.instances.close()
            raise OSError(f"cannot listen on {self.config.host}:{self.config.port}: "
                          f"{exc.strerror or exc}") from None
        self.port = self._runner.addresses[0][1]
        logger.info("router started", extra={"port": self.port, "policy": self.config.dispatch_policy,
                                             "api_keys": bool(self.config.api_keys)})
        if self.config.dispatch_policy == "llumnix" and self.config.prefix_weight > 0:
            if self.config.tokenizer is None:  # only prompts given as token ids can be hashed
                logger.info("prefix-aware dispatch on for completions whose prompt is token ids; text and "
                            "chat prompts are dispatched by load alone (no --tokenizer)",
                            extra={"prefix_weight": self.config.prefix_weight})
            else:
                logger.info("prefix-aware dispatch on; prompts tokenized with the model's tokenizer",
                            extra={"prefix_weight": self.config.prefix_weight,
                                   "tokenizer": self.config.tokenizer})

    async def shutdown(self) -> None:
        """Stop accepting (503, /health 503), let in-flight requests finish for up to the grace
        period, then close what is left."""
        self.api.accepting = False
        logger.info("shutting down", extra={"in_flight": self.api.in_flight,
                                            "grace_s": self.config.shutdown_grace_s})
        try:
            await asyncio.wait_for(self.api.idle.wait(), self.config.shutdown_grace_s)
        except TimeoutError:
            logger.warning("grace period expired", extra={"in_flight": self.api.in_flight})
        self.queue.fail_all(RouterError(503, "the router is shutting down; retry", retry_after_s=1.0))
        if self._runner is not None:
            await self._runner.cleanup()
        await self.instances.close()
        logger.info("router stopped")

    async def serve_until_signal(self) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await self.start()
        await stop.wait()
        await self.shutdown()
