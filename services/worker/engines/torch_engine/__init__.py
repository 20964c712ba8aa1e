"""The ``torch`` engine: a real Llama-family decoder over paged KV (needs the ``torch`` extra).

``config.py`` (``ModelConfig``: a folder's ``config.json``; imports no torch),
``model.py`` (paged decoder), ``engine.py`` (``TorchEngine``: plans →
forwards, physical KV map kept by the pools' events), ``checkpoint.py``
(``evolving-infra model init``), ``local.py`` (core + engine in one process).
Import the submodules directly; this package imports nothing so the core
install (without torch) can list it.
"""
