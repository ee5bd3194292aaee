"""STIP: secure Transformer inference by a secret permutation of the model dimension.

Yuan et al., "Secure Transformer Inference" (Theorem 1, Algorithm 1). Modules:

- ``core.stip.keys``: the secrets (``pi``, per-layer ``rho``, ``sigma``) from the OS CSPRNG, never from a seed
  (``secure_permutation``, ``draw_keys``, ``StipKeys``).
- ``core.stip.transform``: ``check_permutation``, ``permute_model`` (GPT-2 and LLaMA blocks, final norm),
  ``permute_vocab`` (secret vocabulary substitution), ``random_permutation`` (seeded: tests only).
- ``core.stip.parties``: the three-party protocol (P1 developer, P2 cloud, P3 user) in separate
  processes (``run_stip``) or in one process (``run_stip_inprocess``), two designs, and the float64 exactness
  check; ``core.stip.processes``: the spawned party processes and the audit of what each holds;
  ``core.stip.wire``: the frames, sockets and authenticated openings between them.
- ``core.stip.attacks``: attacks on the model-dimension permutation (weight matching, activation statistics,
  what a recovered permutation reveals); ``core.stip.vocab_attack``: frequency analysis of the permuted
  vocabulary; ``core.stip.evaluate``: both measured on one model.
- ``core.stip.models``: ``randomize_norms``, a tiny Llama for tests, ``load_smollm2`` (real weights) and
  ``build_model`` (the model of one STIP model spec, a ``core.models.gpt2.tiny_gpt2`` or SmolLM2, shared by
  the tasks and the benchmark).

Import the submodules directly; this package imports nothing heavy (no transformers at import).
"""
