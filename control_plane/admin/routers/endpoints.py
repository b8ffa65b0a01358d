"""``/v1/endpoints``: list, register, deregister; pin a weight and drain (``endpoint_actions``)."""

from __future__ import annotations

import typing
from collections.abc import Sequence

from fastapi import APIRouter, Path, Response
from fastapi.params import Depends

from ...api_models import EndpointCreate, EndpointList, EndpointOut, WeightPin
from ..endpoint_actions import EndpointActions
from ..errors import E400, E401, E404, E409, E422, E503, responses

EndpointId = typing.Annotated[str, Path(description="host:port", examples=["127.0.0.1:8101"], max_length=300)]


def endpoints_router(endpoints: EndpointActions, auth: Sequence[Depends]) -> APIRouter:
    router = APIRouter(prefix="/v1/endpoints", tags=["endpoints"], dependencies=auth, responses=E401)

    @router.get("", response_model=EndpointList,
                summary="Every endpoint: source, health, drain state, weights and latest telemetry")
    async def list_endpoints() -> EndpointList:
        return endpoints.endpoints()

    @router.post("", response_model=EndpointOut, status_code=201, summary="Register an endpoint (source api)",
                 responses=responses(E400, E409, E422, E503))
    async def register(body: EndpointCreate, response: Response) -> EndpointOut:
        out = await endpoints.register(body)
        response.headers["Location"] = f"/v1/endpoints/{out.id}"
        return out

    @router.get("/{endpoint_id}", response_model=EndpointOut, summary="One endpoint",
                responses=responses(E404, E422))
    async def get_endpoint(endpoint_id: EndpointId) -> EndpointOut:
        return endpoints.get(endpoint_id)

    @router.delete("/{endpoint_id}", response_model=EndpointOut, status_code=202,
                   summary="Deregister an API endpoint: drain it, then remove it (202: removal under way)",
                   responses=responses(E404, E409, E422, E503))
    async def deregister(endpoint_id: EndpointId) -> EndpointOut:
        return await endpoints.deregister(endpoint_id)

    @router.put("/{endpoint_id}/weight", response_model=EndpointOut,
                summary="Pin the weight (1..1000): it beats the weight policy",
                responses=responses(E400, E404, E409, E422, E503))
    async def pin(endpoint_id: EndpointId, body: WeightPin) -> EndpointOut:
        return await endpoints.pin(endpoint_id, body.weight)

    @router.delete("/{endpoint_id}/weight", response_model=EndpointOut,
                   summary="Unpin: the weight policy decides again", responses=responses(E404, E409, E422, E503))
    async def unpin(endpoint_id: EndpointId) -> EndpointOut:
        return await endpoints.pin(endpoint_id, None)

    @router.post("/{endpoint_id}/drain", response_model=EndpointOut,
                 summary="Drain: no new traffic, in-flight requests finish",
                 responses=responses(E404, E409, E422, E503))
    async def drain(endpoint_id: EndpointId) -> EndpointOut:
        return await endpoints.drain(endpoint_id, True)

    @router.delete("/{endpoint_id}/drain", response_model=EndpointOut, summary="Undrain: new traffic again",
                   responses=responses(E404, E409, E422, E503))
    async def undrain(endpoint_id: EndpointId) -> EndpointOut:
        return await endpoints.drain(endpoint_id, False)

    return router
