"""STIP: secure Transformer inference by a secret permutation of the model dimension.

Yuan et al., "Secure Transformer Inference" (Theorem 1, Algorithm 1). Modules:

- ``core.stip.transform``: ``random_permutation``, ``check_permutation``, ``permute_model``
  (GPT-2 and LLaMA blocks, final norm), ``permute_vocab`` (secret vocabulary substitution).
- ``core.stip.parties``: the three-party protocol (P1 developer, P2 cloud, P3 user) in separate
  processes (``run_stip``) or in one process (``run_stip_inprocess``), two designs.
- ``core.stip.models``: tiny GPT-2/Llama for tests and ``load_smollm2`` (real weights).

Import the submodules directly; this package imports nothing heavy (no transformers at import).
"""
