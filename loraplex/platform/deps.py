"""FastAPI dependencies, with `Annotated` aliases the routes use."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Header, Request

from loraplex.platform.errors import APIError
from loraplex.platform.state import Platform
from loraplex.platform.tenancy import Caller


async def get_platform(request: Request) -> Platform:
    return request.app.state.platform


PlatformDep = Annotated[Platform, Depends(get_platform)]


async def get_caller(
    platform: PlatformDep, authorization: Annotated[str | None, Header()] = None
) -> Caller:
    platform.require_engine()
    return await platform.directory.authenticate(authorization)


CallerDep = Annotated[Caller, Depends(get_caller)]


async def require_admin(
    platform: PlatformDep, authorization: Annotated[str | None, Header()] = None
) -> None:
    scheme, _, token = (authorization or "").partition(" ")
    valid = scheme.lower() == "bearer" and hmac.compare_digest(
        token.strip().encode(), platform.admin_token.encode()
    )
    if not valid:
        raise APIError(401, "A valid admin token is required.", code="invalid_admin_token")


AdminDep = Depends(require_admin)
