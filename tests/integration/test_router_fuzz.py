"""The router fuzzed against its own OpenAPI document (`/openapi.json`) with schemathesis: requests
generated from the schema are accepted and requests that break it refused with a 4xx (the document
matches what the router takes), none gets a 5xx or an undocumented status, every answer has the
documented content type, and every error is OpenAI's shape. Unknown paths and methods answer
OpenAI-shaped 404 and 405 too. The router runs as a process over a sim engine. A table of requests
whose fate in vLLM 0.32 is known checks the document and the router's parsing against vLLM."""

from __future__ import annotations

import copy
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings, strategies
from schemathesis import GenerationMode
from schemathesis.checks import (
    CheckFunction,
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)
from service_auth import SERVICE_TOKEN

from llumnix.launch.child_process import ChildCommand, ChildProcess
from llumnix.launch.pair import EnginePair, free_port
from llumnix.openai_request import OpenAIRequestError
from llumnix.openai_stream import EndpointKind
from llumnix.router.client_request import PrioritySettings, RequestLimits, parse_client_request
from llumnix.router.openapi import openapi_document
from llumnix.sim_engine.tokens import VOCAB_SIZE

# hypothesis imports its random strategy's module on first use; schemathesis's negative mode first uses
# it deep in a recursive draw, and CPython 3.11.7 compiling a module there can fail ("AST constructor
# recursion depth mismatch", seen on a fresh clone with no bytecode cached). Import it up here.
strategies.randoms().validate()

MODEL = "sim"
MAX_TOKENS = 8
EXAMPLES = 30
"""Per operation and mode: enough to reach every branch the router has, short enough for CI."""
CHECKS = (not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          positive_data_acceptance, negative_data_rejection)
JSON = "application/json"

# What a valid request may still be refused for, and why the document cannot say it:
MODEL_DEPENDENT = "maximum context length"
"""vLLM's (and the sim engine's) 400 for a prompt beyond the context: the model's, which the
router's document does not know (and a count of tokens, which no JSON Schema keyword states)."""
SIM_LIMITATION = "not supported by the simulated engine"
"""The sim engine's 400 for what it does not model (n > 1, echo, logprobs...), which vLLM serves."""


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
def router_document(router_url: str) -> dict[str, Any]:
    response = requests.get(router_url + "/openapi.json", timeout=10)
    response.raise_for_status()
    document: dict[str, Any] = response.json()
    return document


def _schema(document: dict[str, Any], base_url: str) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_dict(document)
    schema.config.update(base_url=base_url)
    # 413 (a body beyond --max-body-bytes) is one more answer to either: a limit on bytes, which no
    # JSON Schema keyword states.
    checks = schema.config.checks
    for check in (checks.positive_data_acceptance, checks.negative_data_rejection):
        check.expected_statuses = [*check.expected_statuses, "413"]
    return schema


@pytest.fixture(scope="module")
def router_schema(router_url: str, router_document: dict[str, Any]) -> schemathesis.BaseSchema:
    return _schema(router_document, router_url)


def _request_schema(document: dict[str, Any], path: str) -> dict[str, Any]:
    schema: dict[str, Any] = document["paths"][path]["post"]["requestBody"]["content"][JSON]["schema"]
    return schema


def _within_the_sim_model(document: dict[str, Any]) -> dict[str, Any]:
    """The document with prompts the sim engine's model serves: token ids within its vocabulary, and a
    batch of one prompt (vLLM serves batches; the sim engine refuses them). The vocabulary is the
    model's, which the router's document cannot know; valid requests are drawn from this one, so that
    the examples go to what the router and the engine must accept rather than to those refusals."""
    narrowed = copy.deepcopy(document)
    for branch in _request_schema(narrowed, "/v1/completions")["properties"]["prompt"]["oneOf"]:
        items = branch.get("items", {})
        if items.get("type") == "integer":
            items["maximum"] = VOCAB_SIZE - 1
        elif items.get("type") == "string":
            branch["maxItems"] = 1
        elif items.get("type") == "array":
            items["items"]["maximum"] = VOCAB_SIZE - 1
            branch["maxItems"] = 1
    return narrowed


def _as_the_sim_reads_messages(document: dict[str, Any]) -> schemathesis.BaseSchema:
    """The document with chat messages as the sim engine reads them: a role and any content (a
    string, a list of anything, or null; it keeps the text parts). vLLM checks content parts against
    the types it knows and the model's modalities, and refuses null content except the assistant's."""
    lenient = copy.deepcopy(document)
    _request_schema(lenient, "/v1/chat/completions")["properties"]["messages"]["items"] = {
        "type": "object", "required": ["role"], "properties": {"role": {"type": "string"}, "content": {
            "anyOf": [{"type": "string", "nullable": True}, {"type": "array"}]}}}
    return schemathesis.openapi.from_dict(lenient)


