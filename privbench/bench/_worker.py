"""Fresh-process entry point of the benchmarks: ``python -m privbench.bench._worker '<json spec>'``.

The spec is ``{"target": "privbench.bench.<module>:<function>", "kwargs": {...}}``. The worker calls
``function(**kwargs)`` and prints its result (a JSON object) on one stdout line behind
``PRIVBENCH_BENCH_RESULT ``; on an error it prints the traceback on stderr and
``PRIVBENCH_BENCH_ERROR {"type", "message"}`` on stdout, and exits 1. Only functions of the
``privbench.bench`` package can be targets.
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback
from typing import Any

from privbench.bench.harness import ERROR_MARKER, RESULT_MARKER


def _error(exc: BaseException) -> int:
    traceback.print_exc()
    print(ERROR_MARKER + json.dumps({"type": type(exc).__name__, "message": str(exc)}), flush=True)
    return 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if len(argv) != 1:
            raise ValueError("usage: python -m privbench.bench._worker '<json spec>'")
        spec = json.loads(argv[0])
        module_name, _, fn_name = str(spec["target"]).partition(":")
        if not module_name.startswith("privbench.bench.") or not fn_name:
            raise ValueError(f"target must be 'privbench.bench.<module>:<function>', got {spec['target']!r}")
        fn = getattr(importlib.import_module(module_name), fn_name)
        result: Any = fn(**spec.get("kwargs", {}))
        line = json.dumps(result)
    except BaseException as exc:  # noqa: BLE001 - report everything, KeyboardInterrupt included
        return _error(exc)
    print(RESULT_MARKER + line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
