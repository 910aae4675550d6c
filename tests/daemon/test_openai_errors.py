"""The `openai` SDK as a client of `lb`: `/v1/models`, and lb's errors arriving as the SDK's
typed exceptions with the OpenAI error object (`message`, `type`, `param`, `code`) intact."""
from __future__ import annotations

import openai
import pytest

from tests.daemon.conftest import needs_emulator, start_lb_with_emulator

pytestmark = needs_emulator
MSG = [{"role": "user", "content": "hi"}]


def test_sdk_models_and_typed_errors(procs, tmp_path):
    d, _ = start_lb_with_emulator(procs, tmp_path, '[fairness]\nthrottle = "rpm"\nuser_rpm = 1\n', "--speed", "50")
    client = openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["m"]

    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="nope", messages=MSG, max_tokens=2)
    assert nf.value.status_code == 404 and nf.value.code == "model_not_found" and nf.value.param == "model"
    assert "nope" in nf.value.message

    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="m", messages=MSG, max_tokens=-1)
    assert bad.value.status_code == 400 and bad.value.param == "max_tokens"
    assert bad.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as bad_n:  # parallel samples: a positive integer
        client.chat.completions.create(model="m", messages=MSG, max_tokens=2, n=0)
    assert bad_n.value.status_code == 400 and bad_n.value.param == "n"

    # RPM limit 1 per tenant: the SDK's `user` names the tenant
    assert client.chat.completions.create(model="m", messages=MSG, max_tokens=2, user="alice").choices
    with pytest.raises(openai.RateLimitError) as limited:
        client.chat.completions.create(model="m", messages=MSG, max_tokens=2, user="alice")
    assert limited.value.status_code == 429 and limited.value.code == "rate_limit_exceeded"
    assert int(limited.value.response.headers["retry-after"]) >= 1
    assert client.chat.completions.create(model="m", messages=MSG, max_tokens=2, user="bob").choices
