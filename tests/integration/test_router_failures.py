"""Failures and moves behind the router, with real llumlets and sim engines (processes): a request is
retried elsewhere before its first token, resumed by token replay when its engine dies mid-stream,
and continued from the destination when its llumlet says it moved. The sim engine is deterministic,
so the spliced output must equal an unfailed run token for token."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import grpc
import pytest
import pytest_asyncio
from sdk_client import openai_client
from serve_adapter import serve_from_generate
from service_auth import authenticated_channel
from waiting import connection_queues, task_stacks, unwatched_selector_fds

from llumnix.launch.pair import EnginePair
from llumnix.router.api import ApiSettings
from llumnix.router.generation import GenerationLimits
from llumnix.router.server import Router
from llumnix.v1 import llumlet_pb2 as pb
from llumnix.v1 import llumlet_pb2_grpc

pytestmark = [pytest.mark.timeout(180), pytest.mark.asyncio(loop_scope="module")]

MODEL = "sim"
PROMPT = "Resume me exactly"
StartPairs = Callable[..., Awaitable[list[EnginePair]]]
StartRouter = Callable[..., Awaitable[Router]]
RouterOver = Callable[[list[str]], Awaitable[Router]]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def instances(sim_pairs: StartPairs) -> list[EnginePair]:
    return await sim_pairs(5, "f", engine_args=("--time-scale", "2"))


@pytest_asyncio.fixture(loop_scope="module")
async def router_over(start_router: StartRouter) -> RouterOver:
    """A router that can resume chat requests without max_tokens (it knows the engines' context)."""
    api = ApiSettings(model=MODEL, generation=GenerationLimits(max_model_len=1024))
    return lambda addresses: start_router(addresses, api=api, queue_timeout_s=20.0)


def alive(instances: list[EnginePair]) -> list[EnginePair]:
    """Each test kills one engine; the next ones use those still running."""
    return [p for p in instances if p.engine_running]


async def unfailed(instance: EnginePair, path: str, body: dict) -> str:
    async with aiohttp.ClientSession() as session, session.post(instance.engine_url + path,
                                                                json=body) as response:
        answer = await response.json()
    choice = answer["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def serving(router: Router) -> str:
    busy = [i for i in router.instances.all() if i.in_flight]
    assert len(busy) == 1
    return busy[0].address


def where_they_are(router: Router, readers: list[asyncio.Task[str]], started: list[asyncio.Event]) -> str:
    """Where requests that have not started are (a fresh-clone run saw 2 of 6 streams get no headers)."""
    lines = [f"queued in the router: {len(router.queue)}, in its API: {router.api.in_flight}"]
    lines += [f"reader {i}: started={event.is_set()} done={task.done()}"
              f"{' ' + repr(task.exception()) if task.done() and task.exception() else ''}"
              for i, (task, event) in enumerate(zip(readers, started, strict=True))]
    for instance in router.instances.all():
        load = instance.report.load if instance.report is not None else None
        lines.append(f"{instance.address}: pending={sorted(instance.pending)} "
                     f"in_flight={sorted(instance.in_flight)} load={load}")
    lines += [connection_queues(router.port), unwatched_selector_fds(), task_stacks()]
    return "\n".join(lines)


def counter(router: Router, name: str) -> float:
    return getattr(router.metrics, name)._value.get()


async def test_retry_before_the_first_token_when_an_engine_is_down(
        instances: list[EnginePair], router_over: RouterOver) -> None:
    dead, running = alive(instances)[:2]
    router = await router_over([dead.grpc_address, running.grpc_address])
    dead.kill_engine()  # its llumlet still streams a load that looks idle
    client = openai_client(router.url)
    answers = await asyncio.gather(*(
        client.completions.create(model=MODEL, prompt=f"r{i}", max_tokens=5) for i in range(6)))
    assert all(len(a.choices[0].text) == 5 for a in answers)
    assert counter(router, "retries") >= 1


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_token_replay_when_the_engine_dies_mid_stream(instances: list[EnginePair],
                                                            router_over: RouterOver, endpoint: str) -> None:
    first, second = alive(instances)[:2]
    router = await router_over([first.grpc_address, second.grpc_address])
    by_address = {p.grpc_address: p for p in (first, second)}
    client = openai_client(router.url)
    if endpoint == "completions":
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 120}
        expected = await unfailed(second, "/v1/completions", body)
        stream = await client.completions.create(**body, stream=True,  # type: ignore[call-overload]
                                                 stream_options={"include_usage": True})
    else:
        body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 120}
        expected = await unfailed(first, "/v1/chat/completions", body)
        stream = await client.chat.completions.create(**body, stream=True,  # type: ignore[call-overload]
                                                      stream_options={"include_usage": True})
    pieces: list[str] = []
    roles = 0
    usage = None
    async for chunk in stream:
        for choice in chunk.choices:
            if endpoint == "completions":
                pieces.append(choice.text)
            else:
                pieces.append(choice.delta.content or "")
                roles += choice.delta.role == "assistant"
        usage = chunk.usage or usage
        if len("".join(pieces)) == 30:
            by_address[serving(router)].kill_engine()
    assert "".join(pieces) == expected
    assert usage is not None and usage.completion_tokens == 120
    assert endpoint == "completions" or roles == 1
    assert counter(router, "replays") == 1


