"""The result caches: L1 in-process and L2 exact in the store (``results``), L3 semantic (``l3``) over a FAISS index
(``semantic_index``) of embedded request texts (``embedder``).

This package is the feature's public face: the submit path and the app import from here, never from its modules.
"""

from fleet.producers.gateway.cache.embedder import TextModel
from fleet.producers.gateway.cache.results import Hit, Lookup, ResultCache, build_cache

__all__ = ["Hit", "Lookup", "ResultCache", "TextModel", "build_cache"]
