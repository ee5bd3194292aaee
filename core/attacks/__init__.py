"""Attacks on privacy-preserving Transformers, and the defences they measure.

* ``seb``: Subword Embedding from Bytes (SEB paper, Sec. 4), a drop-in input/output embedding for causal LMs;
* ``federated``: FedSGD clients and server (Sec. 3.2, eq. 1);
* ``film``: the FILM attack (candidates from embedding gradients, beam search with an LM prior, reordering,
  ROUGE); ``evaluate``: FILM end to end against one victim; ``vocab``: compact vocabularies and the prior;
* ``lm`` and ``translation``: the small models of SEB's utility comparison (Sec. 5.2);
* ``membership``: loss-threshold and LiRA membership inference, ROC, empirical epsilon with Clopper-Pearson
  bounds; ``audit``: the audit of a trained model with recorded membership.
"""