class MovingLlumlet(llumlet_pb2_grpc.LlumletServicer):
    """A llumlet that streams a request's first tokens from a real llumlet, then says it moved there
    (what the migration protocol does once the destination holds the request)."""

    def __init__(self, destination: str, tokens_before_move: int) -> None:
        self.destination = destination
        self.tokens_before_move = tokens_before_move

    async def WatchLoad(self, request: pb.WatchLoadRequest, context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[pb.InstanceLoad]:
        sequence = 0
        while True:
            sequence += 1
            yield pb.InstanceLoad(instance_id="mover", total_blocks=1000, free_blocks=1000, block_size=16,
                                  sequence=sequence, timestamp=float(sequence),
                                  source=pb.LOAD_SOURCE_CONNECTOR)
            await asyncio.sleep(0.2)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        async with authenticated_channel(self.destination) as channel:
            call = llumlet_pb2_grpc.LlumletStub(channel).Generate(request)
            sent = 0
            async for message in call:
                yield message
                sent += len(message.chunk.token_ids)
                if sent >= self.tokens_before_move:
                    call.cancel()
                    break
        yield pb.GenerateResponse(moved=pb.Moved(instance_id="destination", address=self.destination))

    async def Serve(self, request_iterator: AsyncIterator[pb.ServeCommand],
                    context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ServeEvents]:
        async for events in serve_from_generate(request_iterator, lambda r: self.Generate(r, context)):
            yield events


async def test_a_moved_request_continues_from_its_destination(instances: list[EnginePair],
                                                              router_over: RouterOver) -> None:
    destination = alive(instances)[0]
    server = grpc.aio.server()
    llumlet_pb2_grpc.add_LlumletServicer_to_server(MovingLlumlet(destination.grpc_address, 25), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        router = await router_over([f"127.0.0.1:{port}"])
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 60}
        expected = await unfailed(destination, "/v1/completions", body)
        client = openai_client(router.url)
        stream = await client.completions.create(**body, stream=True)  # type: ignore[call-overload]
        text = "".join([choice.text async for chunk in stream for choice in chunk.choices])
        assert text == expected
        assert counter(router, "moves") == 1 and counter(router, "replays") == 0
    finally:
        await server.stop(grace=None)


async def test_every_request_on_a_llumlet_that_dies_resumes_elsewhere(instances: list[EnginePair],
                                                                     router_over: RouterOver) -> None:
    """All requests on an instance share one Serve stream; when its llumlet dies, each of them resumes
    by token replay on the other instance and the clients see unbroken, exact output."""
    first, second = alive(instances)[:2]
    router = await router_over([first.grpc_address, second.grpc_address])
    by_address = {p.grpc_address: p for p in (first, second)}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 120}
    expected = await unfailed(second, "/v1/completions", body)
    client = openai_client(router.url)
    started = [asyncio.Event() for _ in range(6)]

    async def read(started: asyncio.Event) -> str:
        pieces: list[str] = []
        stream = await client.completions.create(**body, stream=True)  # type: ignore[call-overload]
        async for chunk in stream:
            pieces.extend(choice.text for choice in chunk.choices)
            if len("".join(pieces)) >= 10:
                started.set()
        return "".join(pieces)

    readers = [asyncio.create_task(read(event)) for event in started]
    try:
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
    except TimeoutError:
        raise AssertionError(f"not every stream started in 60 s\n{where_they_are(router, readers, started)}"
                             f"\n{first.llumlet.log_tail(30)}\n{second.llumlet.log_tail(30)}") from None
    busiest = max(router.instances.all(), key=lambda instance: len(instance.in_flight))
    on_it = len(busiest.in_flight)
    assert on_it >= 1
    victim = by_address[busiest.address]
    victim.llumlet.signal(signal.SIGKILL)
    texts = await asyncio.wait_for(asyncio.gather(*readers), 120)
    victim.kill_engine()  # the pair is dead for the tests after this one
    assert texts == [expected] * len(readers)
    assert counter(router, "replays") == on_it
