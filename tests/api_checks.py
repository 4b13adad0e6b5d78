"""What this API is held to beyond Schemathesis's stock checks: by the in-process fuzz
(``tests/unit/test_api_fuzz.py``) and by the CLI run against a live job
(``tests/e2e/test_api_fuzz_live.py``, which loads this module as its hooks)."""

from __future__ import annotations

import schemathesis


@schemathesis.check
def no_unhandled_error(ctx, response, case) -> None:
    """A 500 is a bug. A 502 or 503 is the documented answer while an agent or the Lighthouse is
    away; the stock document check holds them to it (so ``not_a_server_error``, which fails
    every 5xx, is left out)."""
    if response.status_code == 500:
        raise AssertionError(f"500 from {case.method} {case.formatted_path}: {response.text[:300]}")
