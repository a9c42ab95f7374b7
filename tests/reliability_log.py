"""What the fault tests measured, for docs/reliability.md. With LLMGW_RELIABILITY_LOG=FILE set,
`record()` appends one JSON line to FILE; `tools/reliability_table.py --measured FILE` turns
those lines into the doc's rows (it defines and checks the fields). Unset: nothing is written,
the test's assertions are all there is."""

from __future__ import annotations

import datetime
import json
import os

LOG_ENV = "LLMGW_RELIABILITY_LOG"


def record(test: str, **fields: object) -> None:
    """Append the measurements of the test with node id `test` (one line, appended whole)."""
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    row = {
        "test": test,
        "measured_on": datetime.date.today().isoformat(),
        "cores": os.cpu_count() or 0,
        **fields,
    }
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, sort_keys=True) + "\n")
