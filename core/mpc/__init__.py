"""Encrypted Transformer inference and generation under 2-party MPC (CrypTen), MERGE, MPCFormer/THE-X.

Modules: :mod:`~core.mpc.crypten_compat` (the one CrypTen import point), :mod:`~core.mpc.parties` (local and
per-host party launchers, :class:`~core.mpc.parties.PartyError`), :mod:`~core.mpc.accounting` (per-op
time/bytes/rounds), :mod:`~core.mpc.ops` (encrypted primitives), :mod:`~core.mpc.gpt2` (encrypted GPT-2 and
generation modes vanilla / vanilla_kv / vanilla_er / merge), :mod:`~core.mpc.approx`, :mod:`~core.mpc.merge`,
:mod:`~core.mpc.merge_spec` (plaintext approximations and MERGE training/export).

Nothing here imports CrypTen at package import time; it is loaded on first use.
"""