def _error_message(response: schemathesis.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return ""


def _not_a_disagreement(case: schemathesis.Case, response: schemathesis.Response, mode: GenerationMode,
                        document: dict[str, Any], sim_reading: schemathesis.BaseSchema,
                        base_url: str) -> list[CheckFunction]:
    """The acceptance or rejection check to leave out for this answer, each for a stated reason."""
    status = response.status_code
    if mode is GenerationMode.POSITIVE and 400 <= status < 500 and isinstance(case.body, dict):
        message = _error_message(response)
        if MODEL_DEPENDENT in message or SIM_LIMITATION in message:
            return [positive_data_acceptance]
        # A field the document does not declare passes to the engine, which validates it (vLLM's
        # `n`, `stop`, `logprobs`...: hypothesis draws such names from the code it runs): refused only
        # for those, the request is accepted without them.
        declared = _request_schema(document, case.path)["properties"]
        if set(case.body) - set(declared):
            without = {key: value for key, value in case.body.items() if key in declared}
            if requests.post(base_url + case.path, json=without, timeout=60).ok:
                return [positive_data_acceptance]
    if (mode is GenerationMode.NEGATIVE and status < 400 and case.path == "/v1/chat/completions"
            and sim_reading[case.path]["POST"].get_body_for_media_type(JSON).is_valid(case.body)):
        return [negative_data_rejection]  # broken only in a message's content, which the sim reads leniently
    return []


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_valid_requests_are_accepted_invalid_ones_refused_and_none_gets_a_server_error(
        router_schema: schemathesis.BaseSchema, router_document: dict[str, Any], router_url: str,
        mode: GenerationMode) -> None:
    """Requests that follow the schema (positive) get no 4xx but the documented business answers;
    requests that break it (negative) get a 4xx; no request gets a 5xx or an undocumented answer."""
    sim_reading = _as_the_sim_reads_messages(router_document)
    schema = (_schema(_within_the_sim_model(router_document), router_url) if mode is GenerationMode.POSITIVE
              else router_schema)
    for result in schema.get_all_operations():
        operation = result.ok()
        if mode is GenerationMode.NEGATIVE and not operation.label.startswith("POST"):
            continue  # nothing to break in a GET without parameters

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def call(case: schemathesis.Case) -> None:
            response = case.call(timeout=60)
            left_out = _not_a_disagreement(case, response, mode, router_document, sim_reading, router_url)
            case.validate_response(response, checks=CHECKS, excluded_checks=left_out)

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


# Fields the router reads itself (the llumlet sets its own before the engine), added to a plain request,
# and whether vLLM 0.32's request validation takes them: the document and the router must agree with it.
VLLM_ANSWERS: list[tuple[dict[str, Any], bool]] = [
    ({"stream": True}, True), ({"stream": None}, True), ({"stream": 0}, True), ({"stream": 1.0}, True),
    ({"stream": "yes"}, True), ({"stream": "False"}, True), ({"stream": "1"}, True), ({"stream": 2}, False),
    ({"stream": 0.5}, False), ({"stream": ""}, False), ({"stream": "x"}, False), ({"stream": []}, False),
    ({"stream": {}}, False), ({"return_token_ids": "ON"}, True), ({"return_token_ids": []}, False),
    ({"stream_options": None}, True), ({"stream_options": {}}, True),
    ({"stream_options": {"include_usage": False}}, False),
    ({"stream": 0, "stream_options": {"include_usage": True}}, False),
    ({"stream": True, "stream_options": {"include_usage": "yes", "other": 1}}, True),
    ({"stream": "false", "stream_options": {"include_usage": True}}, True),  # vLLM reads the raw value
    ({"stream": True, "stream_options": {"include_usage": "x"}}, False),
    ({"stream": True, "stream_options": {"continuous_usage_stats": 2}}, False),
    ({"stream": True, "stream_options": "x"}, False), ({"stream_options": []}, False),
]
# Chat messages, which the engine validates (the router passes them on): the document must agree with vLLM.
VLLM_MESSAGES: list[tuple[list[Any], bool]] = [
    ([{"role": "tool", "content": "a"}], True), ([{"role": "user"}], True),
    ([{"role": "assistant", "content": None}], True), ([{"role": "user", "content": None}], False),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}], True),
    ([{"role": "user", "content": 5}], False), ([{"role": 5, "content": "a"}], False),
    ([{"content": "a"}], False), (["x"], False),
]
# The priority field: the router's strings (any case) and null, which it removes, and vLLM's integers,
# which it passes on (a fraction too: the engine refuses it).
PRIORITIES: list[tuple[Any, bool]] = [("HIGH", True), ("low", True), (None, True), (-1, True), (2.0, True),
                                      ("urgent", False), ("", False), ("high\n", False)]


def _documented_and_parsed(endpoint: EndpointKind, body: dict[str, Any]) -> tuple[bool, bool]:
    schema = schemathesis.openapi.from_dict(openapi_document(MODEL, RequestLimits(max_tokens=MAX_TOKENS),
                                                             PrioritySettings()))
    path = "/v1/chat/completions" if endpoint is EndpointKind.CHAT else "/v1/completions"
    documented = schema[path]["POST"].get_body_for_media_type(JSON).is_valid(body)
    try:
        parse_client_request(endpoint, body, {}, RequestLimits(max_tokens=MAX_TOKENS), PrioritySettings())
    except OpenAIRequestError:
        return documented, False
    return documented, True


@pytest.mark.parametrize("endpoint", list(EndpointKind))
def test_the_document_and_the_router_read_requests_as_vllm_does(endpoint: EndpointKind) -> None:
    chat = endpoint is EndpointKind.CHAT
    plain: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    for fields, vllm_takes in VLLM_ANSWERS:
        assert _documented_and_parsed(endpoint, {**plain, **fields}) == (vllm_takes, vllm_takes), fields
    for priority, router_takes in PRIORITIES:
        body = {**plain, "priority": priority}
        assert _documented_and_parsed(endpoint, body) == (router_takes, router_takes), priority
    if chat:
        for messages, vllm_takes in VLLM_MESSAGES:
            documented, parsed = _documented_and_parsed(endpoint, {"messages": messages})
            assert documented == vllm_takes and (parsed or not vllm_takes), messages
