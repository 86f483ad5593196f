"""Tenant scoping of everything one client API caller could otherwise observe about another.

With ``--auth-tokens-file`` every call carries a bearer token that names a tenant; without it every caller is the
tenant ``""`` and nothing below changes behaviour. Per tenant:

- uploads are stored under (tenant, sha256): another tenant's hash is NOT_FOUND with the unknown-hash message;
- processor-cache entries are keyed by (tenant, sha256), so a hit's speed says nothing about other tenants;
- item identifiers hash the tenant in (``item_identifier(..., scope=tenant)``), so the prefix cache's extra keys
  and the ranks' payload/encoder caches, all keyed by identifier, never match across tenants;
- the prefix-cache salt of the first block is (tenant, client salt), so no block — text or image — is shared;
- request ids are scoped, so a duplicate id is ALREADY_EXISTS only within a tenant.

Shared on purpose: the model, the byte budgets of the caches (one tenant's traffic can evict another's entries)
and the step batch (load is visible to everyone as latency).
"""

from __future__ import annotations

from common.ids import RequestId


def scoped_request_id(tenant: str, request_id: str) -> RequestId:
    """The engine's id of a client's request: tenant names never contain '/', so the first '/' separates them."""
    return RequestId(f"{tenant}/{request_id}" if tenant else request_id)


def scoped_cache_salt(tenant: str, salt: str) -> str | None:
    """The prefix-cache salt: the client's, separated per tenant. Tenant names never contain NUL."""
    if not tenant:
        return salt or None
    return f"{tenant}\x00{salt}"
