"""The admin HTTP API over a `ControlLoop` (served by `llumnix up`; the operator can mount the same app):

    GET  /instances                    the service status (instances, loads, counters) as JSON
    POST /instances/{id}/drain         stop sending requests there, migrate its requests out, release it
    POST /instances/{id}/undrain       cancel that
    POST /migrate {"source", "destination", "request_id"?}   move one request now (the source's choice
                                       when request_id is absent); answers with the migration's outcome
Errors are JSON {"error": message} with 400 (bad body), 404 (unknown instance) or 502 (llumlet call).
"""

from __future__ import annotations

import json

import grpc
from aiohttp import web

from llumnix.control.fleet import UnknownInstance
from llumnix.control.loop import ControlLoop
from llumnix.control.migration_pass import outcome_name

LOOP_KEY = web.AppKey("control_loop", ControlLoop)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def _status(request: web.Request) -> web.Response:
    return web.json_response(request.app[LOOP_KEY].status().to_json())


async def _set_draining(request: web.Request, draining: bool) -> web.Response:
    loop = request.app[LOOP_KEY]
    instance_id = request.match_info["instance_id"]
    try:
        await (loop.drain(instance_id) if draining else loop.undrain(instance_id))
    except UnknownInstance as exc:
        return _error(404, str(exc))
    return web.json_response({"instance_id": instance_id, "draining": draining})


async def _drain(request: web.Request) -> web.Response:
    return await _set_draining(request, True)


async def _undrain(request: web.Request) -> web.Response:
    return await _set_draining(request, False)


async def _migrate(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except json.JSONDecodeError:
        return _error(400, 'the body must be JSON: {"source": ID, "destination": ID, "request_id"?: ID}')
    if not isinstance(body, dict) or not isinstance(body.get("source"), str) \
            or not isinstance(body.get("destination"), str):
        return _error(400, "source and destination (instance ids) are required")
    request_id = body.get("request_id")
    if request_id is not None and not isinstance(request_id, str):
        return _error(400, "request_id must be a string")
    try:
        result = await request.app[LOOP_KEY].migrate(request_id, body["source"], body["destination"])
    except UnknownInstance as exc:
        return _error(404, str(exc))
    except ValueError as exc:
        return _error(400, str(exc))
    except grpc.aio.AioRpcError as exc:
        return _error(502, f"the source llumlet answered {exc.code().name}: {exc.details()}")
    return web.json_response({
        "outcome": outcome_name(result.outcome), "request_id": result.request_id,
        "migration_id": result.migration_id, "reason": result.reason, "stages": result.stages,
        "migrated_tokens": result.migrated_tokens, "downtime_ms": result.downtime_ms,
        "duration_ms": result.duration_ms, "downtime_parts_ms": {
            "final_stage": result.final_stage_ms, "final_stage_kv": result.final_stage_kv_ms,
            "final_stage_event": result.final_stage_event_ms, "commit": result.commit_ms,
            "destination_first_token": result.destination_first_token_ms,
            "destination_admitted": result.destination_admitted_ms,
            "destination_kv_load": result.destination_kv_load_ms},
    })


def admin_app(loop: ControlLoop) -> web.Application:
    app = web.Application()
    app[LOOP_KEY] = loop
    app.router.add_get("/instances", _status)
    app.router.add_post("/instances/{instance_id}/drain", _drain)
    app.router.add_post("/instances/{instance_id}/undrain", _undrain)
    app.router.add_post("/migrate", _migrate)
    return app
