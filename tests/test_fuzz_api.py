"""The OpenAPI-driven fuzzer of bench/fuzz_api.py against a server with keys, on CI's small fixed
budget (derandomized: the same requests each run): no 5xx, no write without a write key, errors
and answers as declared, nothing acknowledged lost."""

from __future__ import annotations

import sys
import time

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from fuzz_api import fuzz, make_app  # noqa: E402

EXAMPLES = 400


def test_the_schema_driven_fuzzer_finds_nothing(tiny_encoder, tmp_path):
    t0 = time.perf_counter()
    result = fuzz(make_app(tiny_encoder, tmp_path / "store"), EXAMPLES, seed_value=32, derandomize=True)
    assert result["requests"] == EXAMPLES
    found = {
        k: result[k]
        for k in (
            "server_errors_5xx",
            "unauthenticated_writes_accepted",
            "malformed_error_bodies",
            "nonconforming_answers",
            "data_lost",
        )
    }
    assert found == dict.fromkeys(found, 0), (found, result["examples"], result["lost"])
    statuses = {int(s) // 100 for s in result["statuses"]}
    assert statuses == {2, 4}, result["statuses"]  # it reached the routes, and was refused where it should be
    assert time.perf_counter() - t0 < 60
