"""The flow process of ``privbench run`` (``python -m privbench.runner``, see ``privbench.supervisor``).

The flow registry it runs from (``FLOWS``, ``run_flow``) lives in ``flows.registry``."""

from __future__ import annotations

if __name__ == "__main__":
    import sys

    from privbench.supervisor import child_main

    sys.exit(child_main(sys.argv[1:]))
