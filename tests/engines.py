"""The inference engines' real storage interfaces, for the adapter tests.

LMCache and SGLang are installed without their dependency trees (``pip install --no-deps
lmcache==0.5.6 sglang==0.5.23``, then a few small packages: docs/kvcache-engines.md).
Their package roots pull in whole engines: ``sglang/__init__`` imports triton,
transformers and the serving stack, ``lmcache.v1.storage_backend``'s ``__init__`` every
backend (transformers, GPU Direct Storage...). Where that fails, the package is entered
without running its ``__init__``: the modules that define the interfaces, and those they
import, are still the packages' own files, so a changed interface breaks the tests.
Without the engines installed, the tests skip and say why; under ``deploy/test.sh``
(``PFS_REQUIRE_ENGINES=1``: setup.sh installed them) they fail instead.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
import warnings
from typing import NoReturn

import pytest


def _skip(why: str) -> NoReturn:
    if os.environ.get("PFS_REQUIRE_ENGINES"):
        pytest.fail(f"PFS_REQUIRE_ENGINES is set but {why}")
    pytest.skip(why, allow_module_level=True)


def load(module: str, package: str) -> types.ModuleType:
    """Import ``module``; if its engine cannot import whole, again with ``package``'s
    ``__init__`` left out. Skips the calling test module when even that fails."""
    with warnings.catch_warnings():  # the engines' import-time warnings are not ours
        warnings.simplefilter("ignore")
        root = package.partition(".")[0]
        if importlib.util.find_spec(root) is None:
            _skip(f"{root} is not installed (docs/kvcache-engines.md: Installing)")
        try:
            return importlib.import_module(module)
        except ImportError as whole:
            reason = f"{module} does not import whole ({whole})"
        try:
            spec = importlib.util.find_spec(package)
            if spec is None or spec.submodule_search_locations is None:
                _skip(f"{package} is not a package ({reason})")
            bare = types.ModuleType(package)
            bare.__path__ = list(spec.submodule_search_locations)
            bare.__spec__ = spec
            sys.modules[package] = bare
            parent, _, name = package.rpartition(".")
            if parent:
                setattr(sys.modules[parent], name, bare)
            return importlib.import_module(module)
        except ImportError as exc:
            _skip(f"{module}: {exc} ({reason})")
