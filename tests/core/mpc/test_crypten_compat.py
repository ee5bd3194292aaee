from __future__ import annotations

import sys

from core.mpc.crypten_compat import import_crypten

from .conftest import require_crypten

require_crypten()


def test_import_is_idempotent_and_counts_communication() -> None:
    c1 = import_crypten()
    c2 = import_crypten()
    assert c1 is c2 is sys.modules["crypten"]
    assert c1.cfg.communicator.verbose is True
