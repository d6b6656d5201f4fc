"""The tenant of --schedule-policy dlpm reaches the scheduler: a /generate body's routing_key, or
the X-SMG-Routing-Key / X-Tenant header (the OpenAI routes' only way)."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from radixengine.entrypoints.native_routes import native_requests
from radixengine.entrypoints.request_runner import tag_routing_key
from radixengine.managers.io_struct import GenerateReqInput


def http_request(headers: dict[str, str]) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/generate", "headers": raw})


def test_body_routing_key_wins_over_the_header():
    objs, _ = native_requests({"text": ["a", "b"], "routing_key": "team-a"})
    tag_routing_key(http_request({"X-Tenant": "team-b"}), objs)
    assert [o.routing_key for o in objs] == ["team-a", "team-a"]


@pytest.mark.parametrize("header", ["X-SMG-Routing-Key", "X-Tenant"])
def test_header_names_the_tenant(header):
    objs = [GenerateReqInput(text="a"), GenerateReqInput(text="b")]
    tag_routing_key(http_request({header: "team-c"}), objs)
    assert [o.routing_key for o in objs] == ["team-c", "team-c"]
    untagged = [GenerateReqInput(text="a")]
    tag_routing_key(http_request({}), untagged)
    assert untagged[0].routing_key is None


def test_a_batch_body_may_name_one_tenant_per_prompt():
    objs, _ = native_requests({"text": ["a", "b"], "routing_key": ["team-a", None]})
    tag_routing_key(http_request({"X-Tenant": "team-b"}), objs)
    assert [o.routing_key for o in objs] == ["team-a", "team-b"]
