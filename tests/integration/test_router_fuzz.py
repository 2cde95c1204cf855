"""The router fuzzed against its own OpenAPI document (`/openapi.json`) with schemathesis: requests
generated from the schema, and requests that break it, never get a 5xx or an undocumented status,
always an answer of the documented content type, and every error is OpenAI's shape. Unknown paths
and methods answer OpenAI-shaped 404 and 405 too. The router runs as a process over a sim engine."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
import pytest_asyncio
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from service_auth import SERVICE_TOKEN

from llumnix.launch.child_process import ChildCommand, ChildProcess
from llumnix.launch.pair import EnginePair, free_port

MODEL = "sim"
MAX_TOKENS = 8
EXAMPLES = 30
"""Per operation and mode: enough to reach every branch the router has, short enough for CI."""
CHECKS = (not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router_url(sim_pairs: Callable[..., Awaitable[list[EnginePair]]],
                     tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    (pair,) = await sim_pairs(1, "fuzz", engine_args=("--time-scale", "50"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    router = ChildProcess("router", tmp_path_factory.mktemp("fuzz-router") / "router.log", url + "/health",
                          grace_s=10)
    await router.launch(ChildCommand((
        sys.executable, "-m", "llumnix.cli", "router", "--model", MODEL, "--host", "127.0.0.1",
        "--port", str(port), "--instances", pair.grpc_address, "--max-tokens", str(MAX_TOKENS),
        "--max-body-bytes", str(1 << 16)), SERVICE_TOKEN.environment()), timeout_s=60)
    try:
        yield url
    finally:
        await router.terminate()


@pytest.fixture(scope="module")
def router_schema(router_url: str) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(router_url + "/openapi.json")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_request_gets_a_server_error_or_an_undocumented_answer(router_schema: schemathesis.BaseSchema,
                                                                  mode: GenerationMode) -> None:
    """Requests that follow the schema (positive) and requests that break it (negative)."""
    for result in router_schema.get_all_operations():
        operation = result.ok()
        if mode is GenerationMode.NEGATIVE and not operation.label.startswith("POST"):
            continue  # nothing to break in a GET without parameters

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def call(case: schemathesis.Case) -> None:
            case.call_and_validate(checks=CHECKS, timeout=60)

        call()


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/v1/nowhere", 404), ("GET", "/v1/completions", 405), ("DELETE", "/v1/models", 405),
    ("POST", "/openapi.json", 405)])
async def test_unknown_paths_and_methods_answer_in_openai_shape(router_url: str, method: str, path: str,
                                                                 status: int) -> None:
    async with aiohttp.ClientSession() as session, session.request(method, router_url + path) as response:
        assert response.status == status
        assert response.content_type == "application/json"
        body = await response.json()
        assert body["error"]["code"] == status and body["error"]["message"]
        if status == 405:
            assert response.headers["Allow"]


def test_the_document_is_valid_openapi(router_schema: schemathesis.BaseSchema) -> None:
    assert {op.label for op in (result.ok() for result in router_schema.get_all_operations())} >= {
        "POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health"}
